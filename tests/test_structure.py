"""The package's shape, read from its source (an AST pass, nothing imported).

- No import cycle among proctor's modules, counting imports inside functions and under
  `if TYPE_CHECKING:` too: a lazy import may keep a heavy optional library (vLLM) off the import
  path, and an annotation-only import may name a type, but neither may hide a cycle (an object
  handed down that calls back up is a cycle at run time even when no import shows it).
- No module imports upward: the server's layers, lowest first, are `common`, `engines`,
  `alignment`, `worker`, `front.fleet`, `front` (its core), `front.http`, `front.runtime` (the
  front process: both transports in one loop), `config`, `cli`; a module imports only its own
  layer and those below.
- No module in `server/` over 350 lines and no function anywhere over 60 (the generated gRPC
  stubs aside): a module with one job fits in one reading.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"proto": "proctor.proto", "server": "proctor.server", "client": "proctor.client",
            "trainer_adapter": "proctor.trainer_adapter"}
MAX_SERVER_MODULE_LINES = 350
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _generated(path: Path) -> bool:
    return path.name.endswith(("_pb2.py", "_pb2_grpc.py"))


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(child) for child in ast.walk(node))
    return inside


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if MODULES[module].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _owner(name: str) -> str | None:
    """The proctor module an imported name lives in (a module, or the module holding it)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(*, annotations: bool = True) -> dict[str, set[str]]:
    """module -> the proctor modules it imports (module level, inside functions and, with
    `annotations`, under `if TYPE_CHECKING:`)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        skip = set() if annotations else _type_checking_nodes(tree)
        targets = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, node)
                targets.update(f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source
                               for alias in node.names)
        graph[module] = {owner for name in targets if (owner := _owner(name)) and owner != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_even_through_lazy_or_annotation_imports():
    graph = import_graph()
    assert sum(len(edges) for edges in graph.values()) > 100  # the pass reads real imports
    assert len(graph["proctor.server.front.aligned_scoring"]) > len(
        import_graph(annotations=False)["proctor.server.front.aligned_scoring"])  # TYPE_CHECKING ones are read
    assert cycles(graph) == []


# The server's layers, lowest first (a module's layer is its longest matching prefix).
SERVER_LAYERS = ("proctor.server.common", "proctor.server.engines", "proctor.server.alignment",
                 "proctor.server.worker", "proctor.server.front.fleet", "proctor.server.front",
                 "proctor.server.front.http", "proctor.server.front.runtime", "proctor.server.config",
                 "proctor.server.cli")


def _layer(module: str) -> int | None:
    matches = [i for i, prefix in enumerate(SERVER_LAYERS) if module == prefix or module.startswith(prefix + ".")]
    return max(matches, key=lambda i: len(SERVER_LAYERS[i])) if matches else None


def test_no_server_module_imports_upward():
    upward = sorted((module, target) for module, targets in import_graph().items() for target in targets
                    if (low := _layer(module)) is not None and (high := _layer(target)) is not None and high > low)
    assert _layer("proctor.server.front.http.app") > _layer("proctor.server.front.service") > _layer(
        "proctor.server.front.fleet.routing")
    assert upward == []


def test_the_server_root_holds_no_module():
    """Every server module lives in the package of its layer; the root is the package alone."""
    loose = sorted(path.name for path in (ROOT / "server").glob("*.py") if path.name != "__init__.py")
    assert loose == []
    assert all(_layer(module) is not None for module in MODULES
               if module.startswith("proctor.server.") and module.count(".") > 2)


def test_no_server_module_over_350_lines():
    long = {module: lines for module, path in MODULES.items()
            if module.startswith("proctor.server") and not _generated(path)
            and (lines := len(path.read_text().splitlines())) > MAX_SERVER_MODULE_LINES}
    assert long == {}


def test_no_function_over_60_lines():
    long = {}
    for module, path in MODULES.items():
        if _generated(path):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{module}.{node.name}"] = lines
    assert long == {}


def test_every_package_is_listed_for_a_wheel_install():
    """setuptools' `packages` names each subpackage; one left out imports in an editable install
    (its folder is mapped) and is missing from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert packages - listed == set()


# DESIGN §2: who may import whom. The `proctor` command composes both sides, in its two modules.
COMPOSERS = {"proctor.server.cli.main", "proctor.server.cli.trainer_side"}
FORBIDDEN = {"proctor.server": ("proctor.client", "proctor.trainer_adapter"),
             "proctor.client": ("proctor.server", "proctor.trainer_adapter"),
             "proctor.proto": ("proctor.server", "proctor.client", "proctor.trainer_adapter"),
             "proctor.trainer_adapter": ("proctor.server",)}


def test_the_sides_import_only_what_the_design_allows():
    broken = []
    for module, path in MODULES.items():
        if module in COMPOSERS or _generated(path):
            continue
        side = next(package for package in FORBIDDEN if module == package or module.startswith(package + "."))
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [_absolute(module, node)] if isinstance(node, ast.ImportFrom) else [])
            broken += [(module, name) for name in names
                       if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[side])]
    assert broken == []
