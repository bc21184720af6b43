"""runs/gpu_check.sh --tiny, run as the GPU session would run it but on a CPU with one stage made to fail: every
row is in the table, the CPU rows have figures, the CUDA-only row says why it did not run, the failed stage's row
says why in one line and the stages after it still ran, and $OUT/gpu_check.md is the printed table. Then
experiments/gpu_check.py's rows from stage outputs written by hand: a time-out, a missing stage, the bf16 difference."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments import gpu_check

ROOT = Path(__file__).resolve().parent.parent
NUMBERS = ["1", "2a", "2b", "2c", "2d", "2e", "2f", "2g", "3a", "3b", "3c", "3d", "4", "5"]


def table_rows(table):
    """{number: (check, result, target)} of a gpu_check table; the header and rule lines checked first."""
    lines = table.strip().splitlines()
    assert lines[0].startswith("| # | runs/gpu_check.sh") and lines[1] == "|---|---|---|---|"
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]
    assert all(len(row) == 4 for row in rows), lines
    return {row[0]: tuple(row[1:]) for row in rows}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One --tiny run whose float32 stage fails (a PYTHON that refuses --dtype=float32), as a crash would."""
    root = tmp_path_factory.mktemp("gpu_check")
    python = root / "python"
    python.write_text('#!/bin/bash\ncase " $* " in *" --dtype=float32 "*) echo "RuntimeError: injected failure" >&2; '
                      f'exit 1;; esac\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "OUT": str(root / "out"), "NANOPARCAE_BASE_DIR": str(root / "base"),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run(["bash", str(ROOT / "runs" / "gpu_check.sh"), "--tiny"], capture_output=True, text=True,
                            env=env, timeout=1800, cwd=root)
    return result, root / "out/gpu_check.md", root / "out/gpu_check.log"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the rows a machine without a GPU prints")
def test_tiny_run_prints_every_row_and_a_failed_stage_stops_only_its_own(tiny_run):
    result, table_file, log_file = tiny_run
    assert result.returncode == 1, result.stderr[-3000:]  # a row failed: the status says so
    assert table_file.read_text() == result.stdout
    rows = table_rows(result.stdout)
    assert list(rows) == NUMBERS
    check, outcome, target = rows["5"]  # the float32 stage failed, the bf16 one after it ran
    assert outcome == "failed: fp32 exited 1: RuntimeError: injected failure" and target == ""
    assert rows["4"][1] == "not run: no GPU"  # torch.cuda.max_memory_allocated needs one
    for number in NUMBERS[:-2]:  # every stage after the failed one ran: their rows have figures
        check, outcome, target = rows[number]
        assert re.search(r"\d", outcome) and not outcome.startswith(("failed", "not run")), (number, outcome)
    for number in ("2a", "2b", "2c", "2d", "2g", "3a", "3b", "3d"):
        assert re.search(r": (met|not met)$", rows[number][2]), (number, rows[number])
    assert rows["3a"][2] == "falls: met" and rows["3b"][2] == "none after step 10: met"
    assert rows["3d"][1].startswith("1 process(es), gloo") and "ckpt_000003.pt saved" in rows["3d"][1]
    assert "backend eager" in rows["2g"][0] and "checkpoint gpu_check_train/ckpt_000020.pt" in rows["2f"][0]
    log = log_file.read_text()
    for stage in ("train", "fp32", "bf16", "ddp", "bench"):
        assert f"== {stage}: " in log
    assert "== dry_run" not in log  # no GPU, no peak to hold the plan against


def write_stage(work, name, status=0, limit=60, log=""):
    (work / f"{name}.rc").write_text(f"{status} {limit}\n")
    (work / f"{name}.log").write_text(log)


def write_steps(runs_dir, name, losses, **extra):
    run = runs_dir / f"gpu_check_{name}"
    run.mkdir(parents=True)
    records = [{"step": step, "loss": loss, "tokens_per_s": 1000.0, **extra} for step, loss in enumerate(losses, 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_rows_from_stage_outputs(tmp_path, capsys):
    work, runs_dir = tmp_path / "work", tmp_path / "runs"
    work.mkdir()
    write_stage(work, "bench", status=124, limit=200)  # timed out before its first row
    write_stage(work, "train", status=1, log="step 1/20\nTraceback (most recent call last):\n  File x\n"
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n[rank0] teardown\n")
    write_stage(work, "fp32")
    write_stage(work, "bf16")
    write_steps(runs_dir, "fp32", [6.0, 5.0, 4.0])
    write_steps(runs_dir, "bf16", [6.0, 5.04, 4.0])
    assert gpu_check.main([str(work), str(runs_dir), "--gpus", "1", "--tiny"]) == 1
    rows = table_rows(capsys.readouterr().out)
    assert list(rows) == NUMBERS
    assert rows["2a"][1] == "failed: bench timed out after 200 s"
    assert rows["1"][1].endswith("matmul failed: bench timed out after 200 s")  # the versions themselves print
    assert rows["3a"][1] == ("failed: train exited 1: torch.OutOfMemoryError: CUDA out of memory. "
                             "Tried to allocate 2 GiB")
    assert rows["3d"][1] == "failed: stage ddp did not run"
    assert "largest 0.800%" in rows["5"][1] and "step 1 0.000%" in rows["5"][1]
    assert rows["5"][2] == "<= 1%: met"
    write_stage(work, "ddp")
    write_steps(runs_dir, "ddp", [6.0])
    (runs_dir / "gpu_check_bf16" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 6.2}) + "\n")
    gpu_check.main([str(work), str(runs_dir), "--gpus", "1"])
    rows = table_rows(capsys.readouterr().out)
    assert rows["5"][1] == "failed: the runs logged different steps: [1, 2, 3] and [1]"
    assert rows["3d"][1].endswith("1 steps, ckpt_000001.pt missing") and rows["3d"][2].endswith(": not met")
