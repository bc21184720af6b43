"""
nanoparcae/run.py: the run a command trains, found by its name, checked against its flags, and held by its lock.
A refused command leaves the run's folder as it was, since the lock is its first write.
"""

import errno
import fcntl
import os
import socket
import stat

from nanoparcae.checkpoint import latest, read_checkpoint, remove_partial_saves, run_dir
from nanoparcae.ranks import gather, rank_and_world

RENAMED_FLAGS = {"sampling": "depth_sampling"}  # run flags older checkpoints recorded under a former name
NOTES = {  # what a differing flag's value stands for
    "data": "data: --data's content key, from its files' names, sizes and modification times, or stdlib's "
            "Python version",
    "train_shards": "train_shards: the FineWeb-Edu training shards on disk, whose shuffle is the run's data "
                    "order, so only the same shards continue it"}


def run_folder(args):
    """The folder of the run a command trains, --run or d<depth>_<injection>, under the base folder.
    checkpoint.run_dir refuses a name that every command could not find by that name."""
    name = f"d{args.depth}_{args.injection}" if args.run is None else args.run
    if not name:  # run_dir("") is the folder of every run
        raise ValueError("--run='' names no run; pass a name, or leave --run out for d<depth>_<injection>")
    return run_dir(name)


def open_run(folder, flags, resume, device):
    """The run in `folder`, checked -> (its newest checkpoint or None, that checkpoint read onto device).
    `flags` are this command's run flags. One that is None takes the checkpoint's value (the device batch).
    It only reads. Each of these raises ValueError in one line: a --resume with nothing to resume, a run another
    process trains, a checkpoint that cannot be read or recorded other flags, a folder or lock that is not one."""
    checkpoint = latest(folder)
    if resume and checkpoint is None:
        raise ValueError(f"there is no checkpoint of run {folder.name} under {folder} to resume; start it without "
                         f"--resume")
    refuse_if_held(folder, run_holder(folder))  # before a live run's checkpoint is read onto its GPUs
    if checkpoint is None:
        return None, None
    ckpt = read_checkpoint(checkpoint, device)
    recorded = {RENAMED_FLAGS.get(flag, flag): value for flag, value in ckpt.get("run", {}).items()}
    differ = [flag for flag, value in flags.items() if value is not None and recorded.get(flag) != value]
    if differ:
        raise ValueError(f"run {folder.name} ({checkpoint}) was started with other flags: "
                         + "; ".join(f"{flag} {recorded.get(flag, 'unrecorded')} there, {flags[flag]} here"
                                     for flag in differ)
                         + "".join(f" ({NOTES[flag]})" for flag in differ if flag in NOTES)
                         + "; pass its flags to continue it, or --run=NAME to start another")
    return checkpoint, ckpt


def claim(folder, checkpoint):
    """Rank 0 takes the run's lock (lock_run), then removes the partial files of saves a kill cut short.
    -> the lock file on rank 0 (keep it), None elsewhere. A refusal raises ValueError on every rank."""
    lock, refusal = None, None
    if rank_and_world()[0] == 0:  # the one rank that writes in the run folder
        try:
            lock = lock_run(folder, checkpoint)
            remove_partial_saves(folder)
        except ValueError as err:
            refusal = str(err)
    if refusal := gather(refusal)[0]:
        raise ValueError(refusal)
    return lock

# -----------------------------------------------------------------------------
# One trainer per run: <run folder>/lock, held by the process that writes the folder (rank 0).
# POSIX record locks (lockf), not flock, belong to the process, so no forked child keeps a dead trainer's.
# The kernel drops them however the process dies, so a killed run leaves the lock free for the same command.

HELD = (errno.EACCES, errno.EAGAIN)  # what lockf raises for a lock another process holds


def refuse_if_held(folder, holder):
    if holder:
        raise ValueError(f"run {folder.name} is being trained by {holder}, which holds {folder / 'lock'}; wait for "
                         f"it to end, or pass --run=NAME to train another")


def open_lock(folder, create=False):
    """The run's lock file, opened to read and write -> the file; None where there is none and create is False.
    Only a regular file is opened, never through a symlink, so a user's file is never written.
    Anything else in its place raises ValueError naming it."""
    path = folder / "lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | create * os.O_CREAT, 0o644)
    except (FileNotFoundError, NotADirectoryError):
        if create:
            raise
        return None
    except OSError as err:
        why = {errno.ELOOP: "is a symlink, which the lock is never opened through",
               errno.EISDIR: "is a folder, where the run's lock file belongs"}.get(err.errno, f"cannot be opened "
                                                                                     f"({err.strerror})")
        raise ValueError(f"{path} {why}; move it away or give this user read and write permission on it, then run "
                         f"the command again") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file, where the run's lock file belongs; move it away, then run "
                         f"the command again")
    return os.fdopen(fd, "r+")


def run_holder(folder):
    """Who trains the run in `folder` now, the 'process P on host H' its lock names; None when nobody does.
    It only reads, so a command refused for it leaves the folder as it was."""
    lock = open_lock(folder)
    if lock is None:
        return None
    with lock:  # closing it drops the shared lock taken to test the lock
        try:
            fcntl.lockf(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in HELD:
                return lock.read().strip() or "another process"
    return None


def lock_run(folder, checkpoint=None):
    """Take the run's lock for this process -> the open lock file, held until the process ends (keep it).
    Holding it, the folder must still hold `checkpoint` as its newest: another command may have trained the run
    since this one checked it. Else, or when another process holds the lock, ValueError; nothing is written.
    A filesystem without locks (Lustre without its flock option) gets a warning, and the run goes on unguarded."""
    folder.mkdir(parents=True, exist_ok=True)
    lock, locked = open_lock(folder, create=True), True
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in HELD:
            holder = lock.read().strip() or "another process"
            lock.close()
            refuse_if_held(folder, holder)
        print(f"warning: {folder / 'lock'} cannot be locked ({err.strerror}); nothing stops a second command on "
              f"run {folder.name} while this one trains", flush=True)
        locked = False
    if (now := latest(folder)) != checkpoint:
        lock.close()
        raise ValueError(f"run {folder.name} changed while this command prepared its data: another command trained "
                         f"it, and {folder} now holds {now.name if now else 'no checkpoint'}, not "
                         f"{checkpoint.name if checkpoint else 'no checkpoint'}; run this command again to check it "
                         f"against the run as it is, or pass --run=NAME to train another")
    if locked:
        lock.truncate(0)
        lock.write(f"process {os.getpid()} on host {socket.gethostname()}\n")
        lock.flush()
    return lock
