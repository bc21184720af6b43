"""
nanoparcae/run.py: the run a command trains, identified by its flags and held by its lock.
Its jobs:

- the run's folder, from a safe name (run_folder).
- the flags its checkpoint recorded, checked against the command's (identify_run).
- one trainer per run, whose lock is taken before it trains what it checked (claim_run).

It decides whether a command trains or continues a run exactly.
Otherwise it raises ValueError, one line, before it writes anything.
"""

import errno
import fcntl
import os
import re
import socket
from pathlib import Path
from types import SimpleNamespace

from nanoparcae.checkpoint import (check_tokenizer, checkpoints, latest, read_checkpoint, remove_partial_saves,
                                   run_dir, warn_if_undigested, weights_digest)
from nanoparcae.ranks import print0, rank_and_world, agree_to_start, gather, refusing_alike
from nanoparcae.dataset import data_key
from nanoparcae.tokenizer import tokenizer_dir


# -----------------------------------------------------------------------------
# The run's identity: its folder, defined by the run flags its checkpoints record, and its lock


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")  # one folder name, never a path or a pattern


def run_folder(args):
    """The folder of the run a command trains: --run, or d<depth>_<injection>.
    A --run that is not one folder name of safe characters raises ValueError."""
    if args.run is not None and not RUN_NAME.fullmatch(args.run):
        raise ValueError(f"--run={args.run!r} is not a run name: use letters, digits, '.', '_', '+' and '-', "
                         f"starting with a letter or digit")
    return run_dir(args.run or f"d{args.depth}_{args.injection}")


# Run flags that older checkpoints recorded under a former name: read as today's
RENAMED_FLAGS = {"sampling": "depth_sampling"}


