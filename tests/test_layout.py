"""The layout's rules, read from the source without importing it. The root holds the reading path and the package
nanoparcae/ what it leans on, as nanoparcae/__init__.py's table lists it. No root or package file imports from the
folders of experiments and adapters, and no package file imports a root file (an import inside a function counts
too), so the root's files and the package's import one another without a cycle."""

import ast
import re
from pathlib import Path

import pytest

from conftest import python

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("experiments", "interop")  # the paper's experiments; the adapters to other tools
PACKAGE = "nanoparcae"  # what the root's files lean on that is not the method
READING_PATH = {"train.py", "model.py", "data.py", "eval_core.py", "sample.py", "engine.py", "optim.py"}


def imported_names(path):
    """The dotted names a file imports, from every import statement in it (those inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def import_graph(root):
    """{module: set of the modules it imports}, for every .py file at the root (model) and in the package
    (nanoparcae.files), among those modules; `from nanoparcae import files` counts as nanoparcae.files."""
    modules = {path.stem: path for path in root.glob("*.py")}
    modules |= {f"{PACKAGE}.{path.stem}": path for path in (root / PACKAGE).glob("*.py") if path.stem != "__init__"}

    def targets(path):
        names = imported_names(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
                names |= {f"{PACKAGE}.{alias.name}" for alias in node.names}
        return {name if name in modules else name.split(".")[0] for name in names}

    return {name: targets(path) & set(modules) for name, path in modules.items()}


def root_imports_of_folders(root, folders=FOLDERS):
    """['file: name'] for every import a root file makes from one of the folders."""
    return sorted(f"{path.name}: {name}" for path in root.glob("*.py") for name in imported_names(path)
                  if name.split(".")[0] in folders)


def package_imports_of_root(root, package=PACKAGE):
    """['file: name'] for every import a package file makes of a root module."""
    modules = {path.stem for path in root.glob("*.py")}
    return sorted(f"{path.name}: {name}" for path in (root / package).glob("*.py") for name in imported_names(path)
                  if name.split(".")[0] in modules)


def table_modules(init):
    """The module files a package's __init__.py lists, each on an indented line before what it holds."""
    return {line.split()[0] for line in init.read_text().splitlines() if re.match(r"    \w+\.py\s", line)}


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


def test_the_root_holds_the_reading_path_and_the_package_what_its_table_lists():
    assert {path.name for path in ROOT.glob("*.py")} == READING_PATH
    listed, held = table_modules(ROOT / PACKAGE / "__init__.py"), {path.name for path in (ROOT / PACKAGE).glob("*.py")}
    assert "checkpoint.py" in listed and listed == held - {"__init__.py"}, sorted(listed ^ (held - {"__init__.py"}))


def test_no_import_cycle_among_the_root_files_and_the_package():
    graph = import_graph(ROOT)
    assert "engine" in graph["sample"] and "data" in graph["eval_core"] and "nanoparcae.dataset" in graph["data"]
    assert "nanoparcae.checkpoint" in graph["train"] and "nanoparcae.ranks" in graph["nanoparcae.run"]
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_folder_check_finds_every_kind_of_import(tmp_path):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "bench.py").write_text("import train\n")  # a folder may import the root
    (tmp_path / "train.py").write_text("import model\nfrom experiments.bench import rows\n")
    (tmp_path / "sample.py").write_text("def main():\n    import interop.hub\n")  # inside a function
    (tmp_path / "model.py").write_text("from experiments import bench\nimport experimental\n")
    assert root_imports_of_folders(tmp_path) == ["model.py: experiments", "sample.py: interop.hub",
                                                 "train.py: experiments.bench"]


def test_the_package_check_finds_every_import_of_a_root_file(tmp_path):
    (tmp_path / PACKAGE).mkdir()
    (tmp_path / "model.py").write_text("")
    (tmp_path / "data.py").write_text("")
    (tmp_path / PACKAGE / "files.py").write_text("import os\nfrom nanoparcae import ranks\n")  # the package's own
    (tmp_path / PACKAGE / "memory.py").write_text("def plan():\n    from model import Parcae\n")  # inside a function
    (tmp_path / PACKAGE / "dataset.py").write_text("import data.loader\nimport modeling\n")
    assert package_imports_of_root(tmp_path) == ["dataset.py: data.loader", "memory.py: model"]


def test_no_package_file_imports_a_root_file():
    assert package_imports_of_root(ROOT) == []


def test_no_root_or_package_file_imports_from_the_folders():
    assert (ROOT / "experiments" / "bench.py").is_file() and (ROOT / "interop" / "hub.py").is_file()
    assert root_imports_of_folders(ROOT) == [] and root_imports_of_folders(ROOT / PACKAGE) == []


@pytest.mark.slow
def test_importing_every_root_file_loads_nothing_from_the_folders(tmp_path):
    """The same rule at run time: every root module imported, no module of the folders in sys.modules."""
    modules = sorted(path.stem for path in ROOT.glob("*.py") if path.stem != "train")  # importing train.py trains
    modules += [f"{PACKAGE}.{path.stem}" for path in sorted((ROOT / PACKAGE).glob("*.py"))]
    script = tmp_path / "import_all"
    script.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfor name in {modules!r}:\n    __import__(name)\n"
                      f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FOLDERS!r}))")
    result = python([str(script)])
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr
