"""Maps the design card's top-level folders into the single `moeplan` namespace.

`api/` is the package `moeplan` itself (its `__init__.py` is the Python API: `moeplan.compile`,
`moeplan.plan`, `moeplan.codegen`); `planner/`, `passes/`, `backends/` and `templates/` are its
subpackages. pyproject's static `package-dir` cannot list subpackages found under a renamed root,
so the mapping is computed here; everything else lives in pyproject.toml.
"""
from setuptools import find_packages, setup

ROOTS = ("planner", "passes", "backends", "templates")

packages, package_dir = ["moeplan"], {"moeplan": "api"}
for root in ROOTS:
    package_dir[f"moeplan.{root}"] = root
    packages.append(f"moeplan.{root}")
    packages += [f"moeplan.{root}.{sub}" for sub in find_packages(root)]

setup(packages=packages, package_dir=package_dir)
