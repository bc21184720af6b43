"""Tests for train.py, run as users run it (processes of their own, forked as conftest.Started says, and one in a fresh
interpreter to show that forking changes nothing): exact resume, also from a moved base folder, the same command again
after a kill, a run's identity (other run-defining flags are refused, nothing written), two processes and two "nodes"
against one, an elastic restart after a killed rank, the non-finite-gradient skip, the divergence rule, README's L(T)
command against the run's own last eval, CORE's bundle fetched once before step 1; in-process, where no training is
needed: one-line errors for every bad flag value, --dry_run and --help. Faults come from tests/faulty_train.py."""

import json
import math
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import sample
from nanoparcae import command
from nanoparcae.checkpoint import save_checkpoint
from nanoparcae.dataset import list_chunks
from nanoparcae.divergence import Divergence
from conftest import (ROOT, TINY, Started, carries, corrupt_a_weight, python, refused, train, train_command,
                      train_env, untouched, write_corpus)
from model import Parcae, ParcaeConfig

# a concat run that barely moves its initial weights: it never learns
UNLEARNED = ["--injection=concat", "--max_tokens=1024", "--adamw_lr=1e-9", "--muon_lr=1e-9", "--eval_every=2"]
# The runs that later tests read, each started as its test would start it: run -> (flags, train's options). They
# train on a thread of their own beside the runs the first tests make and wait for: each process is one thread
# (OMP_NUM_THREADS=1) and the suite has two cores.
BESIDE = {
    "halves": (["--stop_at=2"], {}),
    "changed": (["--data={corpus}/changed.txt", "--stop_at=2"], {}),  # a copy of the corpus, which its test changes
    "bf16": (["--dtype=bfloat16"], {}),
    "nan": ([], dict(fault="nan_step=2")),
    # the gradients of steps 3, 4 and 5 are poisoned (the fault counts steps from 0): three bad steps in a row
    "diverged": (["--save_every=2", "--diverge_steps=3"], dict(fault="nan_step=2,nan_steps=3", expect_ok=False)),
    "exploded": (["--diverge_h_norm=1e-3", "--diverge_steps=2"], dict(expect_ok=False)),
    "hot": (["--adamw_lr=3", "--muon_lr=3", "--eval_every=2"], {}),
    "initial": ([*UNLEARNED, "--stop_at=2"], {}),
    "per_batch": (["--depth_sampling=per_batch", "--max_tokens=512"], {}),
}


@pytest.fixture(scope="module")
def beside(corpus):
    """run -> the future of BESIDE's train.py of that run (its finished subprocess), all started at once, one at a
    time on a thread of their own."""
    (corpus / "changed.txt").write_text((corpus / "corpus.txt").read_text())
    with ThreadPoolExecutor(1) as pool:
        futures = {run: pool.submit(train, corpus, f"--run={run}", *(flag.format(corpus=corpus) for flag in flags),
                                    **options) for run, (flags, options) in BESIDE.items()}
        yield futures
        for future in futures.values():
            future.cancel()  # not started: no test that ran reads it


@pytest.fixture(scope="module")
def one(corpus, beside):
    """One process, 2 micro-batches of 4 per step: the reference the multi-process and resumed runs must equal.
    (beside first: its runs train while this one does.)"""
    train(corpus, "--run=one")
    return step_losses(corpus, "one")


@pytest.fixture(scope="module")
def chunked(corpus):
    """--data= a folder of the corpus's paragraphs, one file each: chunks of FILES_PER_CHUNK files, so that
    ranks reading the chunks in different orders read different documents."""
    folder = corpus / "chunked"
    folder.mkdir()
    for i, paragraph in enumerate((corpus / "corpus.txt").read_text().split("\n\n")):
        (folder / f"{i:03d}.txt").write_text(paragraph)
    assert len(list_chunks(str(folder), "train")) > 1
    return f"--data={folder}"


@pytest.fixture(scope="module")
def one_chunked(corpus, chunked):
    """`one` on the chunked corpus."""
    train(corpus, "--run=one_chunked", chunked)
    return step_losses(corpus, "one_chunked")


@pytest.fixture(scope="module")
def two(corpus, chunked):
    """Two processes on this node, 1 micro-batch of 4 each, on the chunked corpus; DDP set up without its deprecated
    arguments -> the losses, and the collectives rank 0 made before step 1."""
    result = train(corpus, "--run=two", chunked, nproc=2, fault="collectives=1")
    assert "Warning" not in result.stderr, result.stderr[-3000:]
    return step_losses(corpus, "two"), re.search(r"collectives before step 1: (\d+) \((.*)\)", result.stdout)


@pytest.fixture(scope="module")
def first_two(corpus, beside):
    """Run `halves` stopped after step 2 -> the weights of its step-2 checkpoint, read before anything continues it."""
    beside["halves"].result()
    return torch.load(corpus / "base" / "runs" / "halves" / "ckpt_000002.pt", weights_only=True)["model"]


def final_weights(corpus, run):
    path = corpus / "base" / "runs" / run / "ckpt_000008.pt"
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def step_losses(corpus, run, base=None, whole_lines=False):
    """{step: loss} of a run's metrics.jsonl; whole_lines: a last line that a kill cut short is left out."""
    text = ((base or corpus / "base") / "runs" / run / "metrics.jsonl").read_text()
    lines = text.splitlines()[:None if text.endswith("\n") or not whole_lines else -1]
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


