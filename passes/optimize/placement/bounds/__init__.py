"""Lower bounds on the cross-GPU transitions of any placement within the load caps: `pairwise.py` bounds each
layer pair (LPs and counting, with per-token caps) and reports the total; `chain.py` prices whole GPU columns
over all layers where that fits the work budget."""
