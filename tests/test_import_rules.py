"""The layer rules of docs/architecture.md, checked on every import statement (top-level or inside functions).

Each top-level folder is one layer (docs/architecture.md, "Layers"), bottom up:
* `runtime/` (the code bundles ship) imports nothing of moeplan; `core/` (IR, plan, errors, hardware,
  the pass manager, ...) imports only `core/`;
* `passes/` (the algorithms and the `Pass` objects that run them) imports `core/`, `runtime/` and itself:
  the simulator and the cost model run the very code bundles run;
* `backends/` (code generation: one `write_bundle` per target and its codegen pass) imports `core/`,
  `runtime/`, `templates/` and itself, never `passes/`;
* `planner/` is the driver on top: the target registry and pass lists (`planner/pipeline/`), local
  launchers (`planner/launch/`), the report, and the CLI (`planner/cli.py`, `planner/commands/`); only
  the CLI imports the CLI;
* `api/` (the package `moeplan` itself, the Python API) and `benchmarks/` use everything but the CLI.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

EVERYTHING = ("moeplan.core", "moeplan.runtime", "moeplan.passes", "moeplan.backends", "moeplan.templates",
              "moeplan.planner")
CLI = ("moeplan.planner.commands", "moeplan.planner.cli")
# layer -> (moeplan module prefixes it may import, exceptions inside them it must not)
MAY_IMPORT = {
    "runtime": ((), ()),
    "core": (("moeplan.core",), ()),
    "passes": (("moeplan.core", "moeplan.runtime", "moeplan.passes"), ()),
    "backends": (("moeplan.core", "moeplan.runtime", "moeplan.templates", "moeplan.backends"), ()),
    "driver": (EVERYTHING, CLI),
    "cli": (EVERYTHING, ()),
    "api": (("moeplan",), CLI),
    "benchmarks": (("moeplan",), CLI),
}


def layer_of(rel: Path) -> str:
    parts = rel.parts
    if parts[0] in ("runtime", "core", "passes", "backends", "api", "benchmarks"):
        return parts[0]
    if parts[0] == "planner":
        return "cli" if parts[:2] == ("planner", "commands") or rel.as_posix() == "planner/cli.py" else "driver"
    raise ValueError(f"{rel} is in no layer")


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


LAYER_FOLDERS = ("api", "core", "runtime", "planner", "passes", "backends", "benchmarks")


def sources():
    for folder in LAYER_FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def breaks_rule(layer: str, module: str) -> bool:
    """Whether a module of `layer` importing `module` breaks the layer table."""
    if not _under(module, "moeplan"):
        return False
    allowed, forbidden = MAY_IMPORT[layer]
    return not any(_under(module, a) for a in allowed) or any(_under(module, f) for f in forbidden)


def test_every_module_imports_only_from_the_layers_below_it():
    broken = []
    for path in sources():
        rel = path.relative_to(ROOT)
        layer = layer_of(rel)
        for line, module in imported_modules(path):
            if breaks_rule(layer, module):
                broken.append(f"{rel}:{line} imports {module} ({layer} layer)")
    assert broken == []


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_passes_live_in_passes_and_backends_not_in_the_driver():
    """The driver lists passes and runs them; it defines none (a `Pass` lives beside the algorithm it runs)."""
    found = []
    for path in sorted((ROOT / "planner").rglob("*.py")):
        for line, module in imported_modules(path):
            if module == "moeplan.core.pass_manager.Pass":
                found.append(f"{path.relative_to(ROOT)}:{line}")
    assert found == []


def test_the_runtime_imports_only_modules_of_the_runtime_package():
    """Relative imports in runtime/ name modules that exist there: the runtime never relies
    on a file that only a bundle has (bundles copy these files verbatim, backends/common/files.py)."""
    runtime = ROOT / "runtime"
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
    assert layer_of(Path("runtime/serve.py")) == "runtime"
    assert layer_of(Path("planner/pipeline/torchrun.py")) == "driver"
    assert layer_of(Path("planner/commands/run.py")) == "cli"
    assert layer_of(Path("passes/importers/resolve.py")) == "passes"
    assert breaks_rule("core", "moeplan.runtime.ep.expert_table") and not breaks_rule("core", "moeplan.core.ir")
    assert breaks_rule("backends", "moeplan.passes.importers") and not breaks_rule("backends", "moeplan.runtime.serve")
    assert breaks_rule("driver", "moeplan.planner.cli") and not breaks_rule("cli", "moeplan.planner.pipeline.targets")
    assert breaks_rule("runtime", "moeplan.core.errors") and not breaks_rule("runtime", "torch")
    assert module_name(Path("api/__init__.py")) == "moeplan"
    assert module_name(Path("api/compile.py")) == "moeplan.compile"


# No module of the package takes part in an import cycle (module-level imports, package __init__
# included). Imports inside functions are left out: they run later, so they cannot deadlock a
# module's initialisation.
PACKAGE_FOLDERS = ("api", "core", "runtime", "planner", "passes", "backends")


def module_name(rel: Path) -> str:
    """The module a file is: api/ is the package `moeplan` itself (setup.py's package_dir)."""
    parts = list(rel.with_suffix("").parts)
    if parts[0] == "api":
        parts = parts[1:]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["moeplan"] + parts)


