"""setup.py's mapping: a built wheel holds the package `moeplan` (api/), its subpackages, every
template and every runtime module, and what it installs imports and finds its templates."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("api", "core", "runtime", "planner", "passes", "backends", "templates", "setup.py", "pyproject.toml", "README.md")


def test_the_wheel_holds_the_api_templates_and_runtime_and_imports(tmp_path):
    src = tmp_path / "src"
    for name in SOURCES:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(
            ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / name).is_dir() else {}))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist")], check=True, cwd=src, capture_output=True)
    wheel = next((tmp_path / "dist").glob("moeplan-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "moeplan/__init__.py" in names and "moeplan/planner/cli.py" in names
    for path in sorted((ROOT / "templates").rglob("*.j2")) + sorted((ROOT / "runtime").rglob("*.py")):
        assert "moeplan/" + path.relative_to(ROOT).as_posix() in names, path

    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, capture_output=True)
    probe = ("import moeplan, importlib.resources as r; "
             "assert moeplan.__file__.startswith({!r}); "
             "assert callable(moeplan.compile) and callable(moeplan.plan); "
             "print(r.files('moeplan.templates.torchrun').joinpath('launch.sh.j2').is_file())").format(str(tmp_path / "site"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"), PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
