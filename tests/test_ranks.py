"""Tests of what keeps a run whole (nanoparcae/ranks.py, as train.py uses it): two "nodes" that would start from
different checkpoints, or that hold other shards or another tokenizer, both refuse and train nothing; a second command
on a live run is refused naming the holder, and the live run ends as it would have alone, and a filesystem without locks
is trained on with a warning; replicas whose weights drift apart stop the run at the checkpoint; CORE's eval bundle is
on every rank or skipped on every rank; a rank whose peer died says so in one line. The runs are train.py in
subprocesses, as users run it; faults come from tests/faulty_train.py."""

import errno
import io
import json
import os
import shutil
import signal
import socket
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoparcae import command, run as guards
from conftest import (Started, awaited, beforehand, carries, refused, serving, train, train_command, train_env,
                      untouched)
from nanoparcae import dataset
from nanoparcae.download import shared_eval_bundle
from nanoparcae.run import claim, run_holder
from nanoparcae.tokenizer import Tokenizer
from test_data import make_documents, write_parquet


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def errors(stderr):
    """The `error: ` lines of a process's stderr (torchrun adds its own report of a failed worker)."""
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@pytest.fixture(scope="module")
def alone(corpus):
    """The tiny run, trained to its end by one command on its own -> its folder."""
    train(corpus, "--run=alone")
    return corpus / "base" / "runs" / "alone"


@pytest.fixture(scope="module")
def drift(corpus):
    """The future of the drifting two-process run (its finished subprocess), started when the first test that takes
    this starts: it runs on a thread of its own while that test's first command waits at its first step."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(train, corpus, "--run=drift", "--save_every=4", nproc=2, fault="drift_step=1",
                          expect_ok=False)


@pytest.mark.slow
def test_two_nodes_that_would_start_from_different_checkpoints_both_refuse(corpus, alone, tmp_path):
    """Two one-process "nodes" through a c10d rendezvous, each with its own base folder, only the first holding
    the run's last checkpoint (checkpoints kept on one node): each ends in one line naming both starts, within
    the timeout (the node whose run is done does not leave alone either), and neither trains a step nor writes
    anything."""
    bases = [tmp_path / "node0", tmp_path / "node1"]
    shutil.copytree(corpus / "base", bases[0])
    bases[1].mkdir()
    run_dir = bases[0] / "runs" / "alone"
    before = untouched(run_dir)
    torchrun = ["--nnodes=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--rdzv_id=split"]
    nodes = [Started(train_command(corpus, "--run=alone", nproc=1, torchrun=torchrun), train_env(corpus, base))
             for base in bases]
    try:
        outputs = [node.communicate(timeout=120) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (stdout, stderr) in zip(nodes, outputs):
        assert node.returncode != 0 and len(errors(stderr)) == 1, stderr[-3000:]
        line = errors(stderr)[0]  # the run, each start with its ranks, and the fix's variable
        starts = [carries(line, "step 8", "rank"), carries(line, "step 0", "no checkpoint", "rank")]
        assert carries(line, "alone") and all(starts) and carries(line, "$NANOPARCAE_BASE_DIR"), line
        assert "step 1/" not in stdout
    assert untouched(run_dir) == before
    assert list(bases[1].iterdir()) == []


def two_nodes(corpus, bases, name):
    """train.py on FineWeb-Edu as two one-process "nodes" through a c10d rendezvous, each with its own base folder
    -> [(returncode, stdout, stderr)] per node."""
    torchrun = ["--nnodes=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", f"--rdzv_id={name}"]
    nodes = [Started(train_command(corpus, "--data=fineweb-edu", f"--run={name}", nproc=1, torchrun=torchrun),
                     train_env(corpus, base)) for base in bases]
    try:
        outputs = [node.communicate(timeout=120) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    return [(node.returncode, *output) for node, output in zip(nodes, outputs)]


def other_shards_or_tokenizer(folder):
    """Node 1 with one shard fewer and no tokenizer, or the same shards and a tokenizer of its own, side by side ->
    each case's base folders, and {case: [(returncode, stdout, stderr)] per node}."""
    cases = {"fewer": (folder / "fewer0", folder / "fewer1"), "other": (folder / "other0", folder / "other1")}
    for (base0, base1), node1_shards in zip(cases.values(), ([0, 1], [0, 1, 2])):
        for base, shards in ((base0, [0, 1, 2]), (base1, node1_shards)):
            (base / "fineweb-edu").mkdir(parents=True)
            for i in [*shards, dataset.FINEWEB_VAL_SHARD]:
                write_parquet(base / "fineweb-edu" / dataset.shard_name(i), make_documents(40, seed=100 + i))
    other = Tokenizer.train(iter(make_documents(200, seed=7)), 320)  # node 1's own, from other text
    other.save(cases["other"][1] / "tokenizers" / "fineweb-edu-320")
    with ThreadPoolExecutor(2) as pool:
        return cases, dict(zip(cases, pool.map(lambda case: two_nodes(folder, cases[case], case), cases)))