def module_level_imports(path: Path, name: str, anywhere: bool = False) -> list:
    """Absolute module names imported when the module at `path` (module `name`) is imported; with
    `anywhere`, also those its functions import when they run."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = list(ast.walk(tree)) if anywhere else []
    for node in [] if anywhere else tree.body:  # top level, and the branches of top-level if/try blocks
        nodes.append(node)
        for field in ("body", "orelse", "finalbody", "handlers"):
            if isinstance(node, (ast.If, ast.Try)):
                for child in getattr(node, field, []):
                    nodes += [child] + (child.body if isinstance(child, ast.ExceptHandler) else [])
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            out += [f"{base}.{a.name}" for a in node.names]  # a submodule, or a name the module at `base` defines
    return out


def import_graph(root: Path, anywhere: bool = False) -> dict:
    """{module: modules it imports at module level (`anywhere`: in functions too), with the packages
    those sit in}, internal modules only."""
    paths = {module_name(p.relative_to(root)): p for folder in PACKAGE_FOLDERS
             for p in sorted((root / folder).rglob("*.py"))}
    graph = {}
    for name, path in paths.items():
        edges = set()
        for target in module_level_imports(path, name, anywhere):
            while target and target not in paths:  # `from pkg.mod import name`: the module is pkg.mod
                target = target.rpartition(".")[0]
            if not target or target == name:
                continue
            edges.add(target)  # what the import needs initialised, a package's __init__ included
            parts = target.split(".")  # the packages above it run first, unless they hold this module
            edges |= {".".join(parts[:i]) for i in range(2, len(parts))
                      if ".".join(parts[:i]) in paths and not name.startswith(".".join(parts[:i]) + ".")}
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_among_module_level_imports():
    graph = import_graph(ROOT)
    assert len(graph) > 200 and "moeplan" in graph and "moeplan.passes.optimize.placement.policies" in graph
    assert cycles(graph) == []


def test_no_import_inside_a_function_stands_in_for_one_that_would_close_a_cycle():
    """Counting every import written inside a function as if it were at module level still gives no
    cycle: imports sit in functions to defer optional or heavy modules, never to dodge a cycle."""
    assert cycles(import_graph(ROOT, anywhere=True)) == []


def test_the_cycle_checker_finds_a_cycle_through_a_package_init(tmp_path):
    pkg = tmp_path / "passes" / "demo"
    pkg.mkdir(parents=True)
    (tmp_path / "passes" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from moeplan.passes.demo.a import x\n")
    (pkg / "a.py").write_text("x = 1\ndef f():\n    from moeplan.passes.demo.b import y\n")  # inside a function: no edge
    (pkg / "b.py").write_text("from moeplan.passes.demo import a\ny = 2\n")
    (pkg / "c.py").write_text("from . import d\n")
    (pkg / "d.py").write_text("try:\n    from .c import z\nexcept ImportError:\n    pass\n")
    graph = import_graph(tmp_path)
    assert "moeplan.passes.demo.b" not in graph["moeplan.passes.demo.a"]
    assert "moeplan.passes.demo.b" in import_graph(tmp_path, anywhere=True)["moeplan.passes.demo.a"]
    assert cycles(graph) == [["moeplan.passes.demo.c", "moeplan.passes.demo.d"]]  # through `from . import d`
    # other.py imports demo.b, which first runs demo/__init__, which imports a, which imports other
    (pkg / "a.py").write_text("from moeplan.passes.other import w\nx = 1\n")
    (pkg / "b.py").write_text("y = 2\n")
    (tmp_path / "passes" / "other.py").write_text("from moeplan.passes.demo.b import y\nw = 3\n")
    assert cycles(import_graph(tmp_path))[0] == ["moeplan.passes.demo", "moeplan.passes.demo.a", "moeplan.passes.other"]
    # a module that imports a name its own package's __init__ defines, while that __init__ imports the module
    (pkg / "__init__.py").write_text("x = 0\nfrom moeplan.passes.demo.b import y\n")
    (pkg / "b.py").write_text("from moeplan.passes.demo import x\ny = 2\n")
    assert ["moeplan.passes.demo", "moeplan.passes.demo.b"] in cycles(import_graph(tmp_path))
