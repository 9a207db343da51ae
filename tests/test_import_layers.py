"""The packages of fl_megatron, and its modules, import each other without a cycle (imports
inside functions included): each piece of knowledge has one home, and imports point down the layers.

The module graph's rule: a package's `__init__.py` is the module named after the package.
`import fl_megatron.a.b` and `from fl_megatron.a.b import x` are an edge to fl_megatron.a.b alone,
not to the packages above it: Python runs fl_megatron.a's `__init__` before any of its submodules,
so a submodule that imports a sibling finds the package already (being) set up and does not need
what its `__init__` defines. `from fl_megatron.a import b` is an edge to fl_megatron.a.b when b is
a submodule, else (a name the `__init__` defines or re-exports) to fl_megatron.a, whose own imports
(say of fl_megatron.a.c) carry the chain on: a re-export makes a cycle only if the chain comes back.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fl_megatron"


def _unit(module: str) -> str:
    """The package a module belongs to: fl_megatron.convert.hf_keys -> convert; a top-level
    module (fl_megatron.costs) is a unit of its own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fl_megatron"


def _from_target(node: ast.ImportFrom, path: Path) -> str:
    """The dotted module a `from ... import` names, relative levels resolved against the
    package holding `path` (for an `__init__.py`, the package itself)."""
    if not node.level:
        return node.module or ""
    here = list(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    base = here[:len(here) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path) -> set[str]:
    """Modules of fl_megatron that `path` imports, as dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = _from_target(node, path)
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


def module_name(path: Path) -> str:
    """fl_megatron/backends/fsdp2.py -> fl_megatron.backends.fsdp2; a package's __init__.py
    -> the package's name."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(path: Path, modules: set[str]) -> dict[str, list[int]]:
    """The modules of fl_megatron (among `modules`) that `path` imports, by the rule above,
    each with the lines that import it."""
    found: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = _from_target(node, path)
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name in modules and node.lineno not in found.get(name, []):
                found.setdefault(name, []).append(node.lineno)
    return found


def _module_paths() -> dict[str, Path]:
    """module name -> its file."""
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def module_graph() -> dict[str, set[str]]:
    """module -> the modules of fl_megatron it imports (itself left out)."""
    paths = _module_paths()
    return {name: set(_module_imports(path, set(paths))) - {name} for name, path in paths.items()}


def import_lines(cycle: list[str]) -> list[str]:
    """Each edge of `cycle` as `file:line` of the imports that make it."""
    paths = _module_paths()
    lines = []
    for source, target in zip(cycle, cycle[1:]):
        path = paths[source]
        for number in _module_imports(path, set(paths))[target]:
            text = path.read_text().splitlines()[number - 1].strip()
            lines.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {text}")
    return lines


def test_the_walk_sees_imports_and_finds_a_planted_cycle():
    graph = package_graph()
    assert "federation" in graph["training"] and "config" in graph["federation"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_package_imports_itself_through_others():
    cycle = find_cycle(package_graph())
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)


def test_the_module_walk_sees_imports_and_finds_a_planted_cycle():
    graph = module_graph()
    deepspeed = graph["fl_megatron.backends.deepspeed_zero3"]
    assert "fl_megatron.backends.pickle_guard" in deepspeed and "fl_megatron.config.resolved" in deepspeed
    assert "fl_megatron.backends" not in deepspeed  # a sibling's import is no edge to the package
    # relative imports of an __init__ resolve against the package itself; one inside a function
    assert {"fl_megatron.backends.fsdp2", "fl_megatron.backends.deepspeed_zero3"} <= graph["fl_megatron.backends"]
    planted = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p"}, "q": {"p.b"}}
    assert find_cycle(planted) == ["p", "p.a", "p.b", "p"]


def test_no_module_imports_itself_through_others():
    cycle = find_cycle(module_graph())
    assert cycle is None, "\n  ".join(["import cycle between modules: " + " -> ".join(cycle)]
                                       + import_lines(cycle))
