"""The device batch train.py runs (memory.choose_device_batch against the GPU's memory, the run's recorded size on
resume), the two kinds of flag (those that define a run, and those that may change when it continues), and concat's
rho at a cadence of its own. The GPU is faked: torch.cuda reports 80 GB, and train.py stops at its memory plan,
before it would touch the device.

    python -m pytest tests/test_device_batch.py
"""

import json
import re
import runpy
import shutil
import sys

import pytest
import torch

from conftest import ROOT, TINY, awaited, beforehand, carries, python, train, train_command, train_env, write_corpus
from model import Parcae, ParcaeConfig
from nanoparcae.checkpoint import digest_of
from nanoparcae.memory import largest_divisor, memory_plan
from optim import optimizer_state_bytes


def largest_fitting_batch(model, sequences, gpu_gb, bf16, optimizer_bytes):
    """The largest divisor of `sequences` whose memory plan fits in 90% of gpu_gb GB (None: not even one)."""
    most = memory_plan(model, 1, bf16, optimizer_bytes, (gpu_gb,))["largest_batch"][gpu_gb]
    return largest_divisor(sequences, most)


def run_train(monkeypatch, capsys, *flags):
    """train.py in this process with these flags (it must exit before training) -> (status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "train.py"), *flags])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.fixture
def gpu_80gb(monkeypatch):
    """torch.cuda as train.py sees it on one 80 GB GPU. The matmul precision train.py sets for a GPU (TF32) is set
    back after the test: it is part of the key of every graph inductor caches."""
    precision = torch.backends.cuda.matmul.fp32_precision
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Faked GPU 80GB")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (79e9, 80e9))
    yield
    torch.backends.cuda.matmul.fp32_precision = precision


def paper_1p3b():
    with torch.device("meta"):
        model = Parcae(ParcaeConfig.from_depth(24, mu_rec=8))
    return model, optimizer_state_bytes(model)


def test_the_largest_fitting_batch_divides_the_batch_and_fits():
    model, optimizer_bytes = paper_1p3b()
    for gb, sequences in [(80, 256), (80, 32), (141, 32), (141, 24), (40, 32)]:
        size = largest_fitting_batch(model, sequences, gb, True, optimizer_bytes)
        fits = [b for b in range(1, sequences + 1) if sequences % b == 0
                and memory_plan(model, b, True, optimizer_bytes)["total"] <= 0.9 * gb * 1e9]
        assert size == fits[-1], (gb, sequences)
    assert largest_fitting_batch(model, 32, 20, True, optimizer_bytes) is None  # 1.3B at one sequence: 30.7 GB


def test_a_faked_80gb_gpu_gets_a_plan_within_it_and_a_size_over_it_is_refused(gpu_80gb, monkeypatch, capsys):
    status, out, err = run_train(monkeypatch, capsys, "--depth=24", "--mu_rec=8", "--device=cuda", "--dry_run")
    assert status == 0, err
    planned = float(re.search(r"memory per GPU \(GB\): .* = ([\d.]+) \|", out)[1])
    size = int(re.search(r"device batch: (\d+), the largest divisor of the 256 sequences", out)[1])
    model, optimizer_bytes = paper_1p3b()
    assert size == 4 == largest_fitting_batch(model, 256, 80, True, optimizer_bytes)
    assert planned <= 0.9 * 80 and memory_plan(model, 8, True, optimizer_bytes)["total"] > 0.9 * 80e9
    assert "(4 x 2048 backpropagating up to 4 steps, bfloat16, compiled)" in out
    assert "an estimate until a GPU measures it" in out

    status, out, err = run_train(monkeypatch, capsys, "--depth=24", "--mu_rec=8", "--device=cuda", "--dry_run",
                                    "--device_batch_size=32")
    assert status == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert carries(err, "--device_batch_size=32", "216.8 GB", "80.0 GB", "4"), err  # the size, its plan, the fit
    assert "memory per GPU" not in out  # refused before any plan or work


def test_the_plan_is_for_the_memory_free_at_start_up_not_the_gpus_total(gpu_80gb, monkeypatch, capsys):
    """Another process holds 60 of the 80 GB: the 1.3B is refused, naming what is free and what one sequence
    plans, before anything is built; the 140M fits a smaller batch in the 20 GB free than in 80."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20e9, 80e9))
    status, out, err = run_train(monkeypatch, capsys, "--depth=24", "--mu_rec=8", "--device=cuda", "--dry_run")
    model, optimizer_bytes = paper_1p3b()
    one = memory_plan(model, 1, True, optimizer_bytes)["total"] / 1e9
    assert status == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert carries(err, f"{one:.1f} GB", "20.0 GB", "80.0 GB"), err
    sizes = {}
    for free in (20e9, 80e9):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (free, 80e9))
        status, out, err = run_train(monkeypatch, capsys, "--depth=6", "--device=cuda", "--dry_run")
        assert status == 0, err
        sizes[free] = int(re.search(r"device batch: (\d+), the largest divisor", out)[1])
    assert sizes[20e9] < sizes[80e9], sizes


