"""moeplan's expert-parallel runtime: the torch-only code every torchrun bundle ships and runs.

It never imports the planner (or anything outside torch, numpy, safetensors and the standard library):
bundles copy this folder next to their weights, so it must run without moeplan installed.
Modules use relative imports only, so the same files work as `moeplan.backends.runtime` and as a
bundle's top-level `runtime` package (`python -m runtime.serve`).
"""
