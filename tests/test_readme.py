"""The commands of README and docs/ name files that exist and flags that the scripts accept (each script's
--help, `python -m experiments.NAME` and `python -m interop.NAME` too); every command README shows is run by a test
or a script of runs/, or is listed here with why not; README's two commands are runs/cpu.sh and runs/test.sh, and
.ci/run runs the latter."""

import importlib.util
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # README and the pages it links


def joined(text):
    """Shell text with each line continued by a backslash joined to the next."""
    return re.sub(r"\s*\\\n\s*", " ", text)


def readme_commands():
    """(page, command) for every shell command in the bash blocks of README and docs/, split at &&, | and ;,
    comments dropped."""
    for page in PAGES:
        blocks = re.findall(r"```bash\n(.*?)```", joined(page.read_text()), flags=re.S)
        for line in "\n".join(blocks).splitlines():
            line = line.split(" #")[0].strip()
            for part in re.split(r"&&|\||;", line):
                if part.strip():
                    yield page.relative_to(ROOT), shlex.split(part)


FOLDERS = ("experiments", "interop")  # run as python -m FOLDER.NAME
SUBCOMMANDS = ("dataset.py", "interop/hub.py")  # scripts whose subcommands have a --help of their own


def script_invocation(words):
    """-> (script, subcommand or None, flags) for a command that runs one of the project's .py files, as a path
    (train.py) or as a module of its folders (python -m experiments.bench: experiments/bench.py)."""
    scripts = [i for i, w in enumerate(words) if w.endswith(".py") and not w.startswith("-")]
    modules = [i + 1 for i, w in enumerate(words[:-1]) if w == "-m" and words[i + 1].split(".")[0] in FOLDERS]
    if not scripts and not modules:
        return None
    i = (scripts or modules)[0]
    script = words[i] if scripts else words[i].replace(".", "/") + ".py"
    rest = [w for w in words[i + 1:] if w != "--"]
    sub = rest[0] if rest and not rest[0].startswith("-") and not rest[0].startswith("<") else None
    flags = [w.split("=")[0] for w in rest if w.startswith("--")]
    return script, sub, flags


def run_words(script):
    """How a script is started: its path at the root, `-m FOLDER.NAME` in a folder."""
    return [str(ROOT / script)] if "/" not in script else ["-m", script[:-3].replace("/", ".")]