@pytest.mark.slow
@beforehand(other_shards_or_tokenizer)
def test_nodes_that_hold_other_shards_or_another_tokenizer_both_refuse():
    """Each node ends in one line naming node 1 and what differs, node 1 trains no tokenizer of its own, and neither
    trains a step."""
    cases, results = awaited(other_shards_or_tokenizer)
    for case, nodes in results.items():
        for returncode, stdout, stderr in nodes:
            assert returncode != 0 and len(errors(stderr)) == 1, stderr[-3000:]
            line = errors(stderr)[0]
            differs = ["no tokenizer", "training shards 0-1"] if case == "fewer" else ["tokenizer"]
            assert carries(line, "node 1", *differs, "rank 0", "$NANOPARCAE_BASE_DIR"), line
            assert "step 1/" not in stdout
    assert not (cases["fewer"][1] / "tokenizers").exists()  # node 1 waited for rank 0's, and trained none


@pytest.mark.slow
def test_a_second_command_on_a_live_run_is_refused_and_the_run_ends_as_it_would_alone(corpus, alone, drift):
    """The first command pauses at its first step, holding the run's lock; the same command meanwhile ends in one
    line naming the holder's process and host. Released, the first run ends with the weights and losses of the
    same run trained alone, and its lock is free again."""
    run_dir = corpus / "base" / "runs" / "live"
    first = Started(train_command(corpus, "--run=live", fault="pause_step=0"), train_env(corpus))
    try:
        holder = f"process {first.pid} on host {socket.gethostname()}"
        deadline = time.time() + 120
        while first.poll() is None and time.time() < deadline and run_holder(run_dir) != holder:
            time.sleep(0.05)
        assert run_holder(run_dir) == holder, first.communicate()[1][-3000:]
        message = refused(train(corpus, "--run=live", expect_ok=False))
        assert carries(message, "live", holder, str(run_dir / "lock"), "--run=NAME"), message
        assert run_holder(run_dir) == holder
        first.send_signal(signal.SIGUSR1)
        _, stderr = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0, stderr[-3000:]
    assert run_holder(run_dir) is None
    assert step_losses(run_dir) == step_losses(alone)
    weights, reference = (torch.load(folder / "ckpt_000008.pt", weights_only=True)["model"] for folder in (run_dir,
                                                                                                          alone))
    assert weights.keys() == reference.keys()
    for name in reference:
        assert torch.equal(weights[name], reference[name]), name


