"""The driver, the top layer: the target registry and pass lists (`pipeline/`), running bundles here
(`launch/`), the report (`report/`) and the CLI (`cli.py`, `commands/`); docs/architecture.md."""
