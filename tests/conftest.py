"""Suite-wide settings that must precede any torch import."""
import os

# Busy-waiting OpenMP threads starve each other when tests, torchrun ranks and other processes
# share two cores; passive waiting keeps 2-thread torch jobs from slowing down many-fold.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A served rank alone on the CPU compiles its decode step before it is ready (15-60 s here); the suite's many
# service starts run eager steps, and tests/test_compiled_decode.py turns the compiled path on where it checks it.
os.environ.setdefault("MOEPLAN_COMPILE", "0")

from pathlib import Path

import pytest

# The slow tier beside the tests marked `@pytest.mark.slow` in their files: node ids measured slow on
# the 2-core machine (`pytest --durations=0`), one per line; a line without `[...]` takes every
# parametrisation of that test. Each end-to-end path keeps a faster test in `make test`.
SLOW_LIST = Path(__file__).with_name("slow_tests.txt")


def _listed_slow() -> frozenset[str]:
    lines = SLOW_LIST.read_text().splitlines() if SLOW_LIST.exists() else []
    ids = (line.split("#", 1)[0].strip() for line in lines)
    return frozenset(node_id for node_id in ids if node_id)


def pytest_collection_modifyitems(config, items):
    listed = _listed_slow()
    for item in items:
        if item.nodeid in listed or item.nodeid.split("[", 1)[0] in listed:
            item.add_marker(pytest.mark.slow)
