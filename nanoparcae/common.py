"""
nanoparcae/common.py: what every command shares.
Processes and devices, the base folder, errors and one-line exits, checked and atomic writes, spans and
first_sentence.
Also the GPU peak table that MFU divides by.
"""

import argparse
import errno
import inspect
import json
import os
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
# Processes: torchrun sets RANK; NCCL on CUDA, gloo on CPU. A plain `python` run is one process.


def parse_device(name):
    """--device's value -> torch.device.
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


RANK0_GROUP = None  # init_distributed's gloo group with the long timeout, for wait_for_rank0


def init_distributed(device, timeout=timedelta(minutes=10), rank0_timeout=timedelta(hours=1)):
    """Join torchrun's process group when RANK is set -> this process's device (its local GPU).
    Its collectives fail after `timeout`; wait_for_rank0 waits up to `rank0_timeout`.
    Workers restarted into the failed attempt's store would hang: ValueError."""
    global RANK0_GROUP
    if "RANK" not in os.environ:
        return device
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    if restarted and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # pytorch #167288
        raise ValueError("torchrun restarted the workers into the failed attempt's rendezvous store; launch it "
                         "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    # gloo beside NCCL too: its barrier waits on the CPU.
    # No NCCL op is then pending, which NCCL's watchdog would time out.
    RANK0_GROUP = dist.new_group(backend="gloo", timeout=rank0_timeout)
    return device


def no_buffer_sync():
    """DDP's keyword for no buffer sync at each forward; torch 2.13 renamed it.
    The old one also skips the sync at start, which is safe: every rank computes its own RoPE tables."""
    names = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in names else {"broadcast_buffers": False}


def wait_for_rank0():
    """Every rank waits here while rank 0, or a node's local rank 0, works alone.
    Such work: writing a checkpoint, training the tokenizer, fetching the CORE bundle.
    Each rank's read of the checkpoint it resumes from is such work too.
    The wait lasts up to init_distributed's rank0_timeout.
    Otherwise the others would wait in their next collective and fail at its shorter timeout.
    Without init_distributed's group: the default one."""
    if dist.is_initialized():
        dist.barrier(group=RANK0_GROUP)


def rank_and_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def print0(*args, **kwargs):
    """print on rank 0 only, flushed: a multi-process run logs from one process."""
    if rank_and_world()[0] == 0:
        print(*args, **kwargs, flush=True)


# -----------------------------------------------------------------------------
# The base directory: runs, tokenizers, data, the eval bundle and hub downloads live under it

def get_base_dir():
    """$NANOPARCAE_BASE_DIR (default ~/.cache/nanoparcae), created on first use.
    A folder that cannot be written raises ValueError naming it and the variable."""
    base_dir = Path(os.environ.get("NANOPARCAE_BASE_DIR", Path.home() / ".cache" / "nanoparcae")).expanduser()
    if why := unwritable(base_dir):
        raise ValueError(f"the base folder {why}: set NANOPARCAE_BASE_DIR to a writable folder")
    base_dir.mkdir(parents=True, exist_ok=True)
    return base_dir

# -----------------------------------------------------------------------------
# Writes: checked before the work whose result they keep, and never torn

FULL_DISK = (errno.ENOSPC, errno.EDQUOT)  # the errors of a disk or quota without room
NO_WRITE = (*FULL_DISK, errno.EROFS, errno.EACCES, errno.EPERM)  # a full disk, a read-only mount or mode


def nearest(folder):
    """`folder`, or the nearest path above it that exists: where a write would be tried."""
    folder = Path(folder).absolute()
    return next(path for path in (folder, *folder.parents) if path.exists())


def unwritable(folder, needs=0):
    """Why `folder` cannot take a file of `needs` bytes, as a clause; None if it can.
    A missing folder is tried at the nearest folder above it, and not made."""
    folder, there = Path(folder).absolute(), nearest(folder)
    if not there.is_dir():
        return (f"{folder} is a file, not a folder" if there == folder else
                f"{folder} cannot be made ({os.strerror(errno.ENOTDIR)}: {there} is a file)")
    try:
        tempfile.TemporaryFile(dir=there).close()  # a write: what a read-only mount or mode refuses
    except OSError as err:
        return f"{folder} cannot be written to ({err.strerror})"
    free = shutil.disk_usage(there).free
    return f"the disk holding {folder} is full ({size(free)} free, {size(needs)} needed)" if free < needs else None


def check_writable(folder, what, needs=0):
    """Before work whose result `what` goes to `folder`: raise if it could not be written.
    EnvironmentFailure for the machine (a read-only or full disk), ValueError for a file named as the folder.
    Called on the rank that writes."""
    if why := unwritable(folder, needs):
        said = f"{why}, and {what} would be written there; nothing was computed"
        if not nearest(folder).is_dir():
            raise ValueError(f"{said}: name a folder instead")
        raise EnvironmentFailure(f"{said}: make it writable or free space on its disk, then run again")


def write_atomically(path, write):
    """write(a temporary path beside `path`), then rename.
    An interrupted write never leaves a torn file under the real name.
    A full disk or read-only folder raises EnvironmentFailure, the temporary file removed.
    The temporary name ends in .tmp, so a figure's writer names its format."""
    partial = path.with_name(path.name + ".tmp")
    try:
        write(partial)
        os.replace(partial, path)
    except BaseException as err:  # a failed write leaves no partial file behind
        if partial.exists():  # (a read-only folder refuses even the unlink of a missing file)
            partial.unlink()
        cannot_write(path, err)
        raise


def cannot_write(path, err):
    """A write of `path` that failed for want of room or of leave: EnvironmentFailure. Other errors return."""
    if isinstance(err, OSError) and err.errno in NO_WRITE:
        raise EnvironmentFailure(f"{path} could not be written ({err.strerror}); nothing else changed: free space "
                                 f"on its disk or make {path.parent} writable, then run the same command again") \
            from err


def write_json(path, value):
    """Write value as indented JSON, atomically (write_atomically)."""
    write_atomically(Path(path), lambda partial: partial.write_text(json.dumps(value, indent=2) + "\n"))


def read_json(path):
    """A JSON file -> its value; None when it is absent. A torn file: ValueError naming it."""
    if not (path and Path(path).is_file()):
        return None
    try:
        return json.loads(Path(path).read_text())
    except ValueError as err:
        raise ValueError(f"{path} is not whole JSON ({err}): delete it, or run again the command that "
                         f"wrote it") from None


# -----------------------------------------------------------------------------
# Errors: library code raises, and run_command ends a command's main() in one line.
# Status 2: the user gave something wrong (ValueError, FileNotFoundError).
# Status 1: the machine lacks something (EnvironmentFailure). A command may return 3 (diverged).


class EnvironmentFailure(Exception):
    """The machine failed the command, not its input: a full disk, a read-only folder, replicas apart."""


def exit_status(err):
    """A refusal's status: 1 for EnvironmentFailure, 2 for ValueError and FileNotFoundError; else None."""
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
    """Every command's parser: its module docstring as --help, defaults shown, no abbreviations."""
    return CommandParser(description=description, formatter_class=HelpFormatter, allow_abbrev=False)


def run_command(main, argv=None):
    """Run a command's main(argv) and exit with its status: what it returns, or its refusal's.
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
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        else:  # torchrun stops every worker once one exits: local rank 0 first says why
            time.sleep(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(status)


# The old way to fail, kept only until every command runs under run_command. TEMPORARY.
REFUSED = (ValueError, FileNotFoundError, EnvironmentFailure)  # what a command ends in one line (fail_with)


def fail(message, status=2):
    """One clear line instead of a traceback, then exit with `status`: command code only.
    Under torchrun each node's local rank 0 prints it, once in each node's log.
    The checks decide alike on every rank."""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def exit_status(err):
    """A refusal's status: 1 for EnvironmentFailure, 2 for ValueError and FileNotFoundError; else None."""
    return 1 if isinstance(err, EnvironmentFailure) else 2 if isinstance(err, REFUSED) else None


def fail_with(err):
    """fail(err) with its exit_status. Any other error is raised again, with its traceback."""
    if status := exit_status(err):
        fail(err, status)
    raise err


def exit_in_one_line(kind, err, traceback):
    """sys.excepthook for a flat script (train.py): an error it does not catch ends it as fail_with says.
    The line goes straight to stderr: torch.distributed's hook would prefix it with the rank.
    A hook cannot set the status, so it exits itself.
    The ranks that do not print wait a moment first: torchrun stops every worker once one exits.
    By then local rank 0 must have said why."""
    status = exit_status(err)
    if status is None:
        return sys.__excepthook__(kind, err, traceback)
    sys.stdout.flush()
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        os.write(2, f"error: {err}\n".encode())
    else:
        time.sleep(2)
    os._exit(status)


def size(n):
    """Bytes as a person reads them: 2.2 MB, 13.4 GB."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def disk_full(folder, needs):
    """EnvironmentFailure: the disk is full, what `needs` room, what is free."""
    return EnvironmentFailure(
        f"the disk holding {folder} is full: {needs} and {size(shutil.disk_usage(folder).free)} is free; "
        f"the last checkpoint is kept: free space there, then the same command continues from it")


def comma_list(text, kind=int):
    """"1,2,4" -> [1, 2, 4]: a flag's values separated by commas, each read by kind.
    Raises ValueError naming the text when it holds no value or one that kind cannot read."""
    try:
        values = [kind(value) for value in str(text).split(",") if value.strip()]
    except ValueError:
        values = []
    if not values:
        raise ValueError(f"{text!r} must be values separated by commas, e.g. 1,2,4")
    return values


def spans(numbers, separator=", "):
    """[0, 1, 2, 5] -> "0-2, 5": ascending numbers (64 ranks, 1,822 shards) in a line."""
    runs = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return separator.join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def first_sentence(err, limit=300):
    """An exception as one line: its type and first sentence, never cut inside a word.
    torch's messages go on for several sentences of advice that does not apply here."""
    sentence = " ".join(str(err).split()).split(". ")[0].rstrip(".")
    if len(sentence) > limit:
        sentence = sentence[:limit].rsplit(" ", 1)[0] + " ..."
    return f"{type(err).__name__}: {sentence}"


# -----------------------------------------------------------------------------
# MFU: the matmul FLOPs executed (Parcae.matmul_flops_per_token) against the GPU's peak

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, per GPU


def peak_bf16_flops(device):
    """The GPU's dense bf16 peak, MFU's denominator; None on a CPU or an unlisted GPU."""
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else ""
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)

