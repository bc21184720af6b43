"""Tests for train.py, run as users run it (subprocesses): exact resume, the same command again after a kill, two
processes and two "nodes" against one, an elastic restart after a killed rank, the non-finite-gradient skip, the
divergence rule, README's L(T) command against the run's own last eval, and one-line errors for bad input."""

import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--depth=3", "--d_model=64", "--head_dim=32", "--mu_rec=3", "--vocab_size=320", "--seq_len=32",
        "--device_batch_size=4", "--total_batch_size=256", "--max_tokens=2048", "--eval_every=1000",
        "--eval_tokens=256", "--save_every=1000", "--log_every=1", "--core_every=-1"]


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


def train_command(corpus, *flags, nproc=1, torchrun=None):
    """Plain python for one process without torchrun flags; torchrun otherwise (standalone unless `torchrun`
    gives the launcher's rendezvous flags, as the two-node test does for one process per node)."""
    launcher = [sys.executable] if nproc == 1 and torchrun is None else \
        [sys.executable, "-m", "torch.distributed.run", *(torchrun or ["--standalone"]), f"--nproc_per_node={nproc}",
         "--"]
    return launcher + [str(ROOT / "train.py"), f"--data={corpus / 'corpus.txt'}", *TINY, *flags]


def train_env(corpus, **extra):
    return {**os.environ, "NANOPARCAE_BASE_DIR": str(corpus / "base"), "OMP_NUM_THREADS": "1", **extra}


def train(corpus, *flags, nproc=1, torchrun=None, env=None, expect_ok=True):
    result = subprocess.run(train_command(corpus, *flags, nproc=nproc, torchrun=torchrun), capture_output=True,
                            text=True, env=train_env(corpus, **(env or {})), timeout=300)
    if expect_ok:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def one(corpus):
    """One process, 2 micro-batches of 4 per step: the reference the multi-process runs must equal."""
    train(corpus, "--run=one")
    return step_losses(corpus, "one")


@pytest.fixture(scope="module")
def two(corpus):
    """Two processes on this node, 1 micro-batch of 4 each."""
    train(corpus, "--run=two", nproc=2)
    return step_losses(corpus, "two")


