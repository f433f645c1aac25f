"""The import graph keeps the layers of DESIGN.md ("Layers and layout"), read statically.

Every ``import`` and ``from ... import`` counts, at module level and inside functions
(a lazy import is still a dependency); only the bodies of ``if TYPE_CHECKING:`` are
exempt. Data flows one way, testnet -> meshnode -> protocol, and keys is used by all
three but uses only protocol; inside meshnode the rooms (subpackages) form a DAG; no
two modules import each other, directly or around a loop; protocol/ does no IO.
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "keys", "meshnode", "testnet")

# package -> the packages it may import (DESIGN.md: testnet -> meshnode -> protocol; keys for all)
ALLOWED_PACKAGES = {
    "protocol": set(),
    "keys": {"protocol"},
    "meshnode": {"keys", "protocol"},
    "testnet": {"meshnode", "keys", "protocol"},
}
# room of meshnode -> the rooms it may import (meshnode/__init__.py draws the same picture)
ALLOWED_ROOMS = {
    "cli": {"tui", "node", "control", "workload"},
    "tui": {"control", "workload"},
    "node": {"control", "net", "workload"},
    "control": set(),
    "net": set(),
    "workload": set(),
}
# protocol/ is pure: no networking, files, processes, threads, clocks or terminals.
IO_MODULES = {"anyio", "asyncio", "libp2p", "multiprocessing", "pynvml", "rich", "select", "selectors", "shutil",
              "signal", "socket", "sqlite3", "sqlite_utils", "subprocess", "tempfile", "textual", "threading",
              "time", "trio"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom node, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _project_module(dotted: str) -> str | None:
    """The longest prefix of ``dotted`` that is a module of the project."""
    parts = dotted.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def _imports(name: str, path: Path):
    """(imported name, line) for each name this module imports: a project module where it
    is one (``from pkg import module`` names the module), else the external dotted name."""
    is_package = path.name == "__init__.py"
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
            continue
        base = node.module or ""
        if node.level:
            anchor = name.split(".") if is_package else name.split(".")[:-1]
            anchor = anchor[:len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            yield (base + "." + alias.name if base + "." + alias.name in MODULES else base), node.lineno


def _graph():
    """module -> {imported project module: first line}, and module -> {external top-level: line}."""
    internal, external = defaultdict(dict), defaultdict(dict)
    for name, path in MODULES.items():
        for imported, line in _imports(name, path):
            target = _project_module(imported)
            if target is None:
                external[name].setdefault(imported.split(".")[0], line)
            elif target != name:
                internal[name].setdefault(target, line)
    return internal, external


INTERNAL, EXTERNAL = _graph()


def _where(source: str, target: str) -> str:
    return "%s:%d imports %s" % (MODULES[source].relative_to(ROOT), INTERNAL[source][target], target)


def _cycles(nodes, edges) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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


def _group_edges(group_of) -> dict[str, dict[str, list[str]]]:
    """Edges between groups of modules, each with the module imports that make it."""
    grouped = defaultdict(lambda: defaultdict(list))
    for source, targets in INTERNAL.items():
        for target in targets:
            a, b = group_of(source), group_of(target)
            if a is not None and b is not None and a != b:
                grouped[a][b].append(_where(source, target))
    return grouped


def _package(module: str) -> str:
    return module.split(".")[0]


def _room(module: str) -> str | None:
    """The room of a meshnode module (``meshnode.node.driver`` -> ``node``); None outside rooms."""
    parts = module.split(".")
    return parts[1] if parts[0] == "meshnode" and len(parts) > 1 and parts[1] in ALLOWED_ROOMS else None


def test_the_graph_sees_the_project():
    assert {"protocol.envelope", "keys.keystore", "meshnode.node.driver", "meshnode.cli", "testnet.sim"} <= set(MODULES)
    assert "protocol.codec" in INTERNAL["protocol.envelope"]
    assert "msgpack" in EXTERNAL["protocol.codec"]


def test_no_import_cycle_between_modules():
    cycles = _cycles(MODULES, INTERNAL)
    assert not cycles, "import cycles:\n" + "\n".join(
        "  " + " <-> ".join(cycle) + "\n" + "\n".join("    " + _where(a, b) for a in cycle for b in INTERNAL[a]
                                                      if b in cycle) for cycle in cycles)


def test_packages_import_only_the_layers_below_them():
    grouped = _group_edges(_package)
    wrong = [where for source, targets in grouped.items() for target, wheres in targets.items()
             if target not in ALLOWED_PACKAGES[source] for where in wheres]
    assert not wrong, "imports against the layering (testnet -> meshnode -> protocol, keys -> protocol):\n  " + \
        "\n  ".join(sorted(wrong))


def test_no_cycle_between_packages():
    grouped = _group_edges(_package)
    cycles = _cycles(PACKAGES, {a: set(b) for a, b in grouped.items()})
    assert not cycles, "package cycles: %s; the imports that close them:\n  %s" % (cycles, "\n  ".join(sorted(
        where for cycle in cycles for a in cycle for b in grouped[a]
        if b in cycle and b not in ALLOWED_PACKAGES[a] for where in grouped[a][b])))


def test_meshnode_rooms_import_only_the_rooms_below_them():
    grouped = _group_edges(_room)
    assert set(ALLOWED_ROOMS) == {p.name for p in (ROOT / "meshnode").iterdir() if (p / "__init__.py").exists()}
    wrong = [where for source, targets in grouped.items() for target, wheres in targets.items()
             if target not in ALLOWED_ROOMS[source] for where in wheres]
    assert not wrong, "imports between meshnode's rooms that ALLOWED_ROOMS does not draw:\n  " + "\n  ".join(sorted(wrong))
    assert not _cycles(ALLOWED_ROOMS, ALLOWED_ROOMS), "the rooms' picture itself must be a DAG"


def test_protocol_does_no_io():
    wrong = ["%s:%d imports %s" % (MODULES[name].relative_to(ROOT), line, module)
             for name, modules in EXTERNAL.items() if _package(name) == "protocol"
             for module, line in modules.items() if module in IO_MODULES]
    assert not wrong, "protocol/ is the pure core (DESIGN.md):\n  " + "\n  ".join(sorted(wrong))


def test_only_meshnode_net_imports_libp2p():
    users = {name for name, modules in EXTERNAL.items() if "libp2p" in modules}
    assert users and all(name.startswith("meshnode.net.") for name in users), sorted(users)


def test_testnet_commands_reach_the_cli_through_entry_points_only():
    """meshnode's CLI names only its own modules; testnet's commands are entry points."""
    from meshnode.cli import COMMAND_MODULES
    assert all(module.startswith("meshnode.cli.") for module in COMMAND_MODULES.values())
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["meshnode.commands"]
    assert {"testnet", "sim", "bench", "demo"} <= set(entry_points)
    for command, target in entry_points.items():
        module, _, function = target.partition(":")
        assert module in MODULES and function == "register", (command, target)
        assert not set(entry_points) & set(COMMAND_MODULES), "a command is either the node's or a plugin's"
