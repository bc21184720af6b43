"""README's and docs/' commands checked against what they run: each names a file that exists, and each flag it
passes is one its script accepts (the script's --help, run in this process, `python -m experiments.NAME` and
`python -m interop.NAME` too; a runs/ script's own text); the runs/ scripts that README names run only commands
README shows; .ci/run runs runs/test.sh; the manual install chooses the torch build first; the table of the paper's
sizes is what the code computes."""

import contextlib
import importlib.util
import io
import re
import runpy
import shlex
import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # README and the pages it links
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
INLINE_COMMAND = re.compile(r"`((?:python|python3|bash|torchrun) [^`\n]+)`")  # the project's scripts in prose


def joined(text):
    """Shell text with each line continued by a backslash joined to the next."""
    return re.sub(r"\s*\\\n\s*", " ", text)


def split_commands(line):
    """The commands of one shell line, each as its words: split at &&, | and ; outside quotes, a comment dropped."""
    lexer = shlex.shlex(line.split(" #")[0], posix=True, punctuation_chars="&|;")
    lexer.whitespace_split, lexer.commenters = True, ""
    commands = [[]]
    for word in lexer:
        if set(word) <= set("&|;"):
            commands.append([])
        else:
            commands[-1].append(word)
    return [words for words in commands if words]


def shown_commands(text):
    """Every command a page shows, as its words: each line of its bash blocks and each inline span that runs a
    script."""
    lines = "\n".join(re.findall(r"```bash\n(.*?)```", joined(text), flags=re.S)).splitlines()
    lines += INLINE_COMMAND.findall(FENCE.sub("", text))
    return [words for line in lines for words in split_commands(line)]


FOLDERS = ("experiments", "interop", "nanoparcae")  # run as python -m FOLDER.NAME
SUBCOMMANDS = ("nanoparcae/dataset.py", "interop/hub.py")  # scripts whose subcommands have a --help of their own


def script_invocation(words):
    """-> (script, subcommand or None, flags) for a command that runs one of the project's scripts, as a path
    (train.py, runs/cpu.sh) or as a module of its folders (python -m experiments.bench: experiments/bench.py)."""
    scripts = [i for i, w in enumerate(words) if w.endswith((".py", ".sh")) and not w.startswith("-")]
    modules = [i + 1 for i, w in enumerate(words[:-1]) if w == "-m" and words[i + 1].split(".")[0] in FOLDERS]
    if not scripts and not modules:
        return None
    i = (scripts or modules)[0]
    script = words[i] if scripts else words[i].replace(".", "/") + ".py"
    rest = [w for w in words[i + 1:] if w != "--"]
    sub = rest[0] if rest and not rest[0].startswith("-") and not rest[0].startswith("<") else None
    flags = [w.split("=")[0] for w in rest if w.startswith("--")]
    return script, sub, flags


def placeholder(script):
    """A name in capitals stands for any script (`python -m experiments.NAME`)."""
    return Path(script).stem.isupper()


def help_text(script, sub):
    """The script's --help (its subcommand's, for SUBCOMMANDS), run in this process as `python SCRIPT` or
    `python -m FOLDER.NAME` runs it."""
    out = io.StringIO()
    argv = [script, *([sub] if sub else []), "--help"]
    with (mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(out), warnings.catch_warnings(),
          pytest.raises(SystemExit) as exit_info):
        # runpy warns that a module another one imported runs again as __main__: --help only parses its flags
        warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
        if "/" in script:
            runpy.run_module(script[:-3].replace("/", "."), run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(ROOT / script), run_name="__main__")
    assert exit_info.value.code == 0, f"{script} {sub or ''} --help failed: {exit_info.value.code}"
    return out.getvalue()


def test_split_commands_and_script_invocation_read_shell_lines():
    assert split_commands('python3 -m venv .venv && . .venv/bin/activate   # a comment') == \
        [["python3", "-m", "venv", ".venv"], [".", ".venv/bin/activate"]]
    assert split_commands('python -c "import torch; print(1)" | tail -n 1') == \
        [["python", "-c", "import torch; print(1)"], ["tail", "-n", "1"]]
    assert shown_commands("Run `bash runs/x.sh --tiny`.\n```bash\npython train.py \\\n    --b=1\n```\n") == \
        [["python", "train.py", "--b=1"], ["bash", "runs/x.sh", "--tiny"]]
    assert script_invocation(["python", "train.py", "--depth=6"]) == ("train.py", None, ["--depth"])
    assert script_invocation(["python", "-m", "interop.hub", "export", "d12", "out", "--x=1"]) == \
        ("interop/hub.py", "export", ["--x"])
    assert script_invocation(["bash", "runs/gpu_check.sh", "--tiny"]) == ("runs/gpu_check.sh", None, ["--tiny"])
    assert script_invocation(["python", "-m", "pytest", "-q", "tests"]) is None
    assert placeholder(script_invocation(["python", "-m", "experiments.NAME"])[0])
    assert not placeholder("experiments/bench.py")


