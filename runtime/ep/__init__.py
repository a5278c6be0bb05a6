"""Expert parallelism: the engine that runs a rank's forwards (`engine.py`), the all-to-all exchanges
(`exchange.py`), coherent mode's context rows (`context_exchange.py`) and the replica rule
(`expert_table.py`), which the planner's cost model and placement metric run too."""