@pytest.mark.slow
def test_a_run_trained_between_a_commands_checks_and_its_lock_is_not_trained_again(corpus):
    """The issue's race: a command with another --seed checks the empty run, then pauses before the run's lock. A
    second command trains the run to its end meanwhile. Released, the first ends in one line naming the run and the
    checkpoint it did not check, status 2, and the finished run's files stay as they were."""
    run_dir = corpus / "base" / "runs" / "race"
    late = Started(train_command(corpus, "--run=race", "--seed=1", fault="pause_lock=1"), train_env(corpus))
    try:
        deadline = time.time() + 120
        while late.poll() is None and time.time() < deadline and "output: " not in late.out.read_text():
            time.sleep(0.05)  # it has checked the run: nothing there yet
        assert "output: " in late.out.read_text() and not run_dir.exists(), late.communicate()[1][-3000:]
        train(corpus, "--run=race")
        files = untouched(run_dir)
        late.send_signal(signal.SIGUSR1)
        _, stderr = late.communicate(timeout=120)
    finally:
        late.kill()
    message = refused(SimpleNamespace(returncode=late.returncode, stderr=stderr))
    assert carries(message, "race", "ckpt_000008.pt", "--run=NAME"), message
    assert untouched(run_dir) == files


def test_a_filesystem_without_locks_warns_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    run_dir = tmp_path / "runs" / "unlocked"
    run_dir.mkdir(parents=True)
    (run_dir / "lock").write_text("process 1 on host elsewhere\n")
    monkeypatch.setattr(guards.fcntl, "lockf", no_locks)
    assert run_holder(run_dir) is None
    claim(run_dir, None).close()
    assert capsys.readouterr().out == f"warning: {run_dir / 'lock'} cannot be locked (No locks available); nothing " \
                                      f"stops a second command on run unlocked while this one trains\n"


@pytest.mark.slow
def test_replicas_that_drift_apart_stop_the_run_at_the_checkpoint(corpus, drift):
    """Two processes; after the second step's clip, rank 1 nudges its first weight tensor: at the step-4
    checkpoint the run stops with one line naming rank 1 and the tensor, and nothing is saved."""
    result = drift.result()
    lines = errors(result.stderr)
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-3000:]
    assert carries(lines[0], "step 4", "rank 1", "1 of", "rank 0", "wte.weight"), lines[0]  # where, what differs
    run_dir = corpus / "base" / "runs" / "drift"
    assert list(step_losses(run_dir)) == [1, 2, 3, 4] and not any(run_dir.glob("ckpt_*.pt"))


