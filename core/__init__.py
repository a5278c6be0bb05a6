"""The base layer: the types and rules every other layer may use (docs/architecture.md).

The model's IR (`ir.py`), the plan contract (`plan.py`), one-line user errors (`errors.py`),
hardware profiles and serverless platforms (`hardware.py`, `platforms.py` and their data),
atomic output (`atomic.py`), progress on a terminal (`progress.py`), the pass manager
(`pass_manager.py`) and small rules several layers share. It imports nothing of moeplan outside
`moeplan.core`.
"""
