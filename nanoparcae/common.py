"""
nanoparcae/common.py: process and device set-up, the base folder, atomic writes, one-line errors and the GPU
peak table that MFU divides by.
"""

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

# -----------------------------------------------------------------------------
# Processes: torchrun sets RANK; NCCL on CUDA, gloo on CPU. A plain `python` run is one process.


def parse_device(name):
    """--device's value -> torch.device; ValueError naming the flag when it is no device this code runs on, or CUDA
    where there is none."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device={name} is not a device this code runs on; pass cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device={name}, but this machine has no CUDA GPU; pass --device=cpu")
    return device


def init_distributed(device):
    """Join torchrun's process group when RANK is set -> the device this process uses (its local GPU)."""
    if "RANK" not in os.environ:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def rank_and_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def print0(*args, **kwargs):
    """print on rank 0 only, flushed (the logs of a multi-process run come from one process)."""
    if rank_and_world()[0] == 0:
        print(*args, **kwargs, flush=True)


# -----------------------------------------------------------------------------
# The base directory: runs, tokenizers, data, the eval bundle and hub downloads live under it

def get_base_dir():
    """$NANOPARCAE_BASE_DIR (default ~/.cache/nanoparcae), created on first use. A folder that cannot be written
    raises ValueError naming it and the variable."""
    base_dir = Path(os.environ.get("NANOPARCAE_BASE_DIR", Path.home() / ".cache" / "nanoparcae")).expanduser()
    try:
        base_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=base_dir).close()  # a write: what a read-only mount or mode refuses
    except OSError as err:
        raise ValueError(f"the base folder {base_dir} cannot be written to ({err.strerror}): set "
                         f"NANOPARCAE_BASE_DIR to a writable folder") from None
    return base_dir


def write_atomically(path, write):
    """write(a temporary path beside `path`), then rename: an interrupted write never leaves a torn file under the
    real name (a figure's writer names its format, since the temporary name ends in .tmp)."""
    partial = path.with_name(path.name + ".tmp")
    write(partial)
    os.replace(partial, path)


def fail(message):
    """One clear line instead of a traceback, and status 2: the command was wrong, not the run."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def first_sentence(err, limit=300):
    """An exception as one line for a one-line error: its type and first sentence, never cut inside a word (torch's
    messages go on for several sentences of advice that does not apply here)."""
    sentence = " ".join(str(err).split()).split(". ")[0].rstrip(".")
    if len(sentence) > limit:
        sentence = sentence[:limit].rsplit(" ", 1)[0] + " ..."
    return f"{type(err).__name__}: {sentence}"


# -----------------------------------------------------------------------------
# MFU: the matmul FLOPs executed (Parcae.matmul_flops_per_token) against the GPU's peak

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, per GPU


def peak_bf16_flops(device):
    """The GPU's dense bf16 peak, the denominator of MFU; None on a CPU or an unlisted GPU."""
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else ""
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)

