"""The layout's rules, read from the source without importing it: no import cycle among the top-level files
(an import inside a function counts too), and no top-level file over 600 lines."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 600


def import_graph(root):
    """{module: set of the top-level modules it imports}, for every top-level .py file under root."""
    modules = {path.stem: path for path in root.glob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
        graph[name] = imported & set(modules)
    return graph


def find_cycle(graph):
    """One import cycle as a list [a, b, ..., a], or None."""
    state = {}  # module -> "open" while on the current path, "done" once every path from it is explored

    def visit(module, path):
        state[module] = "open"
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state:
                cycle = visit(other, path + [other])
                if cycle:
                    return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"d"}}) == ["d", "d"]


def test_no_import_cycle_among_the_top_level_files():
    graph = import_graph(ROOT)
    assert "engine" in graph["sample"] and "hub" in graph["eval_core"]  # the latter inside a function
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_no_top_level_file_over_600_lines():
    lengths = {path.name: len(path.read_text().splitlines()) for path in ROOT.glob("*.py")}
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}
