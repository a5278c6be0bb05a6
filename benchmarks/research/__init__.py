"""Research tools the benchmarks use and the planner does not: the placement gap's relaxations
(`relaxed_routing.py`), one layer pair solved exactly (`pair_milp.py`) and the layer-chain baseline
(`layer_chain.py`). Imported as `research.<module>` with benchmarks/ on sys.path."""