def dry_run_under_torchrun(folder):
    tiny = [flag for flag in TINY if not flag.startswith("--device_batch_size")]
    return python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--",
                   str(ROOT / "train.py"), *tiny, "--data=stdlib", "--device=cpu", "--dry_run"],
                  {"NANOPARCAE_BASE_DIR": str(folder / "base")})


@pytest.mark.slow
@beforehand(dry_run_under_torchrun)
def test_dry_run_under_torchrun_prints_one_plan_for_its_processes():
    """The 8 sequences of a step, 256 tokens of 32, over torchrun's 2 processes: 4 each, said once."""
    result = awaited(dry_run_under_torchrun)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(re.findall("^device batch:", result.stdout, re.M)) == result.stdout.count("parameters:") == 1
    assert "device batch: 4, the largest divisor of the 4 sequences a process runs" in result.stdout


def test_without_a_gpu_the_batch_is_the_largest_divisor_up_to_32(monkeypatch, capsys):
    tiny = [flag for flag in TINY if not flag.startswith("--device_batch_size")]
    status, out, err = run_train(monkeypatch, capsys, *tiny, "--device=cpu", "--dry_run")  # 256 / 32 = 8 rows
    assert status == 0 and "device batch: 8, the largest divisor of the 8 sequences" in out, err


def concat_run(folder):
    """A 4-step concat run on the tiny corpus in folder (CONCAT) -> the folder."""
    write_corpus(folder / "corpus.txt")
    train(folder, *CONCAT)
    return folder


def kept_batch(folder):
    """A run started at --device_batch_size=2, then continued without the flag -> the folder, the continuation."""
    write_corpus(folder / "corpus.txt")
    train(folder, "--device_batch_size=2", "--max_tokens=512", "--stop_at=1", "--run=kept")
    command = [flag for flag in train_command(folder, "--max_tokens=512", "--run=kept")
               if not flag.startswith("--device_batch_size")]
    return folder, python(command, train_env(folder))


@pytest.mark.slow
@beforehand(kept_batch)
def test_a_resume_keeps_the_recorded_batch():
    """Started at --device_batch_size=2, continued without the flag: the CPU's own choice would be 8."""
    folder, result = awaited(kept_batch)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "device batch: 2, as run kept recorded" in result.stdout and "4 micro-batch(es) x 2 x 32" in result.stdout
    checkpoint = torch.load(next((folder / "base" / "runs" / "kept").glob("ckpt_*.pt")), weights_only=True)
    assert checkpoint["step"] == 2 and checkpoint["run"]["device_batch_size"] == 2


@pytest.mark.slow
@beforehand(concat_run)
def test_concat_rho_is_logged_every_rho_every_steps_and_is_the_weights_radius():
    corpus = awaited(concat_run)  # 4 steps
    run_dir = corpus / "base" / "runs" / "concat"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rho = {entry["step"]: entry["rho"] for entry in steps if "loss" in entry}
    assert list(rho) == [1, 2, 3, 4] and rho[1] is None and rho[3] is None  # --rho_every: --eval_every's 2
    adapter = torch.load(run_dir / "ckpt_000004.pt", weights_only=True)["model"]["injection.adapter.weight"]
    radius = torch.linalg.eigvals(adapter[:, :adapter.shape[0]].double()).abs().max().item()
    assert rho[2] > 0 and rho[4] == pytest.approx(radius, rel=1e-4)


CONCAT = ["--injection=concat", "--max_tokens=1024", "--eval_every=2", "--run=concat"]  # concat_run's run
# Another value of each flag --help lists: a run-defining flag's is refused on a run that exists, naming the flag; any
# other flag's continues the run (which, finished, says it is done).
RUN_DEFINING = {
    "depth": "6", "d_model": "96", "head_dim": "16", "mu_rec": "4", "mu_bwd": "1", "injection": "add",
    "depth_sampling": "per_batch", "prelude_norm": "0", "vocab_size": "384", "seq_len": "64", "data": "stdlib",
    "max_tokens": "2048", "param_data_ratio": "1", "target_flops": "1e12", "device_batch_size": "2",
    "total_batch_size": "512", "optimizer": "adamw", "adamw_lr": "0.01", "muon_lr": "0.01", "weight_decay": "0.1",
    "grad_clip": "0.5", "warmdown_frac": "0.25", "seed": "1",
}
FREE = {
    "device": "cpu", "dtype": "bfloat16", "compile": "1", "compile_backend": "eager", "eval_every": "5",
    "eval_tokens": "512", "save_every": "5", "log_every": "5",
    "rho_every": "5", "diverge_steps": "2", "diverge_h_norm": "5", "resume": None, "stop_at": "1",
    "collective_timeout": "60", "rank0_timeout": "60",
}
NEITHER = {"run", "dry_run", "check"}  # another run; a plan only; the flags checked only


