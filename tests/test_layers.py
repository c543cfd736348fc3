"""The package's layers import only downwards: every import of every module of hrlplan (those inside
functions too), read with `ast`, against the layer table below; and no import inside a function holds
an import circle together (a module it imports that imports it back, directly or through others)."""
import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import hrlplan

ROOT = Path(hrlplan.__file__).resolve().parent

# Lowest first. A module is in the layer of the longest prefix naming it; it may import its own
# layer and those below it, never one above.
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("leaves", ("hrlplan", "hrlplan.errors", "hrlplan.config", "hrlplan.devices", "hrlplan.measure",
                "hrlplan.optim", "hrlplan.solver", "hrlplan.schedules", "hrlplan.families",
                "hrlplan.conf_tree", "hrlplan.yaml_budget",
                "hrlplan.search.config")),   # re-exports the planner sections of hrlplan.config
    ("facts", ("hrlplan.cluster", "hrlplan.model_record", "hrlplan.model_meta", "hrlplan.plan", "hrlplan.activations",
               "hrlplan.models", "hrlplan.data", "hrlplan.validate",
               "hrlplan.compose")),   # composing conf/ with Hydra, checked by validate
    ("cost", ("hrlplan.cost",)),
    ("search", ("hrlplan.search",)),
    ("runtime", ("hrlplan.runtime",)),
    ("launch", ("hrlplan.launch",)),
    ("entries", ("hrlplan.app", "hrlplan.cli", "hrlplan.doctor", "hrlplan.memory_guide")),
]

# Known upward imports nobody has fixed yet, (importer, imported): each says why it is still there.
ALLOWED: Set[Tuple[str, str]] = set()

# Inside hrlplan.runtime.calibrate: the measuring helpers at the bottom, the orchestration on top;
# each module imports only lower ranks (none its own rank, so no cycles), none the package itself.
CALIBRATE = "hrlplan.runtime.calibrate"
CALIBRATE_ORDER = {"blocks": 0, "attention_curve": 0, "compute": 1, "comm": 1, "collectives": 1, "record": 2, "worker": 3}


def _modules() -> Dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("hrlplan",) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imported(node: ast.AST, package: str) -> Iterator[str]:
    """The hrlplan modules one import statement names; `from pkg import mod` names pkg.mod."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names if a.name.split(".")[0] == "hrlplan")
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(anchor + ([node.module] if node.module else []))
        if base.split(".")[0] != "hrlplan":
            return
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            yield sub if sub in MODULES else base


def _package(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(name: str, path: Path) -> Iterator[str]:
    """Every hrlplan module `name` imports, anywhere in the file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        yield from _imported(node, _package(name, path))


def _imports_by_place(name: str, path: Path) -> Tuple[Set[str], List[Tuple[str, int]]]:
    """(the hrlplan modules imported when the module loads, [(module, line)] of those imported inside a
    function). An import under `if TYPE_CHECKING:` never runs, so it is neither."""
    at_load: Set[str] = set()
    in_function: List[Tuple[str, int]] = []

    def visit(node: ast.AST, inside: bool) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return
        for dep in _imported(node, _package(name, path)):
            if inside:
                in_function.append((dep, node.lineno))
            else:
                at_load.add(dep)
        inner = inside or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return at_load, in_function


def _loaded_with(module: str) -> List[str]:
    """What importing `module` runs: each package above it, then the module (hrlplan.a.b: hrlplan.a, hrlplan.a.b)."""
    parts = module.split(".")
    return [m for m in (".".join(parts[:i]) for i in range(2, len(parts) + 1)) if m in MODULES]


def _closed_circles(modules: Dict[str, Path]) -> Set[Tuple[str, str]]:
    """(importer, imported) for each import inside a function whose module, once loaded, loads the
    importer again: the function-level import is what keeps that circle from failing at import time."""
    at_load, in_function = {}, {}
    for name, path in modules.items():
        at_load[name], in_function[name] = _imports_by_place(name, path)

    def reached(start: str) -> Set[str]:
        seen: Set[str] = set()
        todo = list(_loaded_with(start))
        while todo:
            module = todo.pop()
            if module in seen or module not in at_load:
                continue
            seen.add(module)
            todo += [m for dep in at_load[module] for m in _loaded_with(dep)]
        return seen

    return {(name, dep) for name, deps in in_function.items() for dep, _ in deps if name in reached(dep)}


