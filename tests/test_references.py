"""The repository stands alone: every file that code, tests or docs name as one of ours exists.

A name counts as ours when it is a bare file name (`model.py`, `METHOD.md`) or a path under one of our folders
(`tests/`, `docs/`, `experiments/`, `interop/`, `runs/`,
`nanoparcae/`); a path with any other folder (`parcae_lm/modules/mixer.py`,
`scripts/base_train.py`) names a file of another project (the authors' code, nanochat) and is left alone. A bare
name is found at the top level, in experiments/, interop/ or nanoparcae/, or beside the file that names it (a link
from one page of docs/ to another)."""

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
