"""The library's model as the ranks and functions run it: built from the bundle's model files, its MoE
blocks replaced by the runtime's adapter (`library_model.py`, `moe_adapter.py`)."""
