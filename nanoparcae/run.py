"""
nanoparcae/run.py: the run a command trains, checked against its flags and held by its lock, its first write.
"""

import errno
import fcntl
import os
import socket
import stat

from nanoparcae.checkpoint import latest, read_checkpoint, remove_partial_saves, run_dir
from nanoparcae.ranks import gather, rank_and_world

RENAMED_FLAGS = {"sampling": "depth_sampling"}  # run flags older checkpoints recorded under a former name
NOTES = {"data": "data: --data's content key, from its files' names, sizes and modification times, or stdlib's "
                 "Python version", "train_shards": "train_shards: the FineWeb-Edu training shards on disk, whose "
                 "shuffle is the run's data order"}


def run_folder(args):
    """The folder of the run a command trains, --run or d<depth>_<injection>, under the base folder."""
    return run_dir(f"d{args.depth}_{args.injection}" if args.run is None else args.run)


def open_run(folder, resume, device):
    """The run in `folder` -> (its newest checkpoint or None, that checkpoint read onto device), only read."""
    checkpoint = latest(folder)
    if resume and checkpoint is None:
        raise ValueError(f"there is no checkpoint of run {folder.name} under {folder} to resume; start it "
                         f"without --resume")
    if holder := run_holder(folder):  # before a live run's checkpoint is read onto its GPUs
        raise held(folder, holder)
    return checkpoint, checkpoint and read_checkpoint(checkpoint, device)


def check_flags(checkpoint, ckpt, flags):
    """Refuse run flags other than those the checkpoint recorded; a flag that is None takes the run's."""
    recorded = {RENAMED_FLAGS.get(flag, flag): value for flag, value in ckpt.get("run", {}).items()}
    if differ := [flag for flag, value in flags.items() if value is not None and recorded.get(flag) != value]:
        raise ValueError(f"run {checkpoint.parent.name} ({checkpoint}) was started with other flags: "
                         + "; ".join(f"{flag} {recorded.get(flag, 'unrecorded')} there, {flags[flag]} here"
                                     for flag in differ)
                         + "".join(f" ({NOTES[flag]})" for flag in differ if flag in NOTES)
                         + "; pass its flags to continue it, or --run=NAME to start another")

# -----------------------------------------------------------------------------
# One trainer per run (rank 0) holds <run folder>/lock. POSIX record locks (lockf), not flock, belong to the process,
# so no forked child keeps a dead trainer's, and the kernel drops them however it dies, freeing the lock.

HELD = (errno.EACCES, errno.EAGAIN)  # what lockf raises for a lock another process holds


def held(folder, holder):
    return ValueError(f"run {folder.name} is being trained by {holder}, which holds {folder / 'lock'}; wait for "
                      f"it to end, or pass --run=NAME to train another")


def open_lock(folder, create=False):
    """The run's lock file opened to read and write (None where there is none and create is False), never through
    a symlink or onto anything but a regular file, so a user's file is never written."""
    path = folder / "lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | create * os.O_CREAT, 0o644)
    except (FileNotFoundError, NotADirectoryError):
        if create:
            raise
        return None
    except OSError as err:
        why = {errno.ELOOP: "is a symlink, which the lock is never opened through",
               errno.EISDIR: "is a folder"}.get(err.errno, f"cannot be opened ({err.strerror})")
        raise ValueError(f"{path} {why}; move it away or let this user read and write it, then run the command "
                         f"again") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file; move it away, then run the command again")
    return os.fdopen(fd, "r+")


def run_holder(folder):
    """Who trains the run in `folder` now, the 'process P on host H' its lock names, or None. It only reads."""
    if (lock := open_lock(folder)) is None:
        return None
    with lock:  # closing it drops the shared lock taken to test the lock
        try:
            fcntl.lockf(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in HELD:
                return lock.read().strip() or "another process"
    return None


def claim(folder, checkpoint):
    """Rank 0 takes the run's lock until the process ends -> the lock file on rank 0 (keep it), None elsewhere.
    The folder must still hold `checkpoint` as its newest. Without locks (Lustre without flock) the run goes on."""
    lock, refusal, locked = None, None, True
    if rank_and_world()[0] == 0:  # the one rank that writes in the run folder
        folder.mkdir(parents=True, exist_ok=True)
        lock = open_lock(folder, create=True)
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            locked = False
            if err.errno in HELD:
                refusal = str(held(folder, lock.read().strip() or "another process"))
            else:
                print(f"warning: {folder / 'lock'} cannot be locked ({err.strerror}); nothing stops a second "
                      f"command on run {folder.name} while this one trains", flush=True)
        if not refusal and (now := latest(folder)) != checkpoint:
            refusal = (f"run {folder.name} changed while this command prepared its data: another command trained "
                       f"it, and {folder} now holds {now.name if now else 'no checkpoint'}, not "
                       f"{checkpoint.name if checkpoint else 'no checkpoint'}; run this command again to check it "
                       f"against the run as it is, or pass --run=NAME to train another")
        if refusal:
            lock.close()
        elif locked:
            lock.truncate(0)
            lock.write(f"process {os.getpid()} on host {socket.gethostname()}\n")
            lock.flush()
    if refusal := gather(refusal)[0]:
        raise ValueError(refusal)
    if lock:
        remove_partial_saves(folder)
    return lock
