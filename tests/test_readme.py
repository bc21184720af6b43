"""The commands of README and docs/ name files that exist and flags that the scripts accept (each script's
--help), and README's test command is the one .ci/run runs."""

import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # README and the pages it links


def readme_commands():
    """(page, command) for every shell command in the bash blocks of README and docs/, split at &&, | and ;,
    comments dropped."""
    for page in PAGES:
        blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
        for line in "\n".join(blocks).splitlines():
            line = line.split(" #")[0].strip()
            for part in re.split(r"&&|\||;", line):
                if part.strip():
                    yield page.relative_to(ROOT), shlex.split(part)


def script_invocation(words):
    """-> (script, subcommand or None, flags) for a command that runs one of the project's .py files."""
    scripts = [i for i, w in enumerate(words) if w.endswith(".py") and not w.startswith("-")]
    if not scripts:
        return None
    i = scripts[0]
    rest = [w for w in words[i + 1:] if w != "--"]
    sub = rest[0] if rest and not rest[0].startswith("-") and not rest[0].startswith("<") else None
    flags = [w.split("=")[0] for w in rest if w.startswith("--")]
    return words[i], sub, flags


@lru_cache(maxsize=None)
def help_text(script, sub):
    result = subprocess.run([sys.executable, str(ROOT / script), *([sub] if sub else []), "--help"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, f"{script} {sub or ''} --help failed: {result.stderr[-500:]}"
    return result.stdout


def test_readme_commands_name_existing_files_and_accepted_flags():
    checked = 0
    for page, words in readme_commands():
        invocation = script_invocation(words)
        if invocation is None:
            continue
        script, sub, flags = invocation
        assert (ROOT / script).is_file(), f"{page} runs {script}, which does not exist"
        text = help_text(script, sub if sub and script == "data.py" else None)
        for flag in flags:
            assert re.search(re.escape(flag) + r"(?![\w-])", text), f"{page}: {script} does not accept {flag}"
        checked += 1
    assert checked >= 10  # README and docs/ really do show the commands


def test_readme_test_command_is_what_ci_runs():
    command = re.search(r"## Tests\n.*?```bash\n(.*?)\n```", README, flags=re.S).group(1).strip()
    ci_lines = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci_lines[-1].strip() == command



def test_install_chooses_the_torch_build_after_the_venv_and_before_the_requirements():
    """Quick start names the CPU-only and the GPU machine before its first command (python train.py), and every
    block that installs the requirements has first made the venv and installed a chosen torch build (on its own,
    pip would pull PyPI's default torch, the CUDA build on Linux)."""
    quick_start = README.split("## Quick start\n")[1].split("\n## ")[0]
    before_command_1 = quick_start.split("python train.py")[0]
    assert "CPU-only machine" in before_command_1 and "machine with an NVIDIA GPU" in before_command_1
    chosen = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        commands = [part.strip() for line in block.splitlines() for part in line.split(" #")[0].split("&&")]
        if "pip install -r requirements.txt" not in commands:
            continue
        torch_choice = next(i for i, command in enumerate(commands) if command.startswith("pip install torch"))
        assert (commands.index("python3 -m venv .venv") < commands.index(". .venv/bin/activate") < torch_choice
                < commands.index("pip install -r requirements.txt")), block
        chosen.append(commands[torch_choice])
    assert chosen == ["pip install torch --index-url https://download.pytorch.org/whl/cpu", "pip install torch"]