def final_weights(corpus, run):
    path = corpus / "base" / "runs" / run / "ckpt_000008.pt"
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def step_losses(corpus, run):
    lines = (corpus / "base" / "runs" / run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_resumed_run_gives_exactly_the_losses_of_an_uninterrupted_run(corpus):
    train(corpus, "--run=whole")
    train(corpus, "--run=halves", "--stop_at=4")
    assert list(step_losses(corpus, "halves")) == [1, 2, 3, 4]
    changed = train(corpus, "--run=halves", "--resume", "--d_model=96", expect_ok=False)
    assert changed.returncode != 0 and len(changed.stderr.strip().splitlines()) == 1
    assert "cannot resume halves with these flags" in changed.stderr and "size mismatch" in changed.stderr
    train(corpus, "--run=halves", "--resume")
    whole, halves = step_losses(corpus, "whole"), step_losses(corpus, "halves")
    assert list(whole) == list(range(1, 9))
    assert halves == whole  # bit for bit
    assert whole[8] < whole[1]


def logged_steps(run_dir):
    """The steps of metrics.jsonl's step records, in file order; a line still being written is left out."""
    steps = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        steps += [record["step"]] if "loss" in record else []
    return steps


def test_the_same_command_after_a_kill_continues_from_the_checkpoint_and_a_finished_run_stays_done(corpus):
    """Killed from outside once it has logged steps past a checkpoint, the same command again continues from that
    checkpoint: it is kept until the next save, each step is logged once and in order, and the steps done twice
    have the losses the killed run logged, bit for bit. The same command once more says the run is done and
    changes nothing."""
    flags, run_dir = ["--max_tokens=10240", "--save_every=5"], corpus / "base" / "runs" / "rerun"  # 40 steps
    killed = subprocess.Popen(train_command(corpus, "--run=rerun", *flags), env=train_env(corpus),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while killed.poll() is None and time.time() < deadline:
        saved = [int(path.stem[5:]) for path in run_dir.glob("ckpt_*.pt")]
        if saved and max(logged_steps(run_dir), default=0) > max(saved):
            killed.kill()
        time.sleep(0.01)
    killed.wait()
    assert killed.returncode == -9, "the run ended before it could be killed past a checkpoint"
    kept, before = max(run_dir.glob("ckpt_*.pt")), step_losses(corpus, "rerun")
    at = int(kept.stem[5:])
    assert 0 < at < max(before) < 40
    again = train(corpus, "--run=rerun", *flags)
    assert f"resumed rerun at step {at}, from {kept} (a new --run trains afresh)" in again.stdout
    assert re.findall(r"saved .*ckpt_(\d+)\.pt", again.stdout)[0] == f"{at + 5:06d}"  # not step 5 of a restart
    assert logged_steps(run_dir) == list(range(1, 41))
    after = step_losses(corpus, "rerun")
    assert {step: after[step] for step in before} == before  # steps at..max(before) done again, the same
    metrics, mtime = (run_dir / "metrics.jsonl").read_text(), (run_dir / "ckpt_000040.pt").stat().st_mtime_ns
    done = train(corpus, "--run=rerun", *flags)
    assert f"run rerun is done: {run_dir / 'ckpt_000040.pt'} holds its last step, 40" in done.stdout
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    assert (run_dir / "ckpt_000040.pt").stat().st_mtime_ns == mtime


def test_a_run_whose_files_changed_is_not_continued_on_them(corpus, tmp_path):
    changed = tmp_path / "corpus.txt"
    changed.write_text((corpus / "corpus.txt").read_text())
    train(corpus, "--run=changed", f"--data={changed}", "--stop_at=2")
    changed.write_text(changed.read_text() + "\n\nthe loop learns a stable state.")
    result = train(corpus, "--run=changed", f"--data={changed}", expect_ok=False)
    assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"the files of --data={changed} are not the ones run changed was trained on" in result.stderr
    assert logged_steps(corpus / "base" / "runs" / "changed") == [1, 2]


def test_two_processes_give_the_losses_of_one(one, two):
    assert list(one) == list(two) == list(range(1, 9))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), step


def test_two_nodes_give_the_losses_and_weights_of_one_process(corpus, one):
    # two torchrun launches, one process each, meeting at a c10d rendezvous as two machines would
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = ["--nnodes=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=test"]
    nodes = [subprocess.Popen(train_command(corpus, "--run=nodes", nproc=1, torchrun=torchrun), env=train_env(corpus),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-3000:]
    assert sum("= 2 process(es)" in stdout for stdout, _ in outputs) == 1  # one job of two ranks, rank 0 logs
    nodes_losses = step_losses(corpus, "nodes")
    assert list(nodes_losses) == list(one)
    for step in one:
        assert nodes_losses[step] == pytest.approx(one[step], rel=1e-4), step
    reference, weights = final_weights(corpus, "one"), final_weights(corpus, "nodes")
    for name in reference:
        torch.testing.assert_close(weights[name], reference[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_killed_rank_is_restarted_and_the_run_ends_with_the_weights_of_an_unbroken_run(corpus, two):
    # the last rank SIGKILLs itself after step 6; torchrun restarts both workers, which resume from the
    # step-4 checkpoint and recompute steps 5 and 6 exactly
    launch = dict(nproc=2, torchrun=("--standalone", "--max_restarts=1"))
    shared = train(corpus, "--run=shared_store", **launch, env={"NANOPARCAE_FAULT": "kill_step=1"}, expect_ok=False)
    assert shared.returncode != 0 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared.stderr  # a clear line
    result = train(corpus, "--run=elastic", "--save_every=4", **launch,
                   env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "NANOPARCAE_FAULT": "kill_step=6"})
    assert "resumed elastic at step 4, elastic restart 1" in result.stdout
    reference, weights = final_weights(corpus, "two"), final_weights(corpus, "elastic")
    assert reference.keys() == weights.keys()
    for name in reference:
        assert torch.equal(weights[name], reference[name]), name  # bit for bit


def test_bf16_autocast_on_a_cpu_tracks_float32(corpus, one):
    # --dtype=bfloat16 runs the GPU's autocast on a CPU; after 8 steps the losses differ by ~0.2% here
    result = train(corpus, "--run=bf16", "--dtype=bfloat16")
    assert "Mismatch dtype" not in result.stderr  # every RMSNorm took its fused path
    bf16 = step_losses(corpus, "bf16")
    assert list(bf16) == list(one) and bf16 != one
    for step in one:
        assert bf16[step] == pytest.approx(one[step], rel=1e-2), step
    evals = {run: [json.loads(line) for line in (corpus / "base" / "runs" / run / "metrics.jsonl").open()
                   if "val_loss_T1" in line][-1] for run in ("one", "bf16")}
    assert evals["bf16"]["val_loss_T3"] == pytest.approx(evals["one"]["val_loss_T3"], rel=1e-2)


def test_non_finite_gradients_are_skipped_and_the_run_goes_on(corpus):
    result = train(corpus, "--run=nan", env={"NANOPARCAE_FAULT": "nan_step=2"})
    assert "non-finite gradients, update skipped (1 so far)" in result.stdout
    records = [json.loads(line) for line in (corpus / "base" / "runs" / "nan" / "metrics.jsonl").open()]
    steps = [r for r in records if "loss" in r]
    assert steps[-1]["step"] == 8 and steps[-1]["skipped_steps"] == 1
    assert all(r["loss"] == r["loss"] for r in steps)  # no NaN reached the weights
    assert [r for r in records if "val_loss_T1" in r][-1]["val_loss_T1"] < 100


def test_a_run_non_finite_for_k_steps_is_declared_diverged_and_keeps_its_last_good_checkpoint(corpus):
    # the gradients of steps 3, 4 and 5 are poisoned (the hook counts steps from 0): three bad steps in a row
    result = train(corpus, "--run=diverged", "--save_every=2", "--diverge_steps=3",
                   env={"NANOPARCAE_FAULT": "nan_step=2,nan_steps=3"}, expect_ok=False)
    assert result.returncode == 3, result.stderr[-3000:]
    run_dir = corpus / "base" / "runs" / "diverged"
    assert (f"diverged at step 3: non-finite loss or gradients, 3 steps in a row (to step 5); the last checkpoint, "
            f"{run_dir / 'ckpt_000002.pt'}, from before, is kept") in result.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert records[-1] == {"step": 5, "diverged_at": 3, "reason": "non-finite loss or gradients"}
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]
    # step 4's checkpoint waited for a good step that never came: step 2's stays, the state before the streak
    assert [path.name for path in run_dir.glob("ckpt_*.pt")] == ["ckpt_000002.pt"]
    train(corpus, "--run=before_streak", "--stop_at=2")
    kept, reference = (torch.load(corpus / "base" / "runs" / run / "ckpt_000002.pt", weights_only=True)["model"]
                       for run in ("diverged", "before_streak"))
    assert kept.keys() == reference.keys()
    for name in reference:
        assert torch.equal(kept[name], reference[name]), name


def test_a_state_past_the_bound_for_k_steps_is_declared_diverged(corpus):
    result = train(corpus, "--run=exploded", "--diverge_h_norm=1e-3", "--diverge_steps=2", expect_ok=False)
    assert result.returncode == 3
    assert ("diverged at step 1: ||h_T|| > 0.001, 2 steps in a row (to step 2); no checkpoint was saved before it"
            in result.stdout)
    assert not any((corpus / "base" / "runs" / "exploded").glob("ckpt_*.pt"))


def test_a_val_loss_far_above_a_uniform_guess_is_declared_diverged_at_that_eval(corpus):
    """At a rate of 3 the first eval (step 2) is far above ln 320: the run stops there, before any checkpoint. The
    same command at the recipe's rate then starts afresh: its evals stay below ln 320, each step logged once."""
    result = train(corpus, "--run=hot", "--adamw_lr=3", "--muon_lr=3", "--eval_every=2", expect_ok=False)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "diverged at step 2: val loss far above a uniform guess" in result.stdout
    assert result.stdout.splitlines()[-2].endswith("; no checkpoint was saved before it")
    records = [json.loads(line) for line in (corpus / "base" / "runs" / "hot" / "metrics.jsonl").open()]
    assert records[-1] == {"step": 2, "diverged_at": 2, "reason": "val loss far above a uniform guess"}
    assert records[-2]["val_loss_T3"] > math.log(320) + 1
    calm = train(corpus, "--run=hot", "--eval_every=2")  # the recipe's rate: evals below ln 320, no stop
    assert "diverged" not in calm.stdout
    assert logged_steps(corpus / "base" / "runs" / "hot") == list(range(1, 9))


def test_a_run_at_its_initial_weights_is_not_declared_diverged_by_an_eval_at_a_uniform_guess(corpus):
    """A 4-step concat run that barely moves its initial weights (a rate of 1e-9) scores about ln 320 at its step-2
    eval, a little above: it has not learned yet, so it has nothing to have lost, and it ends with its checkpoint."""
    result = train(corpus, "--run=initial", "--injection=concat", "--max_tokens=1024", "--adamw_lr=1e-9",
                   "--muon_lr=1e-9", "--eval_every=2")
    assert "diverged" not in result.stdout
    records = [json.loads(line) for line in (corpus / "base" / "runs" / "initial" / "metrics.jsonl").open()]
    first_eval = next(r for r in records if "val_loss_T3" in r)
    assert first_eval["step"] == 2 and math.log(320) <= first_eval["val_loss_T3"] < math.log(320) + 1
    assert (corpus / "base" / "runs" / "initial" / "ckpt_000004.pt").is_file()


@pytest.mark.parametrize("flags,message", [
    (["--depth=4"], "multiple of 3"),
    (["--total_batch_size=300"], "not divisible by device_batch_size"),
    (["--data=/nonexistent/corpus/*.txt"], "no .txt, .jsonl or .parquet files match"),
    (["--mu_rec=0"], "error: mu_rec=0 must be at least 1"),
])
def test_bad_input_ends_with_one_clear_line(corpus, flags, message):
    env = {**os.environ, "NANOPARCAE_BASE_DIR": str(corpus / "base")}
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, f"--data={corpus / 'corpus.txt'}",
                             *flags], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_resume_without_a_checkpoint_ends_in_one_line_before_any_work(corpus, tmp_path):
    env = {**os.environ, "NANOPARCAE_BASE_DIR": str(tmp_path / "base")}
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, f"--data={corpus / 'corpus.txt'}",
                             "--run=never", "--resume"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"no checkpoint of run never under {tmp_path / 'base' / 'runs' / 'never'}" in result.stderr
    assert "start it without --resume" in result.stderr
    assert list((tmp_path / "base").iterdir()) == []  # no tokenizer trained, no run folder made


def test_dry_run_prints_the_paper_size(tmp_path):
    env = {**os.environ, "NANOPARCAE_BASE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--depth=24", "--mu_rec=8", "--dry_run"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert "parameters: 1,338,591,744" in result.stdout and "tokens: 103,999," in result.stdout
    assert "memory per GPU (GB): weights 5.4 + grads 5.4 + DDP buckets 5.4 + optimizer 8.0" in result.stdout
    fits = re.search(r"largest device batch: (\d+) in 80 GB, (\d+) in 141 GB", result.stdout)
    assert fits and 0 < int(fits[1]) < int(fits[2])


def test_eval_core_bpb_gives_train_pys_last_eval(corpus, one):
    """README's L(T) command on a run's checkpoint, with train.py's eval tokens and device batch: its losses at the
    depths train.py evaluates are the last `eval |` line's, in the JSON it writes beside the checkpoint."""
    run_dir = corpus / "base" / "runs" / "one"
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    last_eval = [r for r in records if "val_loss_T1" in r][-1]
    result = subprocess.run([sys.executable, str(ROOT / "eval_core.py"), "--eval", "bpb", "--T", "1,2,4,8",
                             "--val_tokens", "256", "--batch_size", "4", "--run=one"],  # TINY's eval_tokens, batch
                            capture_output=True, text=True, env=train_env(corpus), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads((run_dir / "ckpt_000008_bpb_T1-2-4-8.json").read_text())
    assert out["T"] == [1, 2, 3, 4, 8]  # mu_rec 3 added: the fit's L_inf is held against the loss there
    trained = {T: loss for T, loss in zip(out["T"], out["loss"]) if f"val_loss_T{T}" in last_eval}
    assert list(trained) == [1, 2, 3, 4]  # train.py evaluates T = 1, 2, 4 and mu_rec
    assert trained == pytest.approx({T: last_eval[f"val_loss_T{T}"] for T in trained}, rel=1e-6)


def test_authors_per_batch_sampling_trains_and_per_document_ppl_runs(corpus):
    train(corpus, "--run=per_batch", "--sampling=per_batch", "--max_tokens=512")
    env = {**os.environ, "NANOPARCAE_BASE_DIR": str(corpus / "base"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "eval_core.py"), "--eval=ppl", "--T=1,3", "--max_docs=20",
                             "--run=per_batch"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(next((corpus / "base" / "runs" / "per_batch").glob("*_ppl_T1-3.json")).read_text())
    assert out["T"] == [1, 3] and all(1 < ppl < 320 for ppl in out["ppl"])  # better than uniform over the vocab
    assert "one per forward" in result.stdout and "ppl" in result.stdout


def test_faults_come_from_the_environment_and_help_lists_only_what_a_user_sets(tmp_path):
    env = {**os.environ, "NANOPARCAE_BASE_DIR": str(tmp_path), "NANOPARCAE_FAULT": "nan_step=2,kill=3"}
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--dry_run"], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "NANOPARCAE_FAULT: 'kill=3' is not one of" in result.stderr
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--help"], capture_output=True, text=True,
                            timeout=120, env={**env, "NANOPARCAE_FAULT": ""})
    assert result.returncode == 0 and "--mu_rec" in result.stdout and "--fault" not in result.stdout
