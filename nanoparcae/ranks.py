"""
nanoparcae/ranks.py: what keeps a run whole: one trainer per run, ranks that agree. A lock in the run folder refuses a
second command on a live run; before the first step every rank checks that all start from the same checkpoint;
CORE runs on every rank or on none; at each checkpoint the replicas' weights are compared.
Each check runs before what it protects; docs/distributed.md says what each catches.
"""

import errno
import fcntl
import hashlib
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nanoparcae.common import spans, wait_for_rank0
from nanoparcae.core_tasks import EVAL_BUNDLE_URL, download_eval_bundle, eval_bundle_dir


def stop(line, status):
    """End this rank with `status` and each node's log with `line`, written once there (by its local rank 0): the
    checks below decide alike on every rank, so every rank stops, for one reason."""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        sys.stderr.write(f"error: {line}\n")
    sys.exit(status)

# -----------------------------------------------------------------------------
# One trainer per run: <run folder>/lock, held by the process that writes the folder (rank 0) while it lives.
# POSIX record locks (lockf) rather than flock: they belong to the process, so no child it forked can keep a dead
# trainer's lock, and the kernel drops them when the process dies, however it dies: a killed run, or the workers
# torchrun --max_restarts replaces, leave the lock free for the command that continues the run.

HELD = (errno.EACCES, errno.EAGAIN)  # what lockf raises for a lock another process holds


def being_trained(run_dir, holder):
    return (f"run {run_dir.name} is being trained by {holder}, which holds {run_dir / 'lock'}; wait for it to end, "
            f"or pass --run=NAME to train another")