def _layer(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best and (p != "hrlplan" or module == p):
                best, rank = len(p), i
    assert rank is not None, f"{module} is in no layer of tests/test_layers.py's LAYERS: add it"
    return rank


def test_every_module_is_in_a_layer():
    for name in MODULES:
        _layer(name)


def test_layers_import_only_downwards():
    found = set()
    for name, path in sorted(MODULES.items()):
        for dep in _imports(name, path):
            if _layer(dep) > _layer(name):
                found.add((name, dep))
    upward = sorted(found - ALLOWED)
    assert not upward, "upward imports (importer -> imported, layers " + " -> ".join(n for n, _ in LAYERS) + \
        "):\n" + "\n".join(f"  {a} ({LAYERS[_layer(a)][0]}) -> {b} ({LAYERS[_layer(b)][0]})" for a, b in upward)
    stale = sorted(ALLOWED - found)
    assert not stale, f"fixed, take them off ALLOWED: {stale}"


def test_cost_and_search_never_import_runtime_or_launch():
    for name, path in MODULES.items():
        if name.startswith(("hrlplan.cost", "hrlplan.search")):
            bad = [d for d in _imports(name, path) if d.startswith(("hrlplan.runtime", "hrlplan.launch"))]
            assert not bad, f"{name} imports {bad}"


def test_calibrate_package_imports_one_way():
    members = {n: p for n, p in MODULES.items() if n.startswith(CALIBRATE + ".")}
    assert {n.rpartition(".")[2] for n in members} == set(CALIBRATE_ORDER), "update CALIBRATE_ORDER"
    for name, path in members.items():
        rank = CALIBRATE_ORDER[name.rpartition(".")[2]]
        for dep in _imports(name, path):
            assert dep != CALIBRATE, f"{name} imports the package itself (its __init__ imports every module)"
            if dep.startswith(CALIBRATE + "."):
                assert CALIBRATE_ORDER[dep.rpartition(".")[2]] < rank, f"{name} imports {dep}: not below it"


def test_the_layer_check_sees_imports_inside_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from hrlplan.runtime import distributed\n    import hrlplan.launch.local\n"
                   "from . import plan\n")
    assert set(_imports("hrlplan.m", src)) == {"hrlplan.runtime.distributed", "hrlplan.launch.local",
                                               "hrlplan.plan"}


def test_no_import_inside_a_function_holds_a_circle_together():
    """A circle of imports among our modules is a design to fix (move the code to where it belongs),
    not an import to tuck inside a function; lazy imports of heavy libraries (torch, transformers,
    wandb) and of our modules that bring them stay allowed -- they close no circle."""
    held = sorted(_closed_circles(MODULES))
    assert not held, "imports inside functions that hold a circle together (importer -> imported):\n" + \
        "\n".join(f"  {a} -> {b}" for a, b in held)


def test_the_circle_check_sees_a_circle_through_a_package(tmp_path):
    """b imports the package a (whose __init__ imports a.m) at load; a.m imports b inside a function."""
    files = {"hrlplan/a/__init__.py": "from hrlplan.a import m\n",
             "hrlplan/a/m.py": "def f():\n    from hrlplan import b\n    import torch\n",
             "hrlplan/b.py": "import hrlplan.a\n",
             "hrlplan/c.py": "def g():\n    import hrlplan.b\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    modules = {"hrlplan.a": tmp_path / "hrlplan/a/__init__.py", "hrlplan.a.m": tmp_path / "hrlplan/a/m.py",
               "hrlplan.b": tmp_path / "hrlplan/b.py", "hrlplan.c": tmp_path / "hrlplan/c.py"}
    saved = dict(MODULES)
    MODULES.update(modules)   # `from hrlplan import b` names the module hrlplan.b only where it exists
    try:
        assert _closed_circles(modules) == {("hrlplan.a.m", "hrlplan.b")}   # c's import of b closes nothing
    finally:
        MODULES.clear()
        MODULES.update(saved)
