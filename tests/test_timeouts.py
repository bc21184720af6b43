"""The ranks wait for lone work (rank 0's checkpoint write, each rank's checkpoint read on resume) at a barrier with
a timeout of its own, not in their next collective: two processes on gloo with a 3 s --collective_timeout, one rank
slowed 8 s in that work, finish the run; the same run waiting there on the collective's timeout dies at it.

Run as a script, this file is train.py with rank 0's first save, or rank 1's resume read, slowed (the tests'
torchrun workers):

    python tests/test_timeouts.py SECONDS wait|skip_wait write|read [train.py flags]
"""

import json
import os
import runpy
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLLECTIVE_TIMEOUT, SLOWED = 3, 8  # seconds; the slow write outlasts the timeout by more than twice over


def slowed_train(seconds, wait, work, *flags):
    """train.py with lone work slowed by `seconds`: write, rank 0's first checkpoint write; read, rank 1's read of
    the checkpoint it resumes from. skip_wait: without the ranks' wait for that work."""
    sys.path.insert(0, str(ROOT))
    import nanoparcae.checkpoint as checkpoint  # noqa: E402
    import nanoparcae.ranks as ranks  # noqa: E402
    import nanoparcae.run as run  # noqa: E402
    save, read = checkpoint.save_checkpoint, run.read_checkpoint

    def slow_save(path, *args, **kwargs):
        if not any(Path(path).parent.glob("ckpt_*.pt")):
            print(f"rank 0 slowed {seconds} s writing {Path(path).name}", file=sys.stderr, flush=True)
            time.sleep(float(seconds))
        return save(path, *args, **kwargs)

    def slow_read(path, *args, **kwargs):
        if os.environ.get("RANK") == "1":
            print(f"rank 1 slowed {seconds} s reading {Path(path).name}", file=sys.stderr, flush=True)
            time.sleep(float(seconds))
        return read(path, *args, **kwargs)

    if work == "write":
        checkpoint.save_checkpoint = slow_save
        if wait == "skip_wait":
            checkpoint.wait_for_rank0 = lambda: None
    else:
        run.read_checkpoint = slow_read
        if wait == "skip_wait":  # the ranks' agreement, which each rank's read ends in, on the short timeout
            init_distributed = ranks.init_distributed

            def short_waits(*args):
                device = init_distributed(*args)
                ranks.RANK0_GROUP = None
                return device
            ranks.init_distributed = short_waits
    sys.argv = [str(ROOT / "train.py"), *flags]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    slowed_train(*sys.argv[1:])
    sys.exit()

import pytest  # noqa: E402

from conftest import TINY, awaited, beforehand, carries, python, train, train_env, write_corpus  # noqa: E402


def slowed_run(corpus, base, wait, work="write"):
    """Two processes under torchrun, one's lone work slowed past the collective timeout: rank 0's first save (at
    step 2 of 8), or rank 1's read of the checkpoint the run resumes from."""
    command = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--", __file__, str(SLOWED), wait,
               work, f"--data={corpus / 'corpus.txt'}", *TINY, "--save_every=2",
               f"--collective_timeout={COLLECTIVE_TIMEOUT}", "--run=slowed"]
    return python(command, train_env(corpus, base), timeout=120)


def why(result):
    """The lines of a run's stderr that say what happened to it, for a failed assertion's message."""
    return "\n".join(line for line in result.stderr.splitlines() if "slowed" in line or "Error" in line
                     or "Timed out" in line)


def slowed_pair(folder, work):
    """slowed_run with and without the wait, side by side, each in its own base folder -> (kept, skipped)."""
    with ThreadPoolExecutor(2) as pool:
        kept, skipped = [pool.submit(slowed_run, folder, folder / wait, wait, work) for wait in ("wait", "skip_wait")]
        return kept.result(), skipped.result()


def slowed_writes(folder):
    """Both train a tokenizer -> the folder, the runs kept and skipped."""
    write_corpus(folder / "corpus.txt")
    return folder, *slowed_pair(folder, "write")


def slowed_reads(folder):
    """The run stopped at step 4, copied, then resumed by both -> the folder, the runs kept and skipped."""
    write_corpus(folder / "corpus.txt")
    train(folder, "--run=slowed", "--save_every=2", "--stop_at=4", base=folder / "wait")
    shutil.copytree(folder / "wait", folder / "skip_wait")
    return folder, *slowed_pair(folder, "read")


@pytest.mark.slow
@beforehand(slowed_writes)
def test_the_ranks_wait_out_rank0_writing_a_checkpoint_past_the_collective_timeout():
    tmp_path, kept, skipped = awaited(slowed_writes)
    slowed = f"rank 0 slowed {SLOWED} s writing ckpt_000002.pt"
    assert kept.returncode == 0 and slowed in kept.stderr, why(kept)
    run_dir = tmp_path / "wait" / "runs" / "slowed"
    steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == list(range(1, 9)) and [p.name for p in run_dir.glob("ckpt_*.pt")] == ["ckpt_000008.pt"]
    assert "done: 8 steps" in kept.stdout
    # Without the wait, rank 1 meets rank 0 in its next step's all-reduce, and gloo gives up on it after the
    # --collective_timeout: the slow write is past what a collective waits for.
    assert skipped.returncode != 0 and slowed in skipped.stderr, why(skipped)
    assert carries(skipped.stderr, f"{COLLECTIVE_TIMEOUT * 1000}ms"), why(skipped)
    assert "step 3/8" not in skipped.stdout and not any((tmp_path / "skip_wait" / "runs" / "slowed").glob("ckpt_*"))


@pytest.mark.slow
@beforehand(slowed_reads)
def test_the_ranks_wait_out_rank1_reading_its_checkpoint_past_the_collective_timeout():
    """The run stopped at step 4 resumes on two processes, rank 1's read of ckpt_000004.pt slowed."""
    tmp_path, kept, skipped = awaited(slowed_reads)
    slowed = f"rank 1 slowed {SLOWED} s reading ckpt_000004.pt"
    assert kept.returncode == 0 and slowed in kept.stderr, why(kept)
    assert "resumed slowed at step 4" in kept.stdout and "done: 8 steps" in kept.stdout, kept.stdout[-2000:]
    run_dir = tmp_path / "wait" / "runs" / "slowed"
    steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == list(range(1, 9)) and [p.name for p in run_dir.glob("ckpt_*.pt")] == ["ckpt_000008.pt"]
    # Without the long wait, rank 0 meets rank 1 in the ranks' agreement, which gives up after the collective timeout
    assert skipped.returncode != 0 and slowed in skipped.stderr, why(skipped)
    assert carries(skipped.stderr, f"{COLLECTIVE_TIMEOUT * 1000}ms"), why(skipped)
    assert "step 5/8" not in skipped.stdout
    assert [p.name for p in (tmp_path / "skip_wait" / "runs" / "slowed").glob("ckpt_*.pt")] == ["ckpt_000004.pt"]