def bundle_zip():
    """The least download_eval_bundle takes for a bundle: eval_bundle/eval_meta_data.csv."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("eval_bundle/eval_meta_data.csv", "Eval Task,Random baseline\n")
    return buffer.getvalue()


def two_ranks_worker(rank, port, root, url):
    """One "node" of two (each its own local rank 0 and base folder, node 0's holding the bundle): the bundle
    asked for where node 1 cannot fetch it, then where it can, then from one base folder the two share. Then rank 1
    dies with the group open, as a killed worker does, and rank 0's next all-reduce fails inside run_command, whose
    stderr and status go to root."""
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = "0"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # a rank left waiting fails the test rather than hang it
    results = []
    for base, path in ((f"node{rank}", "missing.zip"), (f"node{rank}", "eval_bundle.zip"),
                       ("shared", "eval_bundle.zip")):
        os.environ["NANOPARCAE_BASE_DIR"] = str(Path(root) / base)
        bundle_dir, why = shared_eval_bundle(f"{url}/{path}")
        results.append([bundle_dir and str(bundle_dir), why])
    Path(root, f"rank{rank}.json").write_text(json.dumps(results))
    if rank == 1:
        os._exit(0)
    os.dup2(os.open(Path(root, "stderr"), os.O_WRONLY | os.O_CREAT), 2)
    try:
        command.run_command(lambda argv: dist.all_reduce(torch.ones(1)))
    except SystemExit as stop:
        Path(root, "status").write_text(str(stop.code))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """two_ranks_worker's two processes, forked once for the two tests that read them -> their folder, and the
    requests the bundle's server answered."""
    root = tmp_path_factory.mktemp("two_ranks")
    with serving(root / "www") as server:
        (server.root / "eval_bundle.zip").write_bytes(bundle_zip())
        (root / "node0" / "eval_bundle").mkdir(parents=True)
        (root / "node0" / "eval_bundle" / "eval_meta_data.csv").write_text("Eval Task,Random baseline\n")
        mp.start_processes(two_ranks_worker, args=(free_port(), str(root), server.url), nprocs=2,
                           start_method="forkserver")  # forked from the server conftest started
        return root, server.requests


@pytest.mark.slow
def test_the_eval_bundle_is_on_every_rank_or_core_is_skipped_on_every_rank(two_ranks):
    tmp_path, requests = two_ranks
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    (lacking0, *_), (lacking1, *_) = results  # node 0 has the bundle, node 1 cannot fetch it: neither runs CORE
    assert lacking0 == [None, "a node has no eval bundle (its local rank 0 could not fetch it), so no rank runs CORE"]
    assert lacking1[0] is None and lacking1[1].startswith("the eval bundle is not available (") and \
        "missing.zip answered HTTP 404" in lacking1[1], lacking1
    for rank, (_, fetched, shared) in enumerate(results):
        assert fetched == [str(tmp_path / f"node{rank}" / "eval_bundle"), None]
        assert shared == [str(tmp_path / "shared" / "eval_bundle"), None]
    assert requests == ["/missing.zip", "/eval_bundle.zip", "/eval_bundle.zip"]  # the shared folder fetched once


@pytest.mark.slow
def test_a_rank_whose_peer_died_stops_in_one_line_naming_it_and_the_command_that_resumes(two_ranks):
    tmp_path, _ = two_ranks
    stderr = (tmp_path / "stderr").read_text()
    assert (tmp_path / "status").read_text() == "1" and len(stderr.strip().splitlines()) == 1, stderr[-3000:]
    assert carries(stderr, "127.0.0.1", "gone", "same command", "resumes"), stderr


def test_a_gpu_rank_binds_its_nccl_group_to_its_own_gpu(monkeypatch):
    """Under torchrun on GPUs, LOCAL_RANK picks the device and NCCL's group is bound to it; on a CPU gloo is not."""
    from nanoparcae import ranks
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.append((backend, kwargs)))
    monkeypatch.setattr(dist, "new_group", lambda **kwargs: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(ranks, "RANK0_GROUP", None)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ranks.init_distributed(torch.device("cuda")) == torch.device("cuda", 1)
    assert calls[0] == ("set_device", torch.device("cuda", 1))
    assert calls[1][0] == "nccl" and calls[1][1]["device_id"] == torch.device("cuda", 1)
    calls.clear()
    assert ranks.init_distributed(torch.device("cpu")) == torch.device("cpu")
    assert calls[0][0] == "gloo" and calls[0][1]["device_id"] is None


def refuses_or_ends_well(rank, port, root):
    """Rank 0 refuses after rank 1 has ended well and waits at run_command's closing barrier: each rank's stderr
    and status go to root."""
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    os.dup2(os.open(Path(root, f"stderr{rank}"), os.O_WRONLY | os.O_CREAT), 2)

    def main(argv):
        if rank == 0:
            time.sleep(0.5)  # rank 1 is at the barrier by now
            raise ValueError("--depth=0 is refused")
        return 0
    try:
        command.run_command(main)
    except SystemExit as stop:
        Path(root, f"status{rank}").write_text(str(stop.code))


@pytest.mark.slow
def test_a_rank_that_ended_well_leaves_its_peers_refusal_the_one_line(tmp_path):
    mp.start_processes(refuses_or_ends_well, args=(free_port(), str(tmp_path)), nprocs=2, start_method="forkserver")
    assert [(tmp_path / f"status{rank}").read_text() for rank in range(2)] == ["2", "0"]
    assert (tmp_path / "stderr0").read_text() == "error: --depth=0 is refused\n"
    assert (tmp_path / "stderr1").read_text() == ""  # no traceback from the barrier its peer left
