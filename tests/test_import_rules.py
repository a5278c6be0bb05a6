"""The layer rules of docs/architecture.md, checked on every import statement (top-level or inside functions).

Layers, bottom up: the bundle runtime (imports nothing of moeplan), the core (IR, plan, errors,
importers), analysis/optimisation passes (which may use the runtime's modules: the simulator runs the
code bundles run), backends, the pipeline (pass lists, the target registry), the commands and the
Python API (`api/`, the package `moeplan` itself; it does not go through the CLI).
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
    "api": ("moeplan.planner.commands", "moeplan.planner.cli"),
}
# exceptions inside a forbidden prefix: passes simulate with the very code bundles run (the expert
# cache's policy modules live once, in the runtime, and the planner imports them from there)
ALLOWED = {"passes": ("moeplan.backends.runtime",)}


def layer_of(rel: Path) -> str:
    parts = rel.parts
    if parts[:2] == ("backends", "runtime"):
        return "runtime"
    if parts[0] == "api":
        return "api"
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
    for folder in ("api", "planner", "passes", "backends", "benchmarks"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_every_module_imports_only_from_the_layers_below_it():
    broken = []
    for path in sources():
        rel = path.relative_to(ROOT)
        forbidden, allowed = FORBIDDEN[layer_of(rel)], ALLOWED.get(layer_of(rel), ())
        for line, module in imported_modules(path):
            inside = lambda prefixes: any(module == f or module.startswith(f + ".") for f in prefixes)  # noqa: E731
            if inside(forbidden) and not inside(allowed):
                broken.append(f"{rel}:{line} imports {module} ({layer_of(rel)} layer)")
    assert broken == []


def test_the_runtime_imports_only_modules_of_the_runtime_package():
    """Relative imports in backends/runtime/ name modules that exist there: the runtime never relies
    on a file that only a bundle has (bundles copy these files verbatim, backends/common/files.py)."""
    runtime = ROOT / "backends" / "runtime"
    missing = []
    for path in sorted(runtime.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                base = path.parent
                for _ in range(node.level - 1):
                    base = base.parent
                target = base.joinpath(*(node.module or "").split(".")) if node.module else base
                names = [target] if node.module else [base / a.name for a in node.names]
                for t in names:
                    if not (t.with_suffix(".py").is_file() or (t / "__init__.py").is_file()):
                        missing.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {'.' * node.level}{node.module or ''}")
    assert missing == []


def test_the_rule_checker_sees_imports_inside_functions(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("def f():\n    from moeplan.planner.commands.run import run\n")
    assert (2, "moeplan.planner.commands.run") in imported_modules(sample)
    assert layer_of(Path("backends/runtime/serve.py")) == "runtime"
    assert layer_of(Path("planner/pipeline/torchrun.py")) == "pipeline"
    assert layer_of(Path("planner/importers/resolve.py")) == "core"
