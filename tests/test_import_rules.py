"""The layer rules of docs/architecture.md, checked on every import statement (top-level or inside functions).

Layers, bottom up: the bundle runtime (imports nothing of moeplan), the core (IR, plan, errors,
importers), analysis/optimisation passes, backends, the pipeline (pass lists), the commands.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# layer -> moeplan module prefixes it must not import
FORBIDDEN = {
    "runtime": ("moeplan",),
    "core": ("moeplan.passes", "moeplan.backends", "moeplan.planner.pipeline", "moeplan.planner.commands",
             "moeplan.planner.pass_manager", "moeplan.planner.cli"),
    "passes": ("moeplan.backends", "moeplan.planner.pipeline", "moeplan.planner.commands", "moeplan.planner.pass_manager",
               "moeplan.planner.cli"),
    "backends": ("moeplan.passes", "moeplan.planner.pipeline", "moeplan.planner.commands", "moeplan.planner.pass_manager",
                 "moeplan.planner.cli"),
    "pipeline": ("moeplan.planner.commands", "moeplan.planner.cli"),
    "benchmarks": ("moeplan.planner.commands", "moeplan.planner.cli"),
    "commands": (),
}
# layer -> prefixes it may import although FORBIDDEN names a folder above them: passes run the
# runtime's own rules (the replica rule, `backends/runtime/expert_table.py`) where they predict it
ALLOWED = {"passes": ("moeplan.backends.runtime",)}


def layer_of(rel: Path) -> str:
    parts = rel.parts
    if parts[:2] == ("backends", "runtime"):
        return "runtime"
    if parts[0] in ("passes", "backends", "benchmarks"):
        return parts[0]
    if parts[:2] in (("planner", "pipeline"),) or rel.as_posix() == "planner/pass_manager.py":
        return "pipeline"
    if parts[:2] == ("planner", "commands") or rel.as_posix() == "planner/cli.py":
        return "commands"
    return "core"


def imported_modules(path: Path) -> list:
    """(line, absolute module name) of every import; relative imports resolve inside their package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def sources():
    for folder in ("planner", "passes", "backends", "benchmarks"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_every_module_imports_only_from_the_layers_below_it():
    broken = []
    for path in sources():
        rel = path.relative_to(ROOT)
        forbidden, allowed = FORBIDDEN[layer_of(rel)], ALLOWED.get(layer_of(rel), ())
        for line, module in imported_modules(path):
            if any(_under(module, f) for f in forbidden) and not any(_under(module, a) for a in allowed):
                broken.append(f"{rel}:{line} imports {module} ({layer_of(rel)} layer)")
    assert broken == []


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_rule_checker_sees_imports_inside_functions(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("def f():\n    from moeplan.planner.commands.run import run\n")
    assert (2, "moeplan.planner.commands.run") in imported_modules(sample)
    assert layer_of(Path("backends/runtime/serve.py")) == "runtime"
    assert layer_of(Path("planner/pipeline/torchrun.py")) == "pipeline"
    assert layer_of(Path("planner/importers/resolve.py")) == "core"
