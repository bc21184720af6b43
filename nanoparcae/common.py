"""
nanoparcae/common.py: what every command shares.
Its processes and device, its files, its one way to fail, and numbers in a line of text.
"""

import argparse
import errno
import inspect
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

# -----------------------------------------------------------------------------
# Processes and the device. torchrun sets RANK; NCCL runs on CUDA, gloo on a CPU.
# A plain `python` run is one process.


def parse_device(name):
    """Turn --device's value into a torch.device.
    Raises ValueError naming the flag for a device this code cannot use, or CUDA where there is none."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device={name} is not a device this code runs on; pass cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device={name}, but this machine has no CUDA GPU; pass --device=cpu")
    return device


def local_rank():
    """Return this process's rank on its node, torchrun's LOCAL_RANK; 0 in a plain run."""
    return int(os.environ.get("LOCAL_RANK", 0))


RANK0_GROUP = None  # init_distributed's gloo group with the long timeout, for wait_for_rank0


def init_distributed(device, timeout=timedelta(minutes=10), rank0_timeout=timedelta(hours=1)):
    """Join torchrun's process group when RANK is set, and return this process's device.
    Its collectives fail after `timeout`; wait_for_rank0 waits up to `rank0_timeout`.
    Workers restarted into the failed attempt's store would hang, so they raise ValueError."""
    global RANK0_GROUP
    if "RANK" not in os.environ:
        return device
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    if restarted and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # pytorch #167288
        raise ValueError("torchrun restarted the workers into the failed attempt's rendezvous store; launch it "
                         "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    if device.type == "cuda":
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    # A gloo group beside NCCL's waits on the CPU.
    # No NCCL op is then pending, which NCCL's watchdog would time out.
    RANK0_GROUP = dist.new_group(backend="gloo", timeout=rank0_timeout)
    return device


def no_buffer_sync():
    """Return DDP's keyword that skips the buffer sync at each forward; torch 2.13 renamed it.
    The old one also skips the sync at start. That is safe, since every rank computes its own RoPE tables."""
    names = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in names else {"broadcast_buffers": False}


def wait_for_rank0():
    """Make every rank wait here while rank 0, or a node's local rank 0, works alone.
    Such work writes a checkpoint, trains the tokenizer or fetches the CORE bundle.
    Each rank's read of the checkpoint it resumes from counts too.
    The wait lasts up to init_distributed's rank0_timeout.
    Otherwise the others would fail at their next collective's shorter timeout."""
    if dist.is_initialized():
        dist.barrier(group=RANK0_GROUP)


def rank_and_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def print0(*args, **kwargs):
    """Print on rank 0 only, flushed, so a multi-process run logs from one process."""
    if rank_and_world()[0] == 0:
        print(*args, **kwargs, flush=True)


# MFU divides the matmul FLOPs executed (Parcae.matmul_flops_per_token) by the GPU's peak.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, per GPU


def peak_bf16_flops(device):
    """Return the GPU's dense bf16 peak, MFU's denominator; None on a CPU or an unlisted GPU."""
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else ""
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)

# -----------------------------------------------------------------------------
# Files. Runs, tokenizers, data and downloads live under the base folder.
# A write is checked before the work whose result it keeps, and never torn.

FULL_DISK = (errno.ENOSPC, errno.EDQUOT)  # the errors of a disk or quota without room
NO_WRITE = (*FULL_DISK, errno.EROFS, errno.EACCES, errno.EPERM)  # a full disk, a read-only mount or mode


def get_base_dir():
    """Return $NANOPARCAE_BASE_DIR (default ~/.cache/nanoparcae), created on first use.
    A file in its place, or a folder that cannot be made, raises ValueError naming it and the variable.
    A folder there is not written: a read-only one serves reads, and each write checks its own folder."""
    base_dir = Path(os.environ.get("NANOPARCAE_BASE_DIR", Path.home() / ".cache" / "nanoparcae")).expanduser()
    if not base_dir.is_dir():
        check_writable(base_dir, "the base folder's runs, data and tokenizers",
                       fix="set NANOPARCAE_BASE_DIR to a writable folder", refusal=ValueError)
        base_dir.mkdir(parents=True, exist_ok=True)
    return base_dir


def nearest(folder):
    """Return `folder`, or the nearest path above it that exists, where a write would be tried."""
    folder = Path(folder).absolute()
    return next(path for path in (folder, *folder.parents) if path.exists())


