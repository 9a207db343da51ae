"""The packages of fl_megatron import each other without a cycle (imports inside functions
included): each piece of knowledge has one home, and imports point down the layers."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fl_megatron"


def _unit(module: str) -> str:
    """The package a module belongs to: fl_megatron.convert.hf_keys -> convert; a top-level
    module (fl_megatron.costs) is a unit of its own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fl_megatron"


def _imports(path: Path) -> set[str]:
    """Modules of fl_megatron that `path` imports, as dotted names."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    here = list(rel.parts[:-1])  # the module's package ("from . import x" resolves against it)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("fl_megatron"):
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("fl_megatron"))
    return found


def package_graph() -> dict[str, set[str]]:
    """unit -> the units it imports from (itself left out)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        source = _unit(".".join(rel.parts))
        targets = graph.setdefault(source, set())
        for module in _imports(path):
            unit = _unit(module)
            if unit != source and ((PACKAGE / unit).is_dir() or (PACKAGE / f"{unit}.py").is_file()):
                targets.add(unit)
    return graph


def find_cycle(graph: dict[str, set[str]]):
    """One cycle as a list of units, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_walk_sees_imports_and_finds_a_planted_cycle():
    graph = package_graph()
    assert "federation" in graph["training"] and "config" in graph["federation"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_package_imports_itself_through_others():
    cycle = find_cycle(package_graph())
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)