@lru_cache(maxsize=None)
def help_text(script, sub):
    result = subprocess.run([sys.executable, *run_words(script), *([sub] if sub else []), "--help"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, f"{script} {sub or ''} --help failed: {result.stderr[-500:]}"
    return result.stdout


def test_script_invocation_reads_paths_and_modules():
    assert script_invocation(["python", "train.py", "--depth=6"]) == ("train.py", None, ["--depth"])
    assert script_invocation(["python", "-m", "interop.hub", "export", "d12", "out", "--x=1"]) == \
        ("interop/hub.py", "export", ["--x"])
    assert script_invocation(["python", "-m", "pytest", "-q", "tests"]) is None
    assert run_words("experiments/bench.py") == ["-m", "experiments.bench"]


def test_readme_commands_name_existing_files_and_accepted_flags():
    invocations = [(page, invocation) for page, words in readme_commands()
                   if (invocation := script_invocation(words)) is not None]
    for page, (script, _, _) in invocations:
        assert (ROOT / script).is_file(), f"{page} runs {script}, which does not exist"
    if importlib.util.find_spec("lm_eval") is None:  # interop.harness's --help needs lm-eval, an optional install
        invocations = [(page, i) for page, i in invocations if i[0] != "interop/harness.py"]
    helps = {(script, sub if script in SUBCOMMANDS else None) for _, (script, sub, _) in invocations}
    with ThreadPoolExecutor(4) as pool:  # each --help is mostly an interpreter starting: several at once
        list(pool.map(lambda key: help_text(*key), sorted(helps, key=str)))
    checked = 0
    for page, (script, sub, flags) in invocations:
        text = help_text(script, sub if script in SUBCOMMANDS else None)
        for flag in flags:
            assert re.search(re.escape(flag) + r"(?![\w-])", text), f"{page}: {script} does not accept {flag}"
        checked += 1
    assert checked >= 10  # README and docs/ really do show the commands


def test_readme_leads_with_the_two_scripts_and_ci_runs_the_second():
    """Quick start's first block is runs/cpu.sh and runs/test.sh; runs/cpu.sh trains with README's first command and
    samples with its first sample command; runs/test.sh ends in the test command, and .ci/run in runs/test.sh."""
    quick_start = README.split("## Quick start\n")[1].split("\n## ")[0]
    first_block = re.search(r"```bash\n(.*?)```", quick_start, flags=re.S).group(1)
    commands = [line.split(" #")[0].strip() for line in first_block.splitlines()]
    assert commands == ["bash runs/cpu.sh", "bash runs/test.sh"]
    cpu = joined((ROOT / "runs" / "cpu.sh").read_text()).splitlines()
    train_command = next(c for c in shown_commands(README) if c.startswith("python train.py"))
    sample_command = next(c for c in shown_commands(README) if c.startswith("python sample.py"))
    assert cpu[-2:] == [train_command, sample_command]
    assert (ROOT / "runs" / "test.sh").read_text().strip().splitlines()[-1] == "python -m pytest -q -rs tests"
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


# -----------------------------------------------------------------------------
# Every command README shows is run by a test or by a script, or its line says why not (a comment holding a mark),
# or NOT_RUN lists it with the reason

MARKS = ("GPU only", "needs network")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
INLINE_COMMAND = re.compile(r"`((?:python|python3|bash|torchrun) [^`\n]+)`")  # the project's scripts in prose

# Where each command README shows is run: "<test file>::<test>", a test that runs that script with those flags (on
# a tiny model or run where README's takes minutes), or a script that runs that very line (runs/setup.sh, .ci/run).
# README changes a command: change it here too.
RUN_BY = {
    "bash runs/test.sh": ".ci/run",
    "python3 -m venv .venv": "runs/setup.sh",
    ". .venv/bin/activate": "runs/setup.sh",
    "python train.py --depth=3 --d_model=128 --head_dim=64 --mu_rec=4 --vocab_size=4096 --seq_len=256 --data=stdlib "
    "--device_batch_size=16 --total_batch_size=8192 --max_tokens=3.2e6 --dtype=float32 --compile=0 --eval_every=130 "
    "--eval_tokens=65536 --save_every=130 --log_every=20 --core_every=-1":
        "tests/test_train.py::test_resumed_run_gives_exactly_the_losses_of_an_uninterrupted_run",
    "python -m pytest -q -rs tests": "runs/test.sh",
    'python sample.py --prompt="class Test" --max_new_tokens=64 --num_samples=3 --seed=42':
        "tests/test_sample.py::test_cli_streams_each_sample",
    'python sample.py --T=auto --prompt="import"': "tests/test_sample.py::test_cli_streams_each_sample",
    "python eval_core.py --eval bpb --T 1,2,4,8,16,32 --val_tokens 65536 --batch_size 16":
        "tests/test_train.py::test_eval_core_bpb_gives_train_pys_last_eval",
    "python -m experiments.plot --test_time": "tests/test_plot.py::test_test_time_draws_the_newest_fit_beside_its_json",
    "python train.py --depth=24 --mu_rec=8 --dry_run": "tests/test_train.py::test_dry_run_prints_the_paper_size",
    "python train.py --help": "tests/test_train.py::test_help_lists_every_default_and_only_what_a_user_sets",
    "torchrun ... -- train.py --run=mine":
        "tests/test_train.py::test_two_processes_give_the_losses_of_one",
    "bash runs/gpu_check.sh":
        "tests/test_gpu_check.py::test_tiny_run_prints_every_row_and_a_failed_stage_stops_only_its_own",
}
# The commands no test runs, and why
NOT_RUN = {
    "bash runs/cpu.sh": "it trains for minutes: test_readme_leads_with_the_two_scripts... checks that it runs README's "
                        "train and sample commands, which RUN_BY's tests run",
    "bash runs/evidence_cpu.sh": "75 minutes; tests/test_evidence.py runs its parts",
}


def shown_commands(text):
    """{command: the comments on its lines} for every command of a page: each line of its bash blocks, split at
    &&, | and ; (a line's comment belongs to each of its commands), and each inline span that runs a script."""
    shown = {}
    for block in re.findall(r"```bash\n(.*?)```", joined(text), flags=re.S):
        for line in block.splitlines():
            command, _, comment = line.partition(" #")
            for part in re.split(r"&&|\||;", command):
                if part.strip():
                    shown.setdefault(part.strip(), []).append(comment)
    for command in INLINE_COMMAND.findall(FENCE.sub("", text)):
        shown.setdefault(command.strip(), []).append("")
    return shown


def unaccounted(text, run_by, not_run):
    """The commands of `text` that neither run_by nor not_run lists and whose lines carry no mark, then the listed
    commands that `text` does not show (a stale entry would vouch for nothing)."""
    shown = shown_commands(text)
    unrun = [command for command, comments in shown.items() if command not in run_by and command not in not_run
             and not any(mark in comment for comment in comments for mark in MARKS)]
    return unrun, [command for command in [*run_by, *not_run] if command not in shown]


def wrong_entries(run_by, root):
    """'command: why' for every entry whose runner does not run it: a script without that command line, a test
    file without that test, or one that never names the command's script or one of its flags."""
    wrong = []
    for command, where in run_by.items():
        if "::" not in where:
            path = root / where
            lines = path.read_text().splitlines() if path.is_file() else []
            if command not in [part.strip() for line in lines for part in line.split("&&")]:
                wrong.append(f"{command}: not in {where}")
            continue
        file, _, test = where.partition("::")
        source = (root / file).read_text() if (root / file).is_file() else ""
        if not re.search(rf"^def {re.escape(test)}\(", source, flags=re.M):
            wrong.append(f"{command}: {where} does not exist")
            continue
        words = shlex.split(command)
        script = next((w for w in words if w.endswith((".py", ".sh"))), words[0])
        for name in [Path(script).name, *(w.split("=")[0] for w in words if w.startswith("--") and w != "--")]:
            if not re.search(re.escape(name) + r"(?![\w-])", source):
                wrong.append(f"{command}: {file} never names {name}")
    return wrong


def test_the_command_check_finds_unmarked_unrun_and_stale_commands(tmp_path):
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "run").write_text("python3 -m venv .venv\n")
    (tmp_path / "checks").mkdir()
    (tmp_path / "checks/test_x.py").write_text("def test_x():\n    run(['train.py', '--depth=3'])\n")
    text = ("```bash\npython3 -m venv .venv && . .venv/bin/activate\npip install torch   # needs network\n"
            "python train.py --depth=3\ntorchrun train.py --depth=24   # GPU only: 1.3B\n```\n"
            "Then `python sample.py --T=8` and `bash runs/evidence_cpu.sh`.\n")
    run_by = {"python3 -m venv .venv": ".ci/run", "python train.py --depth=3": "checks/test_x.py::test_x",
              "python other/gone.py": ".ci/run"}
    unrun = [". .venv/bin/activate", "python sample.py --T=8", "bash runs/evidence_cpu.sh"]
    assert unaccounted(text, run_by, {}) == (unrun, ["python other/gone.py"])
    assert unaccounted(text, run_by, {"bash runs/evidence_cpu.sh": "long", "bash gone.sh": "long"}) == \
        (unrun[:2], ["python other/gone.py", "bash gone.sh"])
    run_by.update({"python train.py --depth=3 --seed=1": "checks/test_x.py::test_x",
                   "python sample.py --T=8": "checks/test_x.py::test_y", ". .venv/bin/activate": ".ci/run"})
    assert wrong_entries(run_by, tmp_path) == [
        "python other/gone.py: not in .ci/run",
        "python train.py --depth=3 --seed=1: checks/test_x.py never names --seed",
        "python sample.py --T=8: checks/test_x.py::test_y does not exist", ". .venv/bin/activate: not in .ci/run"]


def test_every_readme_command_is_run_by_a_test_or_says_why_not():
    unrun, stale = unaccounted(README, RUN_BY, NOT_RUN)
    assert not unrun, f"README commands that no test runs, no mark ({', '.join(MARKS)}) or NOT_RUN explains: {unrun}"
    assert not stale, f"RUN_BY or NOT_RUN lists commands README no longer shows: {stale}"
    assert not wrong_entries(RUN_BY, ROOT), wrong_entries(RUN_BY, ROOT)


def test_readme_sizes_table_is_what_the_code_computes():
    """README's table of the paper's sizes, recomputed as train.py --dry_run computes each row: the models of
    train.py's defaults (vocab 32,768, head_dim 128, seq_len 2048, batch 524,288, mu_rec 8) built on the meta
    device; GPU-hours: the matmul FLOPs executed at 40% MFU of an H100's 989 TFLOP/s."""
    import torch
    from model import Parcae, ParcaeConfig

    number = r" \| ([\d.e,]+)"
    rows = re.findall(rf"^\| [\d.]+[MB] \| (\d+) \| ([\d,]+) / ([\d,]+) \| [\d.]+B{number * 3} \|$", README, flags=re.M)
    tokens = {6: 11.2e9, 12: 29.6e9, 18: 61.6e9, 24: 104e9}  # train.py's PAPER_TOKENS (METHOD.md §1)
    assert [int(row[0]) for row in rows] == list(tokens)
    for depth, transformer, parcae, flops, total, gpu_hours in rows:
        models = {}
        for injection in ("none", "diagonal"):
            config = ParcaeConfig.from_depth(int(depth), vocab_size=32768, seq_len=2048, head_dim=128, mu_rec=8,
                                             injection=injection)
            with torch.device("meta"):
                models[injection] = Parcae(config)
        trained_tokens = int(tokens[int(depth)] // 524_288) * 524_288
        total_flops = models["diagonal"].flops_per_token() * trained_tokens
        assert int(transformer.replace(",", "")) == models["none"].num_params(), depth
        assert int(parcae.replace(",", "")) == models["diagonal"].num_params(), depth
        assert float(flops) == float(f"{models['diagonal'].flops_per_token():.3e}"), depth
        assert float(total) == float(f"{total_flops:.3e}"), depth
        executed = models["diagonal"].matmul_flops_per_token() * trained_tokens
        assert int(gpu_hours.replace(",", "")) == round(executed / (0.4 * 989e12) / 3600), depth
