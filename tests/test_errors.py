"""Bad input to every command: its status and one line naming the problem and the fix, before any work.

Each case names the words the line must carry, not its sentence, so rewording a message fails no test.
{base} stands for the test's own base folder."""

import os
from pathlib import Path

import pytest

from conftest import TINY, carries, raises_naming, refused, run_here

BOUND = ["positive"]  # the rule a value broke
ERRORS = [  # (command and flags, status, words naming the problem, words naming the fix)
    (["-m", "nanoparcae.tokenizer", "--vocab_size=0"], 2, ["--vocab_size", "0"], ["--vocab_size=259"]),
    # below the 256 byte tokens and the specials: refused before a tokenizer trains
    (["train.py", *TINY, "--data=stdlib", "--vocab_size=10"], 2, ["--vocab_size", "10"], ["--vocab_size=259"]),
    (["sample.py", "--ckpt=/nonexistent.pt"], 2, ["/nonexistent.pt"], ["ckpt_*.pt", "{base}/runs"]),
    (["-m", "nanoparcae.tokenizer", "--data=fineweb-edu"], 2, ["{base}/fineweb-edu", "shard_01822.parquet"],
     ["python -m nanoparcae.dataset download -n"]),
    (["-m", "nanoparcae.dataset", "download", "-n", "1"], 2, ["-n", "1"], ["2"]),  # a train shard and the val one
    (["-m", "nanoparcae.dataset", "download", "--workers=0"], 2, ["--workers", "0"], BOUND),
    (["-m", "nanoparcae.dataset", "download", "--tokens", "0"], 2, ["--tokens"], BOUND),
    (["-m", "nanoparcae.dataset", "download", "-n", "4", "--depth", "6"], 2, ["-n", "--depth"],
     ["-n", "--depth", "--tokens"]),  # sized two ways: pass one of the three
    (["-m", "nanoparcae.dataset", "download", "--depth", "5"], 2, ["--depth=5"], ["--tokens", "-n"]),
    (["eval_core.py", "--eval", "bpb", "--T", "0"], 2, ["--T", "0"], BOUND),
    (["eval_core.py", "--eval", "bpb", "--T", "1,x"], 2, ["--T", "1,x"], ["integers"]),
    (["eval_core.py", "--eval", "bpb", "--val_tokens=0"], 2, ["--val_tokens", "0"], BOUND),
    (["eval_core.py", "--eval", "bpb", "--batch_size=-1"], 2, ["--batch_size", "-1"], BOUND),
    (["eval_core.py", "--eval", "bpb", "--batch_tokens=0"], 2, ["--batch_tokens", "0"], BOUND),
    (["eval_core.py", "--eval", "bpb", "--max_docs=0"], 2, ["--max_docs", "0"], BOUND),
    (["eval_core.py", "--eval", "bpb", "--max_per_task=0"], 2, ["--max_per_task", "0"], ["positive", "-1"]),
    (["-m", "experiments.bench", "--steps", "0"], 2, ["--steps", "0"], BOUND),
    (["-m", "experiments.bench", "--seq_len", "-1"], 2, ["--seq_len", "-1"], BOUND),
    (["-m", "experiments.bench", "--depth", "0"], 2, ["--depth", "0"], BOUND),
    (["-m", "experiments.decoding", "--repeats", "0"], 2, ["--repeats", "0"], BOUND),
    (["-m", "experiments.decoding", "--exit_threshold", "0"], 2, ["--exit_threshold"], ["0"]),
    (["-m", "experiments.gpu_check", "table", ".", ".", "--gpus", "0", "--memory", "1"], 2, ["--gpus", "0"], BOUND),
    (["-m", "experiments.scaling", "fit", "--mu_rec=1,x"], 2, ["--mu_rec", "1,x"], ["numbers"]),
    (["-m", "experiments.scaling", "fit", "--preset=cpu"], 2, ["cpu", "{base}/runs"],
     ["python -m experiments.scaling run --preset=cpu"]),  # no finished run: the command that trains them
    (["train.py", *TINY, "--data=stdlib", "--depth=4"], 2, ["depth", "4"], ["3"]),  # not a multiple of 3
    (["train.py", *TINY, "--data=stdlib", "--d_model=100"], 2, ["d_model", "100"], ["head_dim", "32"]),
    (["train.py", *TINY, "--data=stdlib", "--total_batch_size=300"], 2, ["total_batch_size", "300"],
     ["device_batch_size"]),
    (["sample.py", "--prompt=hi"], 2, ["{base}/runs"], ["python train.py"]),  # where it looked, what makes one
    (["train.py"], 2, ["{base}/fineweb-edu"], ["python -m nanoparcae.dataset download", "bash runs/cpu.sh"]),
    (["train.py", *TINY, "--data=stdlib", "--run=never", "--resume"], 2, ["never", "{base}/runs/never"],
     ["--resume"]),
    (["train.py", *TINY, "--data=stdlib", f"--seed={2**64}"], 2, [f"--seed={2**64}"], ["0", "268435455"]),
    (["train.py", *TINY, "--check", "--bogus_flag"], 2, ["--bogus_flag"], []),
]