def run_holder(run_dir):
    """Who trains the run in run_dir now -> the 'process P on host H' its lock names, or None when no process
    holds the lock (or there is none). It only reads: a command refused for it leaves the folder as it was."""
    try:
        handle = open(Path(run_dir) / "lock")
    except FileNotFoundError:
        return None
    with handle:  # closing it drops the shared lock taken to test the lock
        try:
            fcntl.lockf(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in HELD:
                return handle.read().strip() or "another process"
    return None


def lock_run(run_dir):
    """Take the run's lock for this process -> the open lock file, which holds it until the process ends (keep a
    reference). ValueError naming the holder when another process has it: the file is then the holder's, never one
    made here. A filesystem without locks (Lustre mounted without its flock option) gets a warning, and the run goes
    on unguarded. It is the first thing a run writes in its folder, so take it after every check that can refuse
    the command: a refused command then leaves no lock behind."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(run_dir / "lock", "a+")  # "a+": opened without emptying what the holder wrote
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in HELD:
            print(f"warning: {run_dir / 'lock'} cannot be locked ({err.strerror}); nothing stops a second command "
                  f"on run {run_dir.name} while this one trains", flush=True)
            return handle
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ValueError(being_trained(run_dir, holder)) from None
    handle.truncate(0)
    handle.write(f"process {os.getpid()} on host {socket.gethostname()}\n")
    handle.flush()
    return handle


def lock_for_every_rank(run_dir):
    """Rank 0, the one rank that writes in the run folder, takes its lock, and every rank learns the outcome ->
    the lock file on rank 0 (None on the others), or ValueError on every rank, so that all stop together."""
    handle, refusal = None, [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            handle = lock_run(run_dir)
        except ValueError as err:
            refusal[0] = str(err)
    if dist.is_initialized():
        dist.broadcast_object_list(refusal)
    if refusal[0]:
        raise ValueError(refusal[0])
    return handle

# -----------------------------------------------------------------------------
# Ranks that agree. DDP keeps its replicas equal only by giving each the same averaged gradients and the same
# optimiser arithmetic: a rank that starts from another checkpoint (checkpoints kept on one node only, say) trains
# on, drifting apart unseen, and a rank that stops alone leaves the others waiting at their next collective until
# its timeout. So every comparison is gathered on every rank, and every rank decides alike.

INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # by bytes per element


def weight_sums(state):
    """Per tensor of a state dict, the sum of its elements' bit patterns read as integers (int64, wrapping) ->
    a list of ints. Integer addition is exact and does not depend on order, so equal tensors give equal sums on
    any device and GPU, and any one changed bit changes the sum; it costs one read of the weights in memory."""
    sums = [t.detach().view(INTEGERS[t.element_size()]).sum(dtype=torch.int64) for t in state.values()]
    return torch.stack(sums).tolist() if sums else []


def checkpoint_digest(state):
    """A checkpoint's weights as 12 hex digits: the sha256 of weight_sums. Of the weights already loaded rather
    than of the file's bytes: every rank has them in memory to resume from (5.4 GB in the 1.3B model's float32,
    on the GPU), where hashing the file would read all of its ~16 GB again, optimiser state included, from disk;
    and the weights are what the ranks must share."""
    return hashlib.sha256(repr(weight_sums(state)).encode()).hexdigest()[:12]


def gather(value):
    """value from every rank, in rank order (one process: [value])."""
    if not dist.is_initialized():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def agree_to_start(run_name, refusal, step, digest):
    """Before anything is built: every rank's refusal (a line, or None), the step of the checkpoint it would
    resume from (0: none) and that checkpoint's digest (None: none), gathered. ValueError with one line on every
    rank when any rank refused (the first one's line) or when they would start from different checkpoints."""
    starts = gather((refusal, step, digest))
    refusals = [(rank, line) for rank, (line, _, _) in enumerate(starts) if line]
    if refusals:
        rank, line = refusals[0]
        alike = len(refusals) == len(starts) and all(other == line for _, other in refusals)
        raise ValueError(line if alike else f"{line} (rank {rank}; every rank stops)")
    points = {}
    for rank, (_, step, digest) in enumerate(starts):
        points.setdefault((step, digest), []).append(rank)
    if len(points) > 1:
        where = "; ".join(f"step {step} ({f'weights {digest}' if digest else 'no checkpoint'}) on rank "
                          f"{spans(ranks)}" for (step, digest), ranks in points.items())
        raise ValueError(f"the ranks would start run {run_name} from different checkpoints: {where}; every node "
                         f"must see the run's newest checkpoint: keep $NANOPARCAE_BASE_DIR on a filesystem the "
                         f"nodes share, or copy the run folder to each node")


def drift(state):
    """At a checkpoint: every rank's weight_sums gathered -> None when every replica equals rank 0's, else what
    differs, for the line that stops the run."""
    if not dist.is_initialized():
        return None
    names, sums = list(state), gather(weight_sums(state))
    off = [rank for rank, other in enumerate(sums) if other != sums[0]]
    if not off:
        return None
    tensors = [name for i, name in enumerate(names) if any(other[i] != sums[0][i] for other in sums)]
    return (f"on rank {spans(off)}, {len(tensors)} of {len(names)} tensors differ from rank 0's ("
            + ", ".join(tensors[:3]) + (", ..." if len(tensors) > 3 else "") + ")")

# -----------------------------------------------------------------------------
# CORE's eval bundle on every rank, or CORE skipped on every rank: a rank without the tasks would never join
# CORE's per-task all_reduce, and the others would wait for it until the timeout.


def shared_eval_bundle(device, url=EVAL_BUNDLE_URL):
    """-> (the bundle's folder, None) on every rank, or (None, why) on every rank when any rank lacks it. Rank 0
    fetches it into its base folder first, then each other node's local rank 0 into its own (on a filesystem the
    nodes share they find it there, and nothing is fetched twice), the others waiting for each fetch in
    wait_for_rank0; then the ranks agree with an all_reduce MIN of "I have it"."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    local_rank, why = int(os.environ.get("LOCAL_RANK", 0)), None
    for fetching in (rank == 0, local_rank == 0 and rank != 0):
        if fetching:
            try:
                download_eval_bundle(url)
            except (OSError, ValueError) as err:
                why = f"the eval bundle is not available ({err})"
        wait_for_rank0()  # a download with its retries outlasts a collective's timeout
    bundle_dir = eval_bundle_dir()
    have = torch.tensor(int(bundle_dir is not None), device=device)
    if dist.is_initialized():
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
    if have.item():
        return bundle_dir, None
    return None, why or "a node has no eval bundle (its local rank 0 could not fetch it), so no rank runs CORE"