def identify_run(args, run_flags, batch, device, **resolved):
    """The run this command trains, checked on every rank before anything is built or written.
    Returns namespace(dir, name, tokenizer_dir, flags, checkpoint, ckpt, step, device_batch_size, grad_accum, seen).
    grad_accum: the micro-batches each process runs per optimiser step, decided here alone.

    - checkpoint: the run's newest, or None. ckpt: it, read onto `device`.
    - seen: the folder's checkpoints as checked (saved_state), for claim_run to find them unchanged.
    - flags: the run_flags' values. Those whose defaults resolve (d_model, ...) take `resolved`'s.
      --data takes the data's content key.

    Every rank raises ValueError alike, in one line, for:

    - a checkpoint that recorded other flag values.
    - a live run.
    - an unreadable checkpoint, or one that is not whole (checkpoint.read_checkpoint).
    - a run folder or lock that is not one (a file, a folder, a dangling symlink, unreadable).
    - a recorded device batch that does not divide this step.
    """
    tokenizer_path = tokenizer_dir(args.data, args.vocab_size)  # recorded in each checkpoint
    content = data_key(args.data)  # not its path
    folder = run_folder(args)
    name, size, checkpoint, ckpt, start, seen = folder.name, batch.size, None, None, (0, None), []
    # Each rank's read is its own work (13.4 GB from a shared filesystem, at the 1.3B): refusing_alike meets
    # where the long timeout holds, so a slow reader never outlasts the gather's shorter one
    with refusing_alike():  # a refusal on any rank stops every rank, in one line
        seen = saved_state(folder)  # before the newest is chosen: one saved after it differs
        refuse_if_held(folder, run_holder(folder))  # before a live run's checkpoint is read onto its GPUs
        checkpoint = latest(folder)
        recorded = {}
        if checkpoint:
            ckpt = read_checkpoint(checkpoint, device)  # unreadable: one line naming the file
            recorded = {RENAMED_FLAGS.get(flag, flag): value for flag, value in ckpt.get("run", {}).items()}
            if not batch.given and recorded.get("device_batch_size", batch.fitting) != batch.fitting:
                size = recorded["device_batch_size"]  # it fixes the run's data order
                tight = device.type == "cuda" and size > batch.plan["largest_batch"][batch.gpu_gb]
                print0(f"device batch: {size}, as run {name} recorded (it fixes the run's data order)"
                       + (f"; its plan no longer fits {batch.gpu}, where {batch.fitting} does" if tight
                          else ""))
        flags = {flag: getattr(args, flag) for flag in run_flags}
        flags.update(resolved, data=content, device_batch_size=size)
        if ckpt:
            differ = [f"{flag} {recorded.get(flag, 'unrecorded')} there, {value} here"
                      for flag, value in flags.items() if recorded.get(flag) != value]
            if differ:
                notes = {"data": "data: --data's content key, from its files' names, sizes and modification "
                                 "times, or stdlib's Python version",
                         "train_shards": "train_shards: the FineWeb-Edu training shards on disk, whose shuffle "
                                         "is the run's data order, so only the same shards continue it"}
                notes = "".join(f" ({note})" for flag, note in notes.items() if recorded.get(flag) != flags.get(flag))
                raise ValueError(f"run {name} ({checkpoint}) was started with other flags: {'; '.join(differ)}"
                                 f"{notes}; pass its flags to continue it, or --run=NAME to start another")
            start = ckpt["step"], weights_digest(ckpt)
        if batch.sequences % size:  # a recorded batch on another number of processes
            raise ValueError(f"run {name}'s device batch {size} does not divide the {batch.sequences} "
                             f"sequences each of {batch.world} process(es) runs per step; continue it on a "
                             f"number of processes it divides")
    agree_to_start(name, *start)  # every rank starts from the same checkpoint (none: step 0), or none
    if ckpt:
        warn_if_undigested(ckpt, checkpoint)
    return SimpleNamespace(dir=folder, name=name, tokenizer_dir=tokenizer_path, flags=flags,
                           checkpoint=checkpoint, ckpt=ckpt, step=start[0], device_batch_size=size,
                           grad_accum=batch.sequences // size, seen=seen)


def saved_state(folder):
    """A run folder's checkpoints as sorted (name, bytes, modification time) triples."""
    state = []
    for path in checkpoints(folder):
        try:
            stat = path.stat()
        except FileNotFoundError:  # removed by a live run's save since the listing
            continue
        state.append((path.name, stat.st_size, stat.st_mtime_ns))
    return sorted(state)


def check_unchanged(run):
    """Under the run's lock: the folder must hold what identify_run checked, or ValueError.
    Another command may have trained it between identify_run's checks and the lock.
    Training then would overwrite that command's work."""
    if saved_state(run.dir) != run.seen:
        now, was = latest(run.dir), run.checkpoint
        raise ValueError(f"run {run.name} changed while this command prepared its data: another command trained "
                         f"it, and {run.dir} now holds {now.name if now else 'no checkpoint'}, not "
                         f"{was.name if was else 'no checkpoint'}; run this command again to check it against "
                         f"the run as it is, or pass --run=NAME to train another")


def claim_run(run):
    """Take the run's lock (lock_run) on rank 0 -> the open lock file, kept until the process ends.
    Holding it, the folder is checked unchanged since identify_run: no command trains a run it did not check.
    It is the first write in the run folder, so it comes after every check that can refuse the command.
    A live run holding it, a run trained meanwhile, a resumed run's tokenizer not its own:
    every rank raises ValueError alike, the folder as it was."""
    lock = lock_for_every_rank(run)
    if lock:  # rank 0, the one that writes here: a save a full disk or a kill cut short goes
        remove_partial_saves(run.dir)
    return lock

# -----------------------------------------------------------------------------
# One trainer per run: <run folder>/lock, held by the process that writes the folder (rank 0).
# POSIX record locks (lockf), not flock: they belong to the process, so no forked child keeps a dead trainer's.
# The kernel drops them however the process dies. A killed run, or workers torchrun --max_restarts replaces,
# leave the lock free for the command that continues the run.

HELD = (errno.EACCES, errno.EAGAIN)  # what lockf raises for a lock another process holds


def refuse_if_held(run_dir, holder):
    """A run another process trains (holder: who, or None): ValueError naming it."""
    if holder:
        raise ValueError(f"run {run_dir.name} is being trained by {holder}, which holds {run_dir / 'lock'}; "
                         f"wait for it to end, or pass --run=NAME to train another")


def run_holder(run_dir):
    """Who trains the run in run_dir now: the 'process P on host H' its lock names.
    None when no process holds the lock, or there is none.
    It only reads: a command refused for it leaves the folder as it was."""
    handle = open_lock(run_dir, "r")
    if handle is None:
        return None
    with handle:  # closing it drops the shared lock taken to test the lock
        try:
            fcntl.lockf(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in HELD:
                return handle.read().strip() or "another process"
    return None


def open_lock(run_dir, mode):
    """The run's lock file opened in mode -> the file; None where "r" finds none.
    A folder in its place, or one this user may not open: ValueError naming it."""
    path = Path(run_dir) / "lock"
    try:
        return open(path, mode)
    except FileNotFoundError:
        if mode == "r":
            return None
        raise
    except IsADirectoryError:
        why = "is a folder, where the run's lock file belongs; move it away"
    except PermissionError:
        why = "cannot be opened (permission denied); give this user read and write permission on it"
    raise ValueError(f"{path} {why}, then run the command again") from None


def lock_run(run_dir, check=lambda: None):
    """Take the run's lock for this process -> the open lock file; keep a reference.
    It holds the lock until the process ends.

    - Another process has it: ValueError naming the holder. The file stays the holder's.
    - check(), called holding it, raises ValueError: the lock dropped, nothing written.
    - A filesystem without locks (Lustre without its flock option): a warning; the run goes on unguarded.

    It is the first thing a run writes in its folder.
    So take it after every check that can refuse the command: a refused command leaves no lock."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open_lock(run_dir, "a+")  # "a+": opened without emptying what the holder wrote
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        locked = True
    except OSError as err:
        if err.errno in HELD:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            refuse_if_held(run_dir, holder)
        print(f"warning: {run_dir / 'lock'} cannot be locked ({err.strerror}); nothing stops a second command "
              f"on run {run_dir.name} while this one trains", flush=True)
        locked = False
    try:
        check()
    except ValueError:
        handle.close()
        raise
    if not locked:
        return handle
    handle.truncate(0)
    handle.write(f"process {os.getpid()} on host {socket.gethostname()}\n")
    handle.flush()
    return handle


def lock_for_every_rank(run):
    """Rank 0, the one rank writing in the run folder, checks the run's tokenizer and takes its lock.
    Holding it, it finds the folder as identify_run checked it. Every rank learns the outcome.
    -> the lock file on rank 0, None on the others.
    Or ValueError on every rank, so that all stop together."""
    handle, refusal = None, None
    if rank_and_world()[0] == 0:
        try:
            if run.ckpt:  # a resumed run's tokenizer must be the one its checkpoint was trained with
                check_tokenizer(run.ckpt, run.checkpoint, run.tokenizer_dir,
                                "put that tokenizer back, or pass --run=NAME to start another run")
            handle = lock_run(run.dir, lambda: check_unchanged(run))
        except ValueError as err:
            refusal = str(err)
    if refusal := gather(refusal)[0]:  # rank 0's outcome, on every rank
        raise ValueError(refusal)
    return handle
