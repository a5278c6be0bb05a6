"""Maps the design card's top-level folders into the single `moeplan` namespace.

`api/` is the package `moeplan` itself (its `__init__.py` is the Python API: `moeplan.compile`,
`moeplan.plan`, `moeplan.codegen`); `core/`, `runtime/`, `planner/`, `passes/`, `backends/` and
`templates/` are its subpackages, one layer each (docs/architecture.md). pyproject's static `package-dir` cannot list subpackages found under a renamed root,
so the mapping is computed here; everything else lives in pyproject.toml.
"""
from setuptools import find_namespace_packages, find_packages, setup

ROOTS = ("core", "runtime", "planner", "passes", "backends", "templates")

packages, package_dir = ["moeplan"], {"moeplan": "api"}
for root in ROOTS:
    package_dir[f"moeplan.{root}"] = root
    packages.append(f"moeplan.{root}")
    # templates/<target>/ hold only data (*.j2): folders without __init__.py, found as namespace packages
    found = find_namespace_packages(root, exclude=["*__pycache__*"]) if root == "templates" else find_packages(root)
    packages += [f"moeplan.{root}.{sub}" for sub in found]

setup(packages=packages, package_dir=package_dir)
