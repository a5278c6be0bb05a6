"""Local search over placements: `moves.py` defines the moves (exchange, re-slot) and the steepest exchange
searches; the other modules search with them, each valuing moves its own way (the even-split gain tables,
the planning trace routed as the metric routes it, or the expected held-out max load)."""
