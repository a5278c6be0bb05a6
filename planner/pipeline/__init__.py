"""The driver: every command that plans or compiles, as pass lists run by `core/pass_manager.py`.

One file per target (`torchrun.py` also for kubernetes, `lambda_.py`, `engine_targets.py` for
sglang, vllm and trtllm, `offload.py`) lists its passes, turns the flags into the facts the list starts
from (`inputs`) and summarises what it made (`summary`, `describe`); the passes themselves live
beside what they run, in `passes/` and `backends/`. `place.py` is `moeplan place`'s list, `flags.py`
holds every option and the targets it applies to, `targets.py` is the registry that names the
targets and runs them, and `run.py` runs a torchrun bundle and checks it against its plan.
"""
