"""Every command that plans or compiles, as pass lists run by `planner/pass_manager.py`.

`common.py` has the passes every target starts with (import, runtime files, trace), one file per
target adds its planning passes and ends with its codegen pass, and `targets.py` names the lists.
"""