@pytest.mark.slow
def test_resumed_run_gives_exactly_the_losses_of_an_uninterrupted_run(corpus, one, first_two):
    """Stopped after step 2, the run is refused under another --d_model and --mu_rec (one line naming both, its
    files untouched); then continued from a copy of the base folder elsewhere (the tokenizer and the corpus are
    keyed by content, not by where they lie), with a changed --save_every, which the log names: its losses are the
    uninterrupted run's, bit for bit."""
    run_dir = corpus / "base" / "runs" / "halves"
    assert list(step_losses(corpus, "halves")) == [1, 2]
    before = untouched(run_dir)
    moved = corpus / "moved"
    for part in ("tokenizers", "runs/halves"):  # the base folder's, less the runs other tests are writing
        shutil.copytree(corpus / "base" / part, moved / part)
    with ThreadPoolExecutor(1) as pool:  # the refusal reads the run, the continuation its copy: one thread each
        refusal = pool.submit(train, corpus, "--run=halves", "--resume", "--d_model=96", "--mu_rec=4", expect_ok=False)
        resumed = train(corpus, "--run=halves", "--resume", "--save_every=500", base=moved)
    message = refused(refusal.result())
    assert carries(message, "halves", str(run_dir / "ckpt_000002.pt")), message
    assert carries(message, "d_model", "64", "96", "mu_rec", "3", "4") and carries(message, "--run"), message
    assert untouched(run_dir) == before
    assert carries(resumed.stdout, "resumed", "halves", "2", str(moved / "runs" / "halves" / "ckpt_000002.pt")), \
        resumed.stdout
    assert carries(resumed.stdout, "--save_every", "1000", "500"), resumed.stdout
    halves = step_losses(corpus, "halves", base=moved)
    assert list(one) == list(range(1, 9))
    assert halves == one  # bit for bit
    assert one[8] < one[1]


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


@pytest.mark.slow
def test_the_same_command_after_a_kill_continues_from_the_checkpoint_and_a_finished_run_stays_done(corpus):
    """Killed from outside once it has logged steps past a checkpoint, the run refuses another --seed (its files
    untouched), and the same command again continues from that checkpoint: it is kept until the next save, each step
    is logged once and in order, and the steps done twice have the losses the killed run logged, bit for bit. The
    same command once more says the run is done and changes nothing; another --mu_rec is refused, not "done"."""
    flags, run_dir = ["--max_tokens=10240", "--save_every=5"], corpus / "base" / "runs" / "rerun"  # 40 steps
    killed = Started(train_command(corpus, "--run=rerun", *flags), train_env(corpus))
    deadline = time.time() + 300
    while killed.poll() is None and time.time() < deadline:
        killed.send_signal(signal.SIGSTOP)  # paused, its files hold still while they are read
        saved = [int(path.stem[5:]) for path in run_dir.glob("ckpt_*.pt")]
        if saved and max(logged_steps(run_dir), default=0) > max(saved):  # logged past its checkpoint
            killed.kill()
            break
        killed.send_signal(signal.SIGCONT)
        time.sleep(0.01)
    killed.communicate()
    assert killed.returncode == -9, "the run ended before it could be killed past a checkpoint"
    kept, before = max(run_dir.glob("ckpt_*.pt")), step_losses(corpus, "rerun", whole_lines=True)
    at = int(kept.stem[5:])
    assert 0 < at < max(before) < 40
    files = untouched(run_dir)
    message = refused(train(corpus, "--run=rerun", *flags, "--seed=1", expect_ok=False))
    assert carries(message, "seed", "0", "1") and carries(message, "--run"), message
    assert untouched(run_dir) == files
    again = train(corpus, "--run=rerun", *flags)
    assert carries(again.stdout, "resumed", "rerun", str(at), str(kept), "--run"), again.stdout
    assert re.findall(r"saved .*ckpt_(\d+)\.pt", again.stdout)[0] == f"{at + 5:06d}"  # not step 5 of a restart
    assert logged_steps(run_dir) == list(range(1, 41))
    after = step_losses(corpus, "rerun")
    assert {step: after[step] for step in before} == before  # steps at..max(before) done again, the same
    files = untouched(run_dir)
    done = train(corpus, "--run=rerun", *flags)
    assert carries(done.stdout, "rerun", "done", str(run_dir / "ckpt_000040.pt"), "40"), done.stdout
    message = refused(train(corpus, "--run=rerun", *flags, "--mu_rec=8", expect_ok=False))
    assert carries(message, "mu_rec", "3", "8", "mu_bwd", "2", "4"), message
    assert untouched(run_dir) == files


@pytest.mark.slow
def test_a_run_whose_files_changed_is_not_continued_on_them(corpus, beside):
    beside["changed"].result()  # stopped after step 2
    changed = corpus / "changed.txt"
    changed.write_text(changed.read_text() + "\n\nthe loop learns a stable state.")
    message = refused(train(corpus, "--run=changed", f"--data={changed}", expect_ok=False))
    keys = re.findall(r"files-\w+", message)  # the content keys of the corpus then and now
    assert carries(message, "data", keys[0], keys[1]) and keys[0] != keys[1] and carries(message, "--data"), message
    assert logged_steps(corpus / "base" / "runs" / "changed") == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "damaged", "step"])
