"""The package's imports go down its floors and never round in a circle (read with `ast`, nothing imported).

The floors, lowest first; a module may import its own floor and the ones below, never one above:

0. base: `config` (EngineConfig and the other engine models), `extras` (the optional packages) and
   `version`. They import nothing of the package; the core is configured by EngineConfig, so config sits
   beneath the core, not above it.
1. core: `engine`, `model`, `sampling`, `transport`: decoding, knowing nothing of the services.
2. settings: `settings`, the service roles' settings models (and their errors).
3. services: every module not named elsewhere: frontends, scheduler, gateway, worker, pool,
   service (what every service process shares), wire, metrics, engine_client, the client SDK and the
   generated stubs.
4. entry points and process wiring: `cli`, `__main__`, the package's own `__init__`, the offline `llm` API
   (it starts worker processes through a local stack), `stack` (the services as local processes, and their
   supervision) and `bench` (the harness the CLI runs, which starts stacks too).

Each floor is a list of packages and root modules, never a module picked out of a package: a package sits on
one floor whole. Every import counts, at module level or inside a function; only those under
`if TYPE_CHECKING:` are aside (they never run). A circle closed by an import inside a function is still a
circle: each one is broken by moving the shared piece to where it belongs.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "services" / "minedraft"
ROOT = "minedraft"

# (floor, the root modules and packages on it); a module not named sits on SERVICES.
FLOORS: dict[str, tuple[int, tuple[str, ...]]] = {
    "base": (0, ("minedraft.config", "minedraft.extras", "minedraft.version")),
    "core": (1, ("minedraft.engine", "minedraft.model", "minedraft.sampling", "minedraft.transport")),
    "settings": (2, ("minedraft.settings",)),
    "entry points": (4, ("minedraft.__main__", "minedraft.cli", "minedraft.llm", "minedraft.stack", "minedraft.bench")),
}
SERVICES = 3


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(path): path for path in sorted(package.rglob("*.py"))}


def floor(module: str) -> int:
    if module == ROOT:
        return FLOORS["entry points"][0]
    top = ".".join(module.split(".")[:2])  # the root module or package it is, or is in
    return next((level for level, names in FLOORS.values() if top in names), SERVICES)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The ids of the nodes under `if TYPE_CHECKING:` (their imports never run)."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            hidden.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return hidden


def _imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names an import statement reaches: modules, or names inside a module."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the module's package, one package up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The package module a dotted name lives in (`minedraft.config.EngineConfig` -> `minedraft.config`)."""
    while name not in modules:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        hidden = _type_checking_only(tree)
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in hidden:
                for name in _imported(module, path.name == "__init__.py", node):
                    targets.add(_owner(name, modules))
        graph[module] = targets - {None, module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{module} (floor {floor(module)}) imports {target} (floor {floor(target)})"
            for module, targets in sorted(graph.items()) for target in sorted(targets)
            if floor(target) > floor(module)]  # fmt: skip


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph(package_modules())
    assert "minedraft.engine.engine" in graph["minedraft.llm"]  # module level
    assert "minedraft.stack.local" in graph["minedraft.llm"]  # inside a function
    assert "minedraft.config" not in graph["minedraft.settings"]  # under TYPE_CHECKING only
    assert "minedraft.api.generate_pb2" in graph["minedraft.api.worker_pb2"]  # `from minedraft.api import x`


def test_the_floors_name_root_modules_and_packages_only() -> None:
    """A package sits on one floor whole: no module of it is picked out onto another."""
    modules = package_modules()
    named = [name for _, names in FLOORS.values() for name in names]
    assert all(name.count(".") == 1 and name in modules for name in named), named


def test_no_import_circles() -> None:
    assert cycles(import_graph(package_modules())) == []


def test_no_import_goes_up_a_floor() -> None:
    assert upward(import_graph(package_modules())) == []


def test_a_planted_circle_and_an_arrow_up_are_found(tmp_path: Path) -> None:
    """The checks fail when they should: a copy of two real modules, one importing the other inside a function
    (the kind of circle that once hid here), and the core importing the gateway."""
    modules = package_modules()
    planted = dict(modules)
    for name, extra in (("minedraft.engine.plans", "minedraft.engine.engine"),
                        ("minedraft.engine.adaptive", "minedraft.gateway.service")):
        copy = tmp_path / f"{name}.py"
        copy.write_text(modules[name].read_text() + f"\n\ndef _planted():\n    import {extra}  # noqa\n")
        planted[name] = copy
    graph = import_graph(planted)
    assert any({"minedraft.engine.plans", "minedraft.engine.engine"} <= set(c) for c in cycles(graph))
    assert any(line.startswith("minedraft.engine.adaptive (floor 1) imports minedraft.gateway.service")
               for line in upward(graph))
