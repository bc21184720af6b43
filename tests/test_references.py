"""The repository stands alone: every file that code, tests or docs name as one of ours exists, and every function
docs/reading.md's tables point at is defined.

A name counts as ours when it is a bare file name (`model.py`, `METHOD.md`) or a path under one of our folders
(`tests/`, `docs/`, `experiments/`, `interop/`, `runs/`,
`nanoparcae/`); a path with any other folder (`parcae_lm/modules/mixer.py`,
`scripts/base_train.py`) names a file of another project (the authors' code, nanochat) and is left alone. A bare
name is found at the top level, in experiments/, interop/ or nanoparcae/, or beside the file that names it (a link
from one page of docs/ to another)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("tests/", "docs/", "experiments/", "interop/", "runs/", "figures/", "nanoparcae/")
WRITTEN = {"report.md"}  # what a run writes in its folder: named, never in the repository
REFERENCE = re.compile(r"(?<![\w/.\\-])([\w./-]*\w\.(?:py|md))\b")


def repository_files():
    return [*ROOT.glob("*.py"), *ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("tests/*.py"),
            *ROOT.glob("experiments/*.py"), *ROOT.glob("interop/*.py"), *ROOT.glob("nanoparcae/*.py"),
            *ROOT.glob("runs/*.sh"),
            ROOT / ".ci" / "run", ROOT / "requirements.txt"]


def our_references(text):
    names = REFERENCE.findall(text)
    return {name for name in names if ("/" not in name or name.startswith(FOLDERS)) and name not in WRITTEN}


def test_reference_pattern_tells_ours_from_other_projects():
    text = ("see METHOD.md §2, model.py, docs/scaling.md, interop/hub.py and tests/test_model.py; theirs: "
            "parcae_lm/modules/mixer.py, f'\\nsample.py'")
    assert our_references(text) == {"METHOD.md", "model.py", "docs/scaling.md", "interop/hub.py", "tests/test_model.py"}


def test_every_referenced_repository_file_exists():
    places = [ROOT, ROOT / "experiments", ROOT / "interop", ROOT / "nanoparcae"]
    missing = {f"{path.relative_to(ROOT)}: {name}" for path in repository_files()
               for name in our_references(path.read_text())
               if not any((place / name).is_file() for place in [*places, path.parent])}
    assert not missing, f"references to files not in the repository: {sorted(missing)}"
    assert (ROOT / "METHOD.md").is_file()


POINTER = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)`")  # `name` or `Class.method`; flags and calls are not


def pointers(text):
    """The `name` and `Class.method` spans of a markdown text's table rows."""
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    return {name for row in rows for name in POINTER.findall(row)
            if not name.startswith(("torch.", "random.")) and not name.endswith((".py", ".md"))}


def defined_names():
    """Every top-level function, class and assignment of our Python, and every method, bare and as Class.method."""
    names = set()
    for path in [*ROOT.glob("*.py"), *ROOT.glob("nanoparcae/*.py"), *ROOT.glob("experiments/*.py"),
                 *ROOT.glob("interop/*.py")]:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                methods = [item.name for item in node.body if isinstance(item, ast.FunctionDef)]
                names.update(methods, (f"{node.name}.{method}" for method in methods))
            if isinstance(node, ast.Assign):
                names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return names


def test_pointers_are_names_and_methods_in_table_rows():
    text = ("| a | `Parcae.forward`, `sample_depths`, `--seed`, `optimizer.step()`, `torch.Generator`, `model.py` |\n"
            "`not_a_row`\n")
    assert pointers(text) == {"Parcae.forward", "sample_depths"}


def test_every_function_reading_md_points_at_is_defined():
    names = defined_names()
    assert "Parcae.loop_step" in names and "sample_depths" in names
    stale = sorted(pointers((ROOT / "docs/reading.md").read_text()) - names)
    assert not stale, f"docs/reading.md points at names the code does not define: {stale}"