@pytest.mark.slow
@beforehand(concat_run)
def test_every_flag_defines_the_run_or_may_change_when_it_continues(monkeypatch, capsys):
    """On the finished concat run, another value of each flag --help lists: a run-defining one is refused in one line
    that names it, and the checkpoint records exactly those flags; any other one continues the run, which says it is
    done. A flag this test does not classify fails it."""
    corpus = awaited(concat_run)
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(corpus / "base"))
    _, out, _ = run_train(monkeypatch, capsys, "--help")
    assert set(re.findall(r"^  --(\w+)", out, flags=re.M)) == set(RUN_DEFINING) | set(FREE) | NEITHER
    command = [f"--data={corpus / 'corpus.txt'}", *TINY, *CONCAT]
    for name, value in {**RUN_DEFINING, **FREE}.items():
        status, out, err = run_train(monkeypatch, capsys, *command, f"--{name}" + (f"={value}" if value else ""))
        if name in RUN_DEFINING:
            assert status == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (name, err)
            assert re.search(rf"other flags: .*\b{name} \S+ there, \S+ here", err), (name, err)
        else:
            assert status == 0 and carries(out, "run", "concat", "done"), (name, out, err)
    checkpoint = torch.load(corpus / "base" / "runs" / "concat" / "ckpt_000004.pt", weights_only=True)
    assert set(checkpoint["run"]) == set(RUN_DEFINING)


@pytest.mark.slow
@beforehand(concat_run)
def test_a_checkpoint_that_recorded_a_former_flag_name_continues(monkeypatch, capsys):
    """A checkpoint written before --sampling became --depth_sampling records `sampling`: the same command
    continues its run (finished: done), and another sampler is still refused, naming the flag."""
    corpus = awaited(concat_run)
    base = corpus / "base" / "runs"
    shutil.copytree(base / "concat", base / "concat_old", ignore=shutil.ignore_patterns("lock"))
    path = base / "concat_old" / "ckpt_000004.pt"
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["run"]["sampling"] = checkpoint["run"].pop("depth_sampling")
    torch.save({**checkpoint, "digest": digest_of(checkpoint)}, path)  # signed, as train.py saves it
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(corpus / "base"))
    command = [f"--data={corpus / 'corpus.txt'}", *TINY, *CONCAT, "--run=concat_old"]
    status, out, err = run_train(monkeypatch, capsys, *command)
    assert status == 0 and carries(out, "run", "concat_old", "done"), (out, err)
    status, _, err = run_train(monkeypatch, capsys, *command, "--depth_sampling=per_batch")
    assert status == 2 and carries(err, "depth_sampling", "per_sequence", "per_batch"), err


def test_readme_and_docs_commands_fit_their_plan_and_the_readme_table_is_the_choice():
    """Every train.py command of README and docs that gives --device_batch_size fits in 80 GB by the plan (the others
    let train.py choose); the table of the paper's runs (README or docs) is what 8 processes pick on 80 and 141 GB."""
    defaults = dict(depth="6", mu_rec="8", vocab_size="32768", seq_len="2048", head_dim="128", dtype="bfloat16")
    text = "\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    commands = [line for line in text.replace("\\\n", " ").splitlines()
                if "train.py" in line and "--device_batch_size=" in line]
    assert commands
    for command in commands:
        flags = {**defaults, **dict(re.findall(r"--(\w+)=(\S+)", command))}
        config = ParcaeConfig.from_depth(int(flags["depth"]), mu_rec=int(flags["mu_rec"]),
                                         vocab_size=int(flags["vocab_size"]), seq_len=int(flags["seq_len"]),
                                         head_dim=int(flags["head_dim"]),
                                         **({"d_model": int(flags["d_model"])} if "d_model" in flags else {}))
        with torch.device("meta"):
            model = Parcae(config)
        plan = memory_plan(model, int(flags["device_batch_size"]), flags["dtype"] == "bfloat16",
                                 optimizer_state_bytes(model))
        assert plan["total"] <= 0.9 * 80e9, command
    rows = re.findall(r"^\| ([\d.]+[MB]) \| (\d+), ([\d.]+) GB \| (\d+), ([\d.]+) GB \|$", text, flags=re.M)
    assert [row[0] for row in rows] == ["140M", "370M", "770M", "1.3B"]
    for (_, *row), depth in zip(rows, (6, 12, 18, 24)):
        with torch.device("meta"):
            model = Parcae(ParcaeConfig.from_depth(depth, mu_rec=8))
        optimizer_bytes = optimizer_state_bytes(model)
        for gb, size, total in zip((80, 141), row[::2], row[1::2]):
            assert int(size) == largest_fitting_batch(model, 32, gb, True, optimizer_bytes), (depth, gb)
            assert float(total) == round(memory_plan(model, int(size), True, optimizer_bytes)["total"] / 1e9, 1)