def test_a_damaged_newest_checkpoint_is_named_and_left_as_it_is(corpus, tmp_path, first_two, damage):
    """A truncated checkpoint, one with a byte changed amid its weights, or its step edited after saving (2 -> 18):
    one line naming the file, what is wrong, what to do; the folder stays as it was."""
    run_dir = tmp_path / "base" / "runs" / "damaged"
    run_dir.mkdir(parents=True)
    whole = (corpus / "base" / "runs" / "halves" / "ckpt_000002.pt").read_bytes()
    (run_dir / "ckpt_000002.pt").write_bytes(whole[:len(whole) // 2] if damage == "truncated" else whole)
    if damage == "damaged":
        corrupt_a_weight(run_dir / "ckpt_000002.pt")
    if damage == "step":
        ckpt = torch.load(run_dir / "ckpt_000002.pt", weights_only=True)
        torch.save({**ckpt, "step": 18}, run_dir / "ckpt_000002.pt")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    files = untouched(run_dir)
    message = refused(train(corpus, "--run=damaged", base=tmp_path / "base", expect_ok=False))
    named = {"step": ["damaged", "step"]}.get(damage, [damage])
    assert carries(message, str(run_dir / "ckpt_000002.pt"), *named, "remove", "restore"), message
    assert untouched(run_dir) == files


@pytest.mark.slow
def test_a_run_whose_tokenizer_was_replaced_is_not_resumed(corpus, tmp_path, first_two):
    """Another tokenizer of the same size in the run's tokenizer folder: one line naming the folder and both
    digests, status 2; the run's folder stays as it was."""
    from nanoparcae.tokenizer import Tokenizer
    base = tmp_path / "base"
    shutil.copytree(corpus / "base" / "runs" / "halves", base / "runs" / "halves")
    recorded = Path(torch.load(base / "runs" / "halves" / "ckpt_000002.pt", weights_only=True)["tokenizer_dir"])
    tokenizer_dir = shutil.copytree(recorded, base / "tokenizers" / recorded.name)
    trained_with = Tokenizer.files_digest(tokenizer_dir)
    Tokenizer.train(iter(["another corpus altogether, another merge order"] * 40), vocab_size=320).save(tokenizer_dir)
    files = untouched(base / "runs" / "halves")
    message = refused(train(corpus, "--run=halves", base=base, expect_ok=False))
    assert carries(message, str(tokenizer_dir), Tokenizer.files_digest(tokenizer_dir), trained_with), message
    assert untouched(base / "runs" / "halves") == files


@pytest.mark.slow
def test_a_command_forked_from_the_suites_torch_is_the_command_in_a_fresh_interpreter(corpus, one):
    """The suite starts its commands as forks of a process that imported torch already (conftest.Started): the same
    command in a fresh interpreter logs the same records and ends with the same weights, bit for bit."""
    fresh = subprocess.run([sys.executable, *train_command(corpus, "--run=fresh")], capture_output=True, text=True,
                           env=train_env(corpus), timeout=300)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    records = {run: [{key: value for key, value in json.loads(line).items() if key != "tokens_per_s"}
                     for line in (corpus / "base" / "runs" / run / "metrics.jsonl").read_text().splitlines()]
               for run in ("one", "fresh")}
    assert records["fresh"] == records["one"] and len(records["one"]) == 9  # 8 steps and the final eval
    reference, weights = final_weights(corpus, "one"), final_weights(corpus, "fresh")
    assert weights.keys() == reference.keys() and all(torch.equal(weights[name], reference[name]) for name in weights)


@pytest.mark.slow
def test_two_processes_give_the_losses_of_one_and_agree_once_before_step_1(one_chunked, two):
    """The ranks meet before step 1 to start (the process group and the long-timeout group), to wait for rank 0's
    tokenizer, in the one gather of what they found, for the lock's outcome, and in DDP's broadcast."""
    two, collectives = two
    assert list(one_chunked) == list(two) == list(range(1, 9))
    for step in one_chunked:
        assert two[step] == pytest.approx(one_chunked[step], rel=1e-4), step
    assert collectives[2] == "init_process_group, new_group, barrier, all_gather_object, all_gather_object, DDP", \
        collectives[0]


@pytest.mark.slow
def test_two_nodes_give_the_losses_and_weights_of_one_process(corpus, one):
    # two torchrun launches, one process each, meeting at a c10d rendezvous as two machines would
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = ["--nnodes=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=test"]
    nodes = [Started(train_command(corpus, "--run=nodes", nproc=1, torchrun=torchrun), train_env(corpus))
             for _ in range(2)]
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


@pytest.mark.slow
def test_a_killed_rank_is_restarted_and_the_run_ends_with_the_weights_of_an_unbroken_run(corpus, chunked, two):
    # the last rank SIGKILLs itself after step 6; torchrun restarts both workers, which resume from the
    # step-4 checkpoint and recompute steps 5 and 6 exactly. Its TORCH_ variable makes its launcher and workers fresh
    # interpreters: the weights of `two`, whose workers are forks (conftest._fork_workers), are theirs bit for bit.
    launch = dict(nproc=2, torchrun=("--standalone", "--max_restarts=1"))
    with ThreadPoolExecutor(1) as pool:  # two jobs that share nothing, side by side
        sharing = pool.submit(train, corpus, "--run=shared_store", **launch, fault="kill_step=1", expect_ok=False)
        result = train(corpus, "--run=elastic", chunked, "--save_every=4", **launch, fault="kill_step=6",
                       env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    shared = sharing.result()
    assert shared.returncode != 0 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared.stderr  # a clear line
    assert carries(result.stdout, "resumed", "elastic", "4", "restart", "1"), result.stdout
    reference, weights = final_weights(corpus, "two"), final_weights(corpus, "elastic")
    assert reference.keys() == weights.keys()
    for name in reference:
        assert torch.equal(weights[name], reference[name]), name  # bit for bit


@pytest.fixture(scope="module")
def finished(corpus):
    """A run of 2 steps, trained to its end by one process -> its flags."""
    flags = ["--run=finished", "--max_tokens=512"]
    train(corpus, *flags)
    return flags


EARLY_EXITS = {  # train.py's exits before training -> (flags added to the finished run's, each rank's status)
    "bad flag": (["--depth=0"], 2), "dry run": (["--dry_run"], 0), "refusal": (["--seed=1"], 2),
    "finished run": ([], 0),
}


@pytest.mark.slow
@pytest.mark.parametrize("early_exit", list(EARLY_EXITS))
def test_every_rank_ends_alike_at_each_exit_before_training(corpus, finished, early_exit):
    """Two gloo processes under torchrun: each exit before training ends both ranks with its status, with no
    abort and no traceback of train.py's. A refusal is one line, said once by local rank 0, which exits first:
    torchrun reports its status as the root cause, and stops the other rank (SIGTERM) if it is still there."""
    flags, status = EARLY_EXITS[early_exit]
    result = train(corpus, *finished, *flags, nproc=2, expect_ok=False)
    assert "terminate called" not in result.stderr and 'train.py", line' not in result.stderr, result.stderr[-3000:]
    if status == 0:
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    else:
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", result.stderr)  # each rank's, the root cause's last
        assert codes[-1] == str(status) and set(codes) <= {str(status), "-15"}, result.stderr[-3000:]
        assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1


@pytest.mark.slow
def test_bf16_autocast_on_a_cpu_tracks_float32(corpus, one, beside):
    # --dtype=bfloat16 runs the GPU's autocast on a CPU; after 8 steps the losses differ by ~0.2% here
    result = beside["bf16"].result()
    assert "Mismatch dtype" not in result.stderr  # every RMSNorm took its fused path
    bf16 = step_losses(corpus, "bf16")
    assert list(bf16) == list(one) and bf16 != one
    for step in one:
        assert bf16[step] == pytest.approx(one[step], rel=1e-2), step
    evals = {run: [json.loads(line) for line in (corpus / "base" / "runs" / run / "metrics.jsonl").open()
                   if "val_loss_T1" in line][-1] for run in ("one", "bf16")}
    assert evals["bf16"]["val_loss_T3"] == pytest.approx(evals["one"]["val_loss_T3"], rel=1e-2)


@pytest.mark.slow
def test_non_finite_gradients_are_skipped_and_the_run_goes_on(corpus, beside):
    result = beside["nan"].result()  # step 3's gradients poisoned
    assert carries(result.stdout, "non-finite", "skipped", "1"), result.stdout
    records = [json.loads(line) for line in (corpus / "base" / "runs" / "nan" / "metrics.jsonl").open()]
    steps = [r for r in records if "loss" in r]
    assert steps[-1]["step"] == 8 and steps[-1]["skipped_steps"] == 1
    assert all(r["loss"] == r["loss"] for r in steps)  # no NaN reached the weights
    assert [r for r in records if "val_loss_T1" in r][-1]["val_loss_T1"] < 100


@pytest.mark.slow
def test_a_run_non_finite_for_k_steps_is_declared_diverged_and_keeps_its_last_good_checkpoint(corpus, first_two,
                                                                                                beside):
    result = beside["diverged"].result()  # steps 3 to 5 poisoned, 3 allowed
    assert result.returncode == 3, result.stderr[-3000:]
    run_dir = corpus / "base" / "runs" / "diverged"
    assert carries(result.stdout, "diverged", "3", "non-finite", "5", str(run_dir / "ckpt_000002.pt")), result.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert records[-1] == {"step": 5, "diverged_at": 3, "reason": "non-finite loss or gradients"}
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]
    # step 4's checkpoint waited for a good step that never came: step 2's stays, the state before the streak
    assert [path.name for path in run_dir.glob("ckpt_*.pt")] == ["ckpt_000002.pt"]
    kept = torch.load(run_dir / "ckpt_000002.pt", weights_only=True)["model"]
    assert kept.keys() == first_two.keys()
    for name in first_two:
        assert torch.equal(kept[name], first_two[name]), name


@pytest.mark.slow
def test_a_state_past_the_bound_for_k_steps_is_declared_diverged(corpus, beside):
    result = beside["exploded"].result()  # a bound of 1e-3 on ||h_T||, 2 steps allowed
    assert result.returncode == 3
    assert carries(result.stdout, "diverged", "1", "||h_T||", "0.001", "2"), result.stdout
    assert not any((corpus / "base" / "runs" / "exploded").glob("ckpt_*.pt"))


def eval_core(corpus, *flags):
    """eval_core.py with these flags on the module's base folder -> the finished subprocess, status 0 asserted."""
    result = python(["eval_core.py", *flags], train_env(corpus))
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def evals(corpus, one, beside):
    """The futures of the last tests' eval_core.py commands (README's L(T) on run one, per-document ppl on run
    per_batch), started when the first test that takes this starts: one at a time on a thread of their own, beside
    that test's commands."""
    def per_document_ppl():
        beside["per_batch"].result()
        return eval_core(corpus, "--eval=ppl", "--T=1,3", "--max_docs=20", "--run=per_batch")

    with ThreadPoolExecutor(1) as pool:  # TINY's eval_tokens and device batch
        yield {"bpb": pool.submit(eval_core, corpus, "--eval", "bpb", "--T", "1,2,4,8", "--val_tokens", "256",
                                  "--batch_size", "4", "--run=one"),
               "ppl": pool.submit(per_document_ppl)}


@pytest.mark.slow
def test_a_run_that_never_learned_is_not_stopped_by_its_val_loss_and_another_rate_is_another_run(corpus, beside,
                                                                                                 evals):
    """At a rate of 3 every eval is far above ln 320, from the first (step 2): the run never learned, so it has
    nothing to have lost and trains to its end. The same --run at the recipe's rates is refused, naming both."""
    result = beside["hot"].result()
    assert "diverged" not in result.stdout
    records = [json.loads(line) for line in (corpus / "base" / "runs" / "hot" / "metrics.jsonl").open()]
    evals = [r for r in records if "val_loss_T3" in r]
    assert [r["step"] for r in evals] == [2, 4, 6, 8] and all(r["val_loss_T3"] > math.log(320) + 1 for r in evals)
    assert (corpus / "base" / "runs" / "hot" / "ckpt_000008.pt").is_file()
    message = refused(train(corpus, "--run=hot", "--eval_every=2", expect_ok=False))
    assert carries(message, "adamw_lr", "3.0", "0.008", "muon_lr", "3.0", "0.008"), message


@pytest.mark.slow
def test_an_eval_back_at_a_uniform_guess_stops_a_run_that_had_learned_also_across_a_resume(corpus, beside):
    """A 4-step concat run that barely moves its initial weights (a rate of 1e-9) scores about ln 320 at its step-2
    eval, a little above: it has not learned yet, so it has nothing to have lost, and it ends with its checkpoint.
    The same step-2 checkpoint recording a lowest val loss 2 nats below ln 320 (a run that had learned), continued:
    its step-4 eval, back at ln 320, stops it, so the lowest val loss came through the resume."""
    beside["initial"].result()  # UNLEARNED, stopped after step 2
    learned = corpus / "base" / "runs" / "learned"
    learned.mkdir()
    ckpt = torch.load(corpus / "base" / "runs" / "initial" / "ckpt_000002.pt", weights_only=True)
    ckpt["lowest_val_loss"] = math.log(320) - 2
    from nanoparcae.checkpoint import digest_of
    torch.save({**ckpt, "digest": digest_of(ckpt)}, learned / "ckpt_000002.pt")  # signed, as train.py saves it
    with ThreadPoolExecutor(1) as pool:  # two runs that share nothing from here: one thread each
        losing = pool.submit(train, corpus, "--run=learned", *UNLEARNED, expect_ok=False)
        result = train(corpus, "--run=initial", *UNLEARNED)
    assert "diverged" not in result.stdout
    records = [json.loads(line) for line in (corpus / "base" / "runs" / "initial" / "metrics.jsonl").open()]
    first_eval = next(r for r in records if "val_loss_T3" in r)
    assert first_eval["step"] == 2 and math.log(320) <= first_eval["val_loss_T3"] < math.log(320) + 1
    assert (corpus / "base" / "runs" / "initial" / "ckpt_000004.pt").is_file()
    lost = losing.result()
    assert lost.returncode == 3, lost.stderr[-3000:]
    assert carries(lost.stdout, "diverged", "4", f"{math.log(320) - 2:.4f}"), lost.stdout
    assert json.loads((learned / "metrics.jsonl").read_text().splitlines()[-1]) == \
        {"step": 4, "diverged_at": 4, "reason": "val loss back above a uniform guess"}


def test_the_divergence_rule_step_by_step():
    """divergence.Divergence as train.py calls it after every step."""
    uniform = math.log(320)
    rule = Divergence(320, "float32", patience=3)
    assert rule.check(1, True, 5.0, uniform + 30) is None  # far above, but it never learned
    assert rule.check(2, True, 5.0, uniform - 0.5) is None  # not a margin below: not learned yet
    assert rule.check(3, True, 5.0, uniform + 0.1) is None
    assert rule.check(4, True, 5.0, uniform - 1.5) is None and rule.lowest_val_loss == uniform - 1.5  # learned
    assert rule.check(5, True, 5.0, uniform - 0.1) is None  # worse, still below ln V
    stopped = rule.check(6, True, 5.0, uniform)
    assert stopped.keys() == {"diverged_at", "reason", "detail"} and stopped["diverged_at"] == 6
    assert stopped["reason"] == "val loss back above a uniform guess"  # the record's key for this rule
    assert carries(stopped["detail"], f"{uniform:.4f}", "320", f"{uniform - 1.5:.4f}"), stopped  # loss, V, lowest
    resumed = Divergence(320, "float32", patience=3, lowest_val_loss=rule.lowest_val_loss)
    assert resumed.check(8, True, None, uniform + 0.2)["reason"] == "val loss back above a uniform guess"
    assert Divergence(320, "float32", 3).check(2, True, None, math.nan)["reason"] == "non-finite val loss"
    assert Divergence(320, "float32", 0, lowest_val_loss=0.0).check(2, False, None, math.nan) is None  # switched off
    streak = Divergence(320, "float32", patience=3)
    assert [streak.check(step, step == 3, None) for step in (1, 2, 3, 4, 5)] == [None] * 5  # step 3 breaks it
    stopped = streak.check(6, False, None)
    assert stopped.keys() == {"diverged_at", "reason", "detail"} and stopped["diverged_at"] == 4
    assert stopped["reason"] == "non-finite loss or gradients" and carries(stopped["detail"], "3", "6"), stopped
    assert streak.bad_steps == 3
    bf16 = Divergence(320, "bfloat16", patience=2)  # past 1e4 bf16 loses the input: bad steps
    assert bf16.check(1, True, 2e4) is None and bf16.check(2, True, 2e4)["reason"] == "||h_T|| > 10000"
    fp32 = Divergence(320, "float32", patience=2)  # float32 resolves 2^16 times finer: a warning, once, past that
    assert [fp32.check(step, True, 2e4) for step in (1, 2)] == [None, None]
    assert fp32.check(3, True, 1e9) == {"warning": "h_norm", "h_norm": 1e9, "limit": 1e4 * 2 ** 16}
    assert fp32.check(4, True, 1e9) is None and fp32.check(5, True, 1e9) is None
    given = Divergence(320, "float32", patience=1, h_norm_limit=50.0)  # a limit given stops in any dtype
    assert given.check(1, True, 51.0)["reason"] == "||h_T|| > 50"


def test_initial_weights_are_not_stopped_by_their_val_loss_for_any_injection_or_vocabulary():
    """Each injection at two widths and three vocabularies, at its initial weights, on random tokens: the
    divergence rule lets its eval pass. Parcae's and the baselines' loops score about ln V + 0.2; the Transformer's
    tied head predicts the current token at init, far above ln V once it is wide, which is why the rule does not
    judge a run that has not learned."""
    torch.manual_seed(0)
    scores = {}
    for d_model, vocab_size in ((64, 320), (64, 4096), (64, 32768), (256, 320)):
        for injection in ("diagonal", "concat", "add", "none"):
            config = ParcaeConfig.from_depth(3, d_model=d_model, head_dim=32, vocab_size=vocab_size, seq_len=64,
                                             mu_rec=4, injection=injection)
            tokens = torch.randint(vocab_size, (4, 65))
            with torch.no_grad():
                loss = Parcae(config).eval()(tokens[:, :-1], tokens[:, 1:]).item()
            scores[injection, d_model, vocab_size] = loss - math.log(vocab_size)
            assert Divergence(vocab_size, "float32", 5).check(2, True, None, loss) is None
    looped = [excess for (injection, *_), excess in scores.items() if injection != "none"]
    assert all(0 < excess < 0.5 for excess in looped), scores
    assert scores["none", 256, 320] > 1, scores


@pytest.mark.slow
def test_eval_core_bpb_gives_train_pys_last_eval(corpus, one, evals):
    """README's L(T) command on a run's checkpoint, with train.py's eval tokens and device batch: its losses at the
    depths train.py evaluates are the last `eval |` line's, in the JSON it writes beside the checkpoint."""
    run_dir = corpus / "base" / "runs" / "one"
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    last_eval = [r for r in records if "val_loss_T1" in r][-1]
    evals["bpb"].result()  # status 0 asserted
    out = json.loads((run_dir / "ckpt_000008_bpb_T1-2-4-8.json").read_text())
    assert out["T"] == [1, 2, 3, 4, 8]  # mu_rec 3 added: the fit's L_inf is held against the loss there
    trained = {T: loss for T, loss in zip(out["T"], out["loss"]) if f"val_loss_T{T}" in last_eval}
    assert list(trained) == [1, 2, 3, 4]  # train.py evaluates T = 1, 2, 4 and mu_rec
    assert trained == pytest.approx({T: last_eval[f"val_loss_T{T}"] for T in trained}, rel=1e-6)


@pytest.mark.slow
def test_authors_per_batch_sampling_trains_and_per_document_ppl_runs(corpus, beside, evals):
    beside["per_batch"].result()
    result = evals["ppl"].result()  # status 0 asserted
    out = json.loads(next((corpus / "base" / "runs" / "per_batch").glob("*_ppl_T1-3.json")).read_text())
    assert out["T"] == [1, 3] and all(1 < ppl < 320 for ppl in out["ppl"])  # better than uniform over the vocab
    assert "one per forward" in result.stdout and "ppl" in result.stdout


# -----------------------------------------------------------------------------
# In-process: what train.py does before it trains anything


def run_train(monkeypatch, capsys, *flags):
    """train.py run in this process with these flags (it must exit before training) -> (status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "train.py"), *flags])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


BAD_VALUES = {  # flag -> values train.py refuses before any work, each in one line naming the flag
    **{flag: ["0", "-1"] for flag in ("depth", "d_model", "head_dim", "mu_rec", "mu_bwd", "vocab_size", "seq_len",
                                     "device_batch_size", "total_batch_size", "eval_every", "eval_tokens",
                                     "save_every", "log_every", "rho_every", "stop_at")},
    **{flag: ["0", "-1", "nan", "inf"] for flag in ("max_tokens", "param_data_ratio", "target_flops", "adamw_lr",
                                                   "muon_lr", "grad_clip", "diverge_h_norm")},
    "weight_decay": ["-0.1", "nan"], "diverge_steps": ["-1"], "seed": ["-1"], "warmdown_frac": ["-0.5", "1.5"],
    "device": ["gpu"] + ([] if torch.cuda.is_available() else ["cuda"]),
    "injection": ["loop"], "data": ["/nonexistent/corpus/*.txt"],
}


@pytest.mark.parametrize("flag", list(BAD_VALUES))
def test_every_bad_flag_value_ends_in_one_line_naming_it_and_writes_nothing(flag, tmp_path, monkeypatch, capsys):
    base = tmp_path / "base"
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(base))
    for value in BAD_VALUES[flag]:
        status, _, err = run_train(monkeypatch, capsys, *TINY, f"--{flag}={value}")
        assert status == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (value, err)
        assert err.startswith("error: ") and f"--{flag}" in err, err
        assert not base.exists() or not any(base.rglob("*")), list(base.rglob("*"))


@pytest.mark.parametrize("name", ["../escape", "team/exp1", "", ".", "[a]", "-x", "x y", "x" * 300])
def test_a_run_name_that_is_not_one_safe_folder_name_is_refused_before_anything_is_made(name, tmp_path,
                                                                                      monkeypatch, capsys):
    base = tmp_path / "base"
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(base))
    status, _, err = run_train(monkeypatch, capsys, *TINY, "--data=stdlib", f"--run={name}")
    assert status == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert carries(err, "--run") and repr(name)[:100] in err, err  # a long name, at least its start
    assert not base.exists() or not any(base.rglob("*")), list(base.rglob("*"))


SAMPLE_BAD_VALUES = {  # sample.py's flags and values it refuses before loading anything
    "num_samples": ["0", "-1"], "max_new_tokens": ["0"], "T_max": ["0"], "temperature": ["-1", "nan"],
    "top_k": ["-1"], "exit_threshold": ["0", "-1"], "T": ["0", "-3", "deep"], "exit": ["never"], "temp": ["0.5"],
    "device": ["gpu"] + ([] if torch.cuda.is_available() else ["cuda"]),
}


def test_every_bad_sample_flag_value_ends_in_one_line_naming_it(tmp_path, monkeypatch, capsys):
    base = tmp_path / "base"
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(base))
    for flag, values in SAMPLE_BAD_VALUES.items():
        for value in values:
            with pytest.raises(SystemExit) as exit_info:
                command.run_command(sample.main, ["--prompt=hi", f"--{flag}={value}"])
            err = capsys.readouterr().err
            assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, (flag, value, err)
            assert err.startswith("error: ") and f"--{flag}" in err and "Traceback" not in err, err
    assert not base.exists() or not any(base.rglob("*"))


@pytest.mark.parametrize("flags,named", [  # the flags and values the line must name; test_errors.py has more
    (["--dev=cuda"], ["--dev=cuda"]),  # no prefix matching: not --device, not --device_batch_size
    (["--seq_len=0"], ["--seq_len", "0"]),
])
def test_bad_input_ends_with_one_clear_line(flags, named, monkeypatch, capsys):
    status, _, err = run_train(monkeypatch, capsys, *TINY, "--data=stdlib", *flags)
    assert status == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert carries(err, *named), err


def write_fineweb_shards(base, indices):
    """FineWeb-Edu's layout under `base`: each shard 1,200 documents of the tiny corpus's words, so that each of
    TINY's two loaders holds more than its 1,000-document buffer of two shards."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    (base / "fineweb-edu").mkdir(parents=True, exist_ok=True)
    paragraphs = write_corpus(base / "shard.txt").read_text().split("\n\n")
    for i in indices:
        documents = [f"{n}: {paragraphs[(i + n) % len(paragraphs)]}" for n in range(1200)]
        pq.write_table(pa.table({"text": documents}), base / "fineweb-edu" / f"shard_{i:05d}.parquet",
                       row_group_size=100)
    (base / "shard.txt").unlink()


@pytest.mark.slow
def test_a_fineweb_run_reads_its_shards_once_and_continues_only_on_the_same_ones(tmp_path):
    """A horizon beyond the training shards on disk (by the download's rule: 1e8 tokens read 4) is refused, naming
    the download, before the run folder exists; a run within them records its shards, and the same command with a
    shard added is refused naming both lists; with its shards back, it continues."""
    base = tmp_path / "base"
    write_fineweb_shards(base, [0, 1, 1822])
    fineweb = ["--data=fineweb-edu", "--run=fw", "--save_every=4"]
    message = refused(train(tmp_path, *fineweb, "--max_tokens=1e8", base=base, expect_ok=False))
    assert carries(message, "python -m nanoparcae.dataset download --tokens=100000000", "--max_tokens"), message
    assert not (base / "runs").exists()
    train(tmp_path, *fineweb, "--stop_at=4", base=base)
    assert torch.load(base / "runs" / "fw" / "ckpt_000004.pt", weights_only=True)["run"]["train_shards"] == "0-1"
    write_fineweb_shards(base, [2])
    before = untouched(base / "runs" / "fw")
    message = refused(train(tmp_path, *fineweb, base=base, expect_ok=False))
    assert carries(message, "train_shards", "0-1", "0-2"), message
    assert untouched(base / "runs" / "fw") == before
    (base / "fineweb-edu" / "shard_00002.parquet").unlink()
    assert "resumed fw at step 4" in train(tmp_path, *fineweb, base=base).stdout


@pytest.mark.slow
def test_a_corpus_read_more_than_once_logs_each_epoch(tmp_path):
    """120 documents , read ahead by the loaders' buffers and trained on for 12,288 tokens: each
    new epoch is said once, in order, from the second on."""
    (tmp_path / "corpus.txt").write_text("\n\n".join(write_corpus(tmp_path / "all.txt").read_text()
                                                      .split("\n\n")[:120]))
    result = train(tmp_path, "--run=epochs", "--max_tokens=12288", base=tmp_path / "base")
    said = [int(n) for n in re.findall(r"began reading epoch (\d+) of the data", result.stdout)]
    assert said == list(range(2, said[-1] + 1)) and len(said) > 1, said


@pytest.mark.slow
def test_a_refusal_only_one_rank_meets_stops_every_rank_in_one_line(tmp_path):
    """One validation document: rank 0's share has it, rank 1's is empty. Rank 1's refusal, which its own fail()
    would print nowhere (LOCAL_RANK 1), is the one line every rank stops with, printed once, before any run
    folder is made."""
    from nanoparcae.dataset import is_val_document
    words = write_corpus(tmp_path / "all.txt").read_text().split("\n\n")
    long_val = next(text for text in (" ".join(words[i:i + 10]) for i in range(300)) if is_val_document(text))
    (tmp_path / "corpus.txt").write_text("\n\n".join([w for w in words if not is_val_document(w)] + [long_val]))
    result = train(tmp_path, "--device_batch_size=1", "--collective_timeout=60", nproc=2, base=tmp_path / "base",
                   expect_ok=False)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and carries(lines[0], "rank", "1", "of", "2", "no documents", "val", "fewer ranks"), \
        result.stderr[-3000:]
    assert not (tmp_path / "base" / "runs").exists()


def test_a_command_refused_before_training_leaves_no_lock_in_the_run_folder(tmp_path, monkeypatch, capsys):
    """Refused for its data (bare `python train.py` without FineWeb-Edu's shards, an empty corpus), for other flags
    than its run's checkpoint, or for a --resume with nothing to resume: one line, status 2, and no `lock` file in
    any run folder: the run's lock is taken after every check that can refuse the command."""
    base = tmp_path / "base"
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(base))
    (tmp_path / "empty.txt").write_text("")
    (base / "runs" / "other").mkdir(parents=True)  # a checkpoint that records none of this command's run flags
    tiny = ParcaeConfig(vocab_size=64, seq_len=8, n_prelude=1, n_recur=1, n_coda=1, d_model=32, head_dim=32)
    save_checkpoint(base / "runs" / "other" / "ckpt_000001.pt", Parcae(tiny), step=1, run={})
    commands = {"no shards": [], "empty corpus": [*TINY, f"--data={tmp_path / 'empty.txt'}", "--run=empty"],
                "other flags": [*TINY, "--data=stdlib", "--run=other"],
                "nothing to resume": [*TINY, "--data=stdlib", "--run=never", "--resume"]}
    for why, flags in commands.items():
        status, _, err = run_train(monkeypatch, capsys, *flags)
        assert status == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (why, err)
        assert not list((base / "runs").rglob("lock")), (why, list((base / "runs").rglob("*")))
    assert sorted(path.name for path in (base / "runs").iterdir()) == ["other"]  # no run folder made either


RUN_FILES = {  # what a run's files may be instead, made in its folder -> what the refusal names there
    "a file for its folder": (lambda folder: folder.write_text(""), ""),
    "a dangling symlink for its folder": (lambda folder: folder.symlink_to(folder.with_name("gone")), ""),
    "a folder for its lock": (lambda folder: (folder / "lock").mkdir(parents=True), "lock"),
    "a symlink to a user's file for its lock": (
        lambda folder: (folder.mkdir(parents=True), (folder / "lock").symlink_to(folder.parents[2] / "notes.txt")),
        "lock"),
}


@pytest.mark.parametrize("made", list(RUN_FILES))
def test_a_run_whose_files_are_not_what_train_py_wrote_is_refused_in_one_line_naming_them(made, tmp_path,
                                                                                          monkeypatch, capsys):
    """Each refused in one line naming it; a user's file the lock links to is never opened through the link."""
    base = tmp_path / "base"
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(base))
    (base / "runs").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("the user's own\n")
    make, named = RUN_FILES[made]
    make(base / "runs" / "tiny")
    status, _, err = run_train(monkeypatch, capsys, *TINY, "--data=stdlib", "--run=tiny")
    assert status == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert carries(err, str(base / "runs" / "tiny" / named).rstrip("/")), err
    assert (tmp_path / "notes.txt").read_text() == "the user's own\n"


def test_dry_run_prints_the_paper_size(monkeypatch, capsys):
    status, out, err = run_train(monkeypatch, capsys, "--depth=24", "--mu_rec=8", "--dry_run")
    assert status == 0, err
    assert "parameters: 1,338,591,744" in out and "tokens: 103,999," in out
    assert carries(out, "weights", "5.4", "grads", "5.4", "DDP buckets", "5.4", "optimizer", "8.0")
    fits = re.search(r"largest device batch: (\d+) in 80 GB, (\d+) in 141 GB", out)
    assert fits and 0 < int(fits[1]) < int(fits[2])


def test_help_lists_every_default_and_only_what_a_user_sets(monkeypatch, capsys):
    status, out, _ = run_train(monkeypatch, capsys, "--help")
    assert status == 0 and "--mu_rec" in out and "--fault" not in out and "NANOPARCAE_FAULT" not in out
    words = " ".join(out.split())  # argparse wraps the help text
    for default in ("(default: 6)", "(default: 32768)", "(default: fineweb-edu)", "(default: bfloat16)"):
        assert default in words, default
