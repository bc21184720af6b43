"""Tests for train.py, run as users run it (subprocesses): exact resume, two processes against one,
the non-finite-gradient skip, and one-line errors for bad input."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--depth=3", "--d_model=64", "--head_dim=32", "--mu_rec=3", "--vocab_size=320", "--seq_len=32",
        "--device_batch_size=4", "--total_batch_size=256", "--max_tokens=2048", "--eval_every=1000",
        "--eval_tokens=256", "--save_every=1000", "--log_every=1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text corpus (paragraphs are documents) and a base dir shared by the module's runs."""
    root = tmp_path_factory.mktemp("train")
    rng = random.Random(0)
    words = ["loop", "state", "depth", "token", "model", "stable", "radius", "prelude", "coda", "sample", "the",
             "a", "of", "is", "and", "runs", "learns", "every", "step", "with"]
    paragraphs = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 80))) + "." for _ in range(400)]
    (root / "corpus.txt").write_text("\n\n".join(paragraphs))
    return root


def train(corpus, *flags, nproc=1, expect_ok=True):
    env = {**os.environ, "NANOPARCAE_BASE_DIR": str(corpus / "base"), "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "--"]
    cmd = launcher + [str(ROOT / "train.py"), f"--data={corpus / 'corpus.txt'}", *TINY, *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if expect_ok:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def step_losses(corpus, run):
    lines = (corpus / "base" / "runs" / run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_resumed_run_gives_exactly_the_losses_of_an_uninterrupted_run(corpus):
    train(corpus, "--run=whole")
    train(corpus, "--run=halves", "--stop_at=4")
    assert list(step_losses(corpus, "halves")) == [1, 2, 3, 4]
    train(corpus, "--run=halves", "--resume")
    whole, halves = step_losses(corpus, "whole"), step_losses(corpus, "halves")
    assert list(whole) == list(range(1, 9))
    assert halves == whole  # bit for bit
    assert whole[8] < whole[1]
    changed = train(corpus, "--run=halves", "--resume", "--d_model=96", expect_ok=False)
    assert changed.returncode != 0 and len(changed.stderr.strip().splitlines()) == 1
    assert "cannot resume halves with these flags" in changed.stderr and "size mismatch" in changed.stderr


def test_two_processes_give_the_losses_of_one(corpus):
    # one process: 2 micro-batches of 4; two processes: 1 micro-batch of 4 each; per-sequence depths
    train(corpus, "--run=one")
    train(corpus, "--run=two", nproc=2)
    one, two = step_losses(corpus, "one"), step_losses(corpus, "two")
    assert list(one) == list(two) == list(range(1, 9))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), step


def test_non_finite_gradients_are_skipped_and_the_run_goes_on(corpus):
    result = train(corpus, "--run=nan", "--fault_nan_step=2")
    assert "non-finite gradients, update skipped (1 so far)" in result.stdout
    records = [json.loads(line) for line in (corpus / "base" / "runs" / "nan" / "metrics.jsonl").open()]
    steps = [r for r in records if "loss" in r]
    assert steps[-1]["step"] == 8 and steps[-1]["skipped_steps"] == 1
    assert all(r["loss"] == r["loss"] for r in steps)  # no NaN reached the weights
    assert [r for r in records if "val_loss_T1" in r][-1]["val_loss_T1"] < 100


@pytest.mark.parametrize("flags,message", [
    (["--depth=4"], "multiple of 3"),
    (["--total_batch_size=300"], "not divisible by device_batch_size"),
    (["--data=/nonexistent/corpus/*.txt"], "no .txt, .jsonl or .parquet files match"),
])
def test_bad_input_ends_with_one_clear_line(corpus, flags, message):
    env = {**os.environ, "NANOPARCAE_BASE_DIR": str(corpus / "base")}
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, f"--data={corpus / 'corpus.txt'}",
                             *flags], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_dry_run_prints_the_paper_size(tmp_path):
    env = {**os.environ, "NANOPARCAE_BASE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--depth=24", "--mu_rec=8", "--dry_run"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert "parameters: 1,338,591,744" in result.stdout and "tokens: 103,999," in result.stdout


def test_authors_per_batch_sampling_trains_and_per_document_ppl_runs(corpus):
    train(corpus, "--run=per_batch", "--sampling=per_batch", "--max_tokens=512")
    env = {**os.environ, "NANOPARCAE_BASE_DIR": str(corpus / "base"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "eval_core.py"), "--eval=ppl", "--T=1,3", "--max_docs=20",
                             "--run=per_batch"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(next((corpus / "base" / "runs" / "per_batch").glob("*_ppl_T1-3.json")).read_text())
    assert out["T"] == [1, 3] and all(1 < ppl < 320 for ppl in out["ppl"])  # better than uniform over the vocab
    assert "one per forward" in result.stdout and "ppl" in result.stdout
