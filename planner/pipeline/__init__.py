"""Every command that plans or compiles, as pass lists run by `core/pass_manager.py`.

`common.py` has the passes every target starts with (import, runtime files, trace), one file per
target adds its planning passes, its input facts and its summaries and ends with its codegen pass,
`flags.py` holds every option and the targets it applies to, and `targets.py` is the registry
that names the targets and runs them.
"""