def case_id(args):
    """The command's name and its last two words: train.py --data=stdlib --depth=4."""
    name = args[1] if args[0] == "-m" else args[0]
    return " ".join([name, *args[2 if args[0] == "-m" else 1:][-2:]])


@pytest.mark.parametrize("args, status, problem, fix", ERRORS, ids=[case_id(case[0]) for case in ERRORS])
def test_bad_input_ends_in_one_line_naming_the_problem_and_the_fix(args, status, problem, fix, monkeypatch, capsys):
    base = Path(os.environ["NANOPARCAE_BASE_DIR"])
    result = run_here(args, monkeypatch, capsys)
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith(("usage:", " "))]
    assert result.returncode == status and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    named = [word.format(base=base) for word in problem]
    assert carries(lines[0], *named) and carries(lines[0], *[word.format(base=base) for word in fix]), lines[0]
    made = {path.relative_to(base).as_posix() for path in base.rglob("*")}
    assert made <= {"fineweb-edu"}, made  # before any work: at most the shards' folder, empty


# train.py's int flags: each past its range (int32's, or the seed's, whose step seeds must fit 64 bits) is refused
INT_FLAGS = ("depth", "d_model", "head_dim", "mu_rec", "mu_bwd", "seq_len", "device_batch_size", "total_batch_size",
             "eval_every", "eval_tokens", "save_every", "log_every", "stop_at",
             "rho_every", "diverge_steps", "seed")


def test_every_int_flag_past_its_range_is_refused_naming_the_flag_and_range():
    import train
    for flag in INT_FLAGS:
        with raises_naming(ValueError, f"--{flag}={2**64}", "268435455" if flag == "seed" else "2147483647"):
            train.parse_args([f"--{flag}={2**64}"])


@pytest.mark.parametrize("flags", [["--depth=4"], ["--head_dim=48"], ["--total_batch_size=100"], ["--run=../x"],
                                   [f"--run={'x' * 300}"]])
def test_check_refuses_in_training_s_line_what_training_refuses_before_it_allocates(flags, monkeypatch, capsys):
    """The model's shape (d_model 64 over heads of 48), the step's split into rows and the run's name: --check runs
    the checks training runs before it reads data or allocates, so it ends in the line training ends in."""
    lines = [refused(run_here(["train.py", *TINY, "--data=stdlib", *flags, *check], monkeypatch, capsys))
             for check in (["--check"], [])]
    assert lines[0] == lines[1] and flags[0].split("=")[0][2:] in lines[0], lines


def test_train_check_accepts_good_flags_and_starts_nothing(monkeypatch, capsys):
    base = Path(os.environ["NANOPARCAE_BASE_DIR"])
    result = run_here(["train.py", *TINY, "--data=fineweb-edu", "--check"], monkeypatch, capsys)
    assert result.returncode == 0 and not result.stdout and not result.stderr, result
    assert not base.exists() or not any(base.rglob("*"))