def check_writable(folder, what, needs=0, fix=None, refusal=None):
    """Raise before work whose result `what` goes to `folder` if `needs` bytes could not be written there.
    A file named as the folder raises ValueError.
    A read-only or full disk raises `refusal`, EnvironmentFailure by default, or ValueError for a folder the user set.
    A missing folder is tried at the nearest folder above it, and not made. `fix` replaces the advice.
    Called on the rank that writes."""
    folder, there = Path(folder).absolute(), nearest(folder)
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
    """Call write(partial), then rename partial to `path`, so an interrupted write never leaves a torn file.
    partial defaults to `path` plus .tmp, so a figure's writer names its format; it may be a folder.
    A full disk or read-only folder raises EnvironmentFailure, the partial file removed."""
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
                                     f"space on its disk or make {path.parent} writable, then run the same "
                                     f"command again") from err
        raise


def write_json(path, value):
    """Write value as indented JSON, atomically.
    Its temporary name holds the pid and a random part, so two writers of one file never share it."""
    path = Path(path)
    write_atomically(path, lambda partial: partial.write_text(json.dumps(value, indent=2) + "\n"),
                     path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"))


def read_json(path):
    """Return a JSON file's value, or None when it is absent. A torn file raises ValueError naming it."""
    if not (path and Path(path).is_file()):
        return None
    try:
        return json.loads(Path(path).read_text())
    except ValueError as err:
        raise ValueError(f"{path} is not whole JSON ({err}): delete it, or run again the command that "
                         f"wrote it") from None


# -----------------------------------------------------------------------------
# Errors. Library code raises, and run_command ends a command's main() in one line.
# Status 2 says the user gave something wrong (ValueError, FileNotFoundError).
# Status 1 says the machine lacks something (EnvironmentFailure). A command may return 3 (diverged).


class EnvironmentFailure(Exception):
    """The machine failed the command, not its input, with a full disk, a read-only folder or replicas apart."""


def exit_status(err):
    """Return a refusal's status, 1 for EnvironmentFailure, 2 for ValueError and FileNotFoundError; else None."""
    if isinstance(err, EnvironmentFailure):
        return 1
    return 2 if isinstance(err, (ValueError, FileNotFoundError)) else None


class CommandParser(argparse.ArgumentParser):
    """argparse that raises ValueError for a bad flag, so run_command says it in one line."""

    def error(self, message):
        raise ValueError(message)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's layout and shows every default."""


def command_parser(description):
    """Build every command's parser, with its module docstring as --help, defaults shown, no abbreviations."""
    return CommandParser(description=description, formatter_class=HelpFormatter, allow_abbrev=False)


def run_command(main, argv=None):
    """Run a command's main(argv) and exit with its status, the one it returns or its refusal's.
    A refusal is one line on stderr, from local rank 0 under torchrun; anything else keeps its traceback.
    Every rank closes its process group first, so no rank aborts on the way out."""
    try:
        status = main(argv) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        status = 130
    except Exception as err:
        status = exit_status(err)
        if status is None:
            raise
        sys.stdout.flush()
        if local_rank() == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        else:  # torchrun stops every worker once one exits: local rank 0 first says why
            time.sleep(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(status)


# -----------------------------------------------------------------------------
# Numbers and errors in a line of text, and a flag's list of values read from one


def size(number, unit="B"):
    """Write a number as a person reads it, such as 13.4 GB, 2.2 MB or 0.4 MB.
    With unit "" it writes a count, such as 104.0 G, 12.3 M or 47,370."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if abs(number) >= scale or (unit and prefix == "M"):  # a unit's amount stays in M at least
            return f"{number / scale:.1f} {prefix}{unit}"
    return f"{number:,.0f}"


def comma_list(text, kind=int):
    """Read a flag's values separated by commas, each by kind: "1,2,4" gives [1, 2, 4].
    Raises ValueError naming the text when it holds no value or one that kind cannot read."""
    try:
        values = [kind(value) for value in str(text).split(",") if value.strip()]
    except ValueError:
        values = []
    if not values:
        raise ValueError(f"{text!r} must be values separated by commas, e.g. 1,2,4")
    return values


def spans(numbers, separator=", "):
    """Write ascending numbers (64 ranks, 1,822 shards) in a line: [0, 1, 2, 5] gives "0-2, 5"."""
    runs = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return separator.join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def first_sentence(err, limit=300):
    """Write an exception as one line, its type and first sentence, never cut inside a word.
    torch's messages go on for several sentences of advice that does not apply here."""
    sentence = " ".join(str(err).split()).split(". ")[0].rstrip(".")
    if len(sentence) > limit:
        sentence = sentence[:limit].rsplit(" ", 1)[0] + " ..."
    return f"{type(err).__name__}: {sentence}"


def disk_full(folder, needs):
    """Stop a run whose disk is full: EnvironmentFailure naming what `needs` room and what is free."""
    raise EnvironmentFailure(
        f"the disk holding {folder} is full: {needs} and {size(shutil.disk_usage(folder).free)} is free; "
        f"the last checkpoint is kept: free space there, then the same command continues from it") from None
