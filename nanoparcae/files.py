"""
The base folder, where runs, tokenizers and data live, and every write in it, checked first and never torn.
"""

import errno
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from nanoparcae.command import EnvironmentFailure, size

FULL_DISK = (errno.ENOSPC, errno.EDQUOT)  # the errors of a disk or quota without room
NO_WRITE = (*FULL_DISK, errno.EROFS, errno.EACCES, errno.EPERM)  # or of a read-only mount or mode


def get_base_dir():
    """$NANOPARCAE_BASE_DIR (default ~/.cache/nanoparcae), made on first use. A folder there is not written, since
    a read-only one serves reads and each write checks its own."""
    setting = os.environ.get("NANOPARCAE_BASE_DIR", str(Path.home() / ".cache" / "nanoparcae"))
    if not setting.strip():  # an empty setting would write into the current folder
        raise ValueError("NANOPARCAE_BASE_DIR is set but empty; set it to a folder, or unset it (~/.cache/nanoparcae)")
    base_dir = Path(setting).expanduser()
    if not base_dir.is_dir():
        check_writable(base_dir, "the base folder's runs, data and tokenizers",
                       fix="set NANOPARCAE_BASE_DIR to a writable folder", refusal=ValueError)
        base_dir.mkdir(parents=True, exist_ok=True)
    return base_dir


def check_writable(folder, what, needs=0, fix=None, refusal=None):
    """Raise before work whose result `what` goes to `folder` if `needs` bytes could not be written there: ValueError
    for a file in its place, else `refusal`. A missing folder is tried at the nearest folder above it, not made."""
    folder = Path(folder).absolute()
    there = next(path for path in (folder, *folder.parents) if path.exists())  # where a write is tried
    if not there.is_dir():
        why = ("it is a file" if there == folder else
               f"it cannot be made ({os.strerror(errno.ENOTDIR)}, since {there} is a file)")
        raise ValueError(f"{what} would go to {folder}, but {why}; nothing was computed: "
                         f"{fix or 'name a folder instead'}")
    fix, refusal = fix or "make it writable or free space on its disk, then run again", refusal or EnvironmentFailure
    try:
        tempfile.TemporaryFile(dir=there).close()  # a write, which a read-only mount or mode refuses
    except OSError as err:
        raise refusal(f"{what} would go to {folder}, which cannot be written to ({err.strerror}); "
                      f"nothing was computed: {fix}") from None
    if (free := shutil.disk_usage(there).free) < needs:
        raise refusal(f"{what} would go to {folder}, but the disk holding it is full ({size(free)} free, "
                      f"{size(needs)} needed); nothing was computed: {fix}")


def write_atomically(path, write, partial=None):
    """Call write(partial), a file or folder (default `path` plus .tmp), then rename it to `path`, so an interrupted
    write never leaves a torn file."""
    partial = Path(partial or path.with_name(path.name + ".tmp"))
    try:
        write(partial)
        os.replace(partial, path)
    except BaseException as err:
        if partial.is_dir():
            shutil.rmtree(partial)
        elif partial.exists():  # a read-only folder refuses even the unlink of a missing file
            partial.unlink()
        if isinstance(err, OSError) and err.errno in NO_WRITE:
            raise EnvironmentFailure(f"{path} could not be written ({err.strerror}); nothing else changed: free "
                                     f"space on its disk or make {path.parent} writable, then run again") from err
        raise


def write_json(path, value):
    """Write value as indented JSON, atomically, under a temporary name no other writer shares."""
    path = Path(path)
    write_atomically(path, lambda partial: partial.write_text(json.dumps(value, indent=2) + "\n"),
                     path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"))


def read_json(path):
    """A JSON file's object, or None when it is absent. Every JSON the project reads comes here."""
    if not (path and Path(path).is_file()):
        return None
    try:
        value = json.loads(Path(path).read_text())
    except (ValueError, OSError) as err:
        raise ValueError(f"{path} is not whole JSON ({err}): delete it, or rerun the command that wrote it") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not the dict this project writes there: "
                         f"delete it, or rerun the command that wrote it")
    return value


def disk_full(folder, needs, err=None):
    """Stop a run whose disk is full with EnvironmentFailure, naming what `needs` room; another OSError goes on up."""
    if err and err.errno not in FULL_DISK:
        raise err
    free = size(shutil.disk_usage(folder).free)
    raise EnvironmentFailure(f"the disk holding {folder} is full: {needs} and {free} is free; the last checkpoint is "
                             f"kept: free space there, then the same command continues from it") from None