def test_readme_commands_name_existing_files_and_accepted_flags():
    invocations = [(page.relative_to(ROOT), invocation) for page in PAGES for words in shown_commands(page.read_text())
                   if (invocation := script_invocation(words)) is not None and not placeholder(invocation[0])]
    helps = {}
    for page, (script, sub, flags) in invocations:
        assert (ROOT / script).is_file(), f"{page} runs {script}, which does not exist"
        if script.endswith(".sh"):  # a script of runs/ reads its own arguments: its text names each it takes
            text = (ROOT / script).read_text()
        elif script == "interop/harness.py" and importlib.util.find_spec("lm_eval") is None:
            continue  # its --help needs lm-eval, an optional install
        else:
            key = (script, sub if script in SUBCOMMANDS else None)
            if key not in helps:
                helps[key] = help_text(*key)
            text = helps[key]
        for flag in flags:
            assert re.search(re.escape(flag) + r"(?![\w-])", text), f"{page}: {script} does not accept {flag}"
    assert len(invocations) >= 10 and len(helps) >= 5  # README and docs/ really do show the commands


def test_the_runs_scripts_readme_names_run_only_readmes_commands():
    """Each project command (a `python ...` line) of the runs/ scripts README tells users to run is one README shows,
    flags and all: README's commands are the ones these scripts run, not a copy that can drift."""
    shown = shown_commands(README)
    scripts = sorted({words[1] for words in shown if words[0] == "bash" and words[1].startswith("runs/")})
    assert "runs/cpu.sh" in scripts and "runs/test.sh" in scripts
    checked = 0
    for script in scripts:
        text = joined((ROOT / script).read_text())
        # the script's own constants (run=d3_diagonal, set once) stand for their values, as the shell reads them
        constants = {name: value for name, value in re.findall(r"^(\w+)=([\w.-]+)[ \t]*(?:#.*)?$", text, flags=re.M)
                     if len(re.findall(rf"(?<![\w-]){name}=", text)) == 1}
        for line in text.splitlines():
            line = re.sub(r"^stage \w+ ", "", line)  # runs/stage.sh's `stage NAME COMMAND` runs COMMAND
            line = re.sub(r'"?\$\{?(\w+)\}?"?', lambda m: constants.get(m[1], m[0]), line)
            # a command that still holds a shell variable is the script's own plumbing, not one a user types
            for words in split_commands(line) if line.startswith("python ") and "$" not in line else []:
                assert words in shown, f"{script} runs `{shlex.join(words)}`, which README does not show"
                checked += 1
    assert checked >= 3  # runs/cpu.sh trains, evaluates and writes its card


def test_ci_runs_the_whole_suite():
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == "bash runs/test.sh"


def test_manual_install_chooses_the_torch_build_after_the_venv_and_before_the_requirements():
    """Every README block that installs the requirements has first made the venv and installed a chosen torch build
    (on its own, pip would pull PyPI's default torch, the CUDA build on Linux), the version runs/setup.sh pins."""
    chosen = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        commands = [part.strip() for line in block.splitlines() for part in line.split(" #")[0].split("&&")]
        if "pip install -r requirements.txt" not in commands:
            continue
        torch_choice = next(i for i, command in enumerate(commands) if command.startswith("pip install torch"))
        assert (commands.index("python3 -m venv .venv") < commands.index(". .venv/bin/activate") < torch_choice
                < commands.index("pip install -r requirements.txt")), block
        chosen.append(commands[torch_choice])
    pinned = re.search(r"TORCH_SPEC:-(torch==[\d.]+)", (ROOT / "runs" / "setup.sh").read_text()).group(1)
    assert chosen == [f"pip install {pinned} --index-url https://download.pytorch.org/whl/cpu"]


def test_readme_sizes_table_is_what_the_code_computes():
    """The table of the paper's sizes (README or docs), recomputed as train.py --dry_run computes each row: the
    models of train.py's defaults (vocab 32,768, head_dim 128, seq_len 2048, batch 524,288, mu_rec 8) built on
    the meta device; GPU-hours as experiments.scaling's plan estimates them."""
    import torch
    from experiments.scaling import H100_BF16, MFU
    from model import Parcae, ParcaeConfig

    number = r" \| ([\d.e,]+)"
    pages = "\n".join(page.read_text() for page in PAGES)
    rows = re.findall(rf"^\| [\d.]+[MB] \| (\d+) \| ([\d,]+) / ([\d,]+) \| [\d.]+B{number * 3} \|$", pages, flags=re.M)
    tokens = {6: 11.2e9, 12: 29.6e9, 18: 61.6e9, 24: 104e9}  # model.py's PAPER_TOKENS (METHOD.md §1)
    assert [int(row[0]) for row in rows] == list(tokens)
    for depth, transformer, parcae, flops, total, gpu_hours in rows:
        models = {}
        for injection in ("none", "diagonal"):
            config = ParcaeConfig.from_depth(int(depth), vocab_size=32768, seq_len=2048, head_dim=128, mu_rec=8,
                                             injection=injection)
            with torch.device("meta"):
                models[injection] = Parcae(config)
        trained_tokens = int(tokens[int(depth)] // 524_288) * 524_288
        total_flops = models["diagonal"].paper_flops_per_token() * trained_tokens
        assert int(transformer.replace(",", "")) == models["none"].num_params(), depth
        assert int(parcae.replace(",", "")) == models["diagonal"].num_params(), depth
        assert float(flops) == float(f"{models['diagonal'].paper_flops_per_token():.3e}"), depth
        assert float(total) == float(f"{total_flops:.3e}"), depth
        executed = models["diagonal"].matmul_flops_per_token() * trained_tokens
        assert int(gpu_hours.replace(",", "")) == round(executed / (MFU * H100_BF16) / 3600), depth
