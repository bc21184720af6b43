"""
common.py: what every script shares and the model does not need: process setup, the base directory,
checkpoints (read, written, and a run loaded with its tokenizer: load_run) and the GPU peak table that MFU divides by.
A library, not a script: train.py, sample.py, eval_core.py, dataset.py, data.py and core_tasks.py import it, as do
experiments/ and interop/.
"""

import math
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from model import Parcae, ParcaeConfig
from tokenizer import Tokenizer

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


# -----------------------------------------------------------------------------
# Checkpoints: <base dir>/runs/<run>/ckpt_<step>.pt, a plain dict loadable with weights_only=True


def save_checkpoint(path, model, **extra):
    """Write to a temporary name, then rename: a killed run never leaves a torn checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"config": asdict(model.config), "model": model.state_dict(), **extra}, tmp)
    os.replace(tmp, path)


def find_checkpoint(runs_dir, run=None):
    """The newest checkpoint of `run`, or of the most recently written run when run is None."""
    runs_dir = Path(runs_dir)
    pattern = f"{run}/ckpt_*.pt" if run else "*/ckpt_*.pt"
    found = sorted(runs_dir.glob(pattern), key=lambda p: (p.stat().st_mtime, p.name))
    if not found:
        where = runs_dir / run if run else runs_dir
        raise FileNotFoundError(f"no checkpoint under {where}; train one first with `python train.py`")
    return found[-1]


def read_checkpoint(path, device="cpu"):
    """torch.load of a checkpoint (weights_only=True), the one reader: train.py's resume and load_run. Raises
    FileNotFoundError when it is absent and ValueError naming it when torch cannot read it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as err:
        raise ValueError(f"checkpoint {path} is truncated or unreadable ({first_sentence(err)}): remove it to "
                         f"start the run over (a run keeps its newest checkpoint only), or restore it from a "
                         f"copy") from None


def load_run(ckpt_or_run=None, device="cpu"):
    """A checkpoint file, a run's name (its newest checkpoint under <base dir>/runs) or None (the newest of the run
    written last) -> (model in eval mode, its tokenizer, the checkpoint dict, the checkpoint's path).

    The tokenizer is the one the checkpoint records; where that folder is gone (a moved NANOPARCAE_BASE_DIR), the
    one of the same key, its folder's name, under this base folder's tokenizers/. One whose vocabulary outgrows the
    model's is refused. FileNotFoundError and ValueError carry one line."""
    path = Path(ckpt_or_run) if ckpt_or_run else None
    if path is not None and path.is_dir():
        inside = sorted(path.glob("ckpt_*.pt"))
        raise FileNotFoundError(f"{path} is a folder, not a checkpoint file; pass a checkpoint file" +
                                (f" such as its newest, {inside[-1]}, or the run's name, {path.name}" if inside else
                                 ", or a run's name"))
    if path is None or not (path.is_file() or path.suffix == ".pt" or len(path.parts) > 1):
        path = find_checkpoint(get_base_dir() / "runs", ckpt_or_run)
    ckpt = read_checkpoint(path, device)
    try:  # torch read it, but it may hold no Parcae
        model = Parcae(ParcaeConfig(**ckpt["config"]))
        model.load_state_dict(ckpt["model"])
    except Exception as err:
        raise ValueError(f"checkpoint {path} is not a nanoparcae checkpoint ({first_sentence(err)}); pass one that "
                         f"train.py wrote") from None
    if "tokenizer_dir" not in ckpt:
        raise ValueError(f"checkpoint {path} names no tokenizer_dir; it was not written by train.py")
    recorded = Path(ckpt["tokenizer_dir"])
    places = list(dict.fromkeys((recorded, get_base_dir() / "tokenizers" / recorded.name)))  # its path, its key here
    directory = next((place for place in places if (place / "tokenizer.tiktoken").is_file()), None)
    if directory is None:
        run = ckpt.get("args", {})
        command = f"`python dataset.py tokenizer --data={run['data']} --vocab_size={run['vocab_size']}`" \
            if {"data", "vocab_size"} <= run.keys() else \
            "`python dataset.py tokenizer` and the run's --data and --vocab_size"
        where = f"neither at {places[0]} nor at {places[1]}" if len(places) > 1 else f"not at {places[0]}"
        raise FileNotFoundError(f"the tokenizer of checkpoint {path} is {where}; recreate it with {command}")
    tokenizer = Tokenizer.load(directory)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer at {directory} has {tokenizer.vocab_size} tokens, the model "
                         f"{model.config.vocab_size}: they are not from the same run")
    return model.to(device).eval(), tokenizer, ckpt, path


def write_atomically(path, write):
    """write(a temporary path beside `path`), then rename: an interrupted write never leaves a torn file under the
    real name (a figure's writer names its format, since the temporary name ends in .tmp)."""
    partial = path.with_name(path.name + ".tmp")
    write(partial)
    os.replace(partial, path)


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


# -----------------------------------------------------------------------------
# train.py's divergence rule (docs/troubleshooting.md states it for users)

STATE_NORM_LIMIT = 1e4  # ~256 ||e|| (||e|| ~ sqrt(d)): bf16's 8 significant bits no longer resolve e beside h
VAL_LOSS_MARGIN = 1.0  # nats below a uniform guess ln V that show a run has learned


class Divergence:
    """The divergence rule, step by step. A run diverged at the first of `patience` bad steps in a row (a
    non-finite loss or gradients; ||h_T|| past h_norm_limit where that stops a run), or at an eval whose val loss
    is non-finite, or back at a uniform guess ln V after an eval VAL_LOSS_MARGIN below it (learned, then lost). A
    run that has not learned is not judged by its val loss: initial weights can score far above ln V (the
    Transformer's tied head predicts the current token). patience 0: never. The state-norm limit stops a run in
    bfloat16 (past it the input no longer registers in u = Abar h + Bbar e) or when given; in float32, which
    resolves 2^16 times finer, a state past 2^16 x the limit is a warning, once. lowest_val_loss: the lowest eval
    so far, carried across a resume."""

    def __init__(self, vocab_size, dtype, patience, h_norm_limit=None, lowest_val_loss=math.inf):
        self.vocab_size, self.uniform, self.patience = vocab_size, math.log(vocab_size), patience
        self.h_norm_stops = h_norm_limit is not None or dtype == "bfloat16"
        self.h_norm_limit = h_norm_limit or STATE_NORM_LIMIT * (1 if self.h_norm_stops else 2 ** 16)
        self.bad_steps, self.lowest_val_loss, self.warned = 0, lowest_val_loss, False

    def check(self, step, finite, h_norm=None, val_loss=None):
        """After `step`: finite, whether its loss and gradients were; h_norm, its ||h_T|| (None: unlooped); val_loss,
        the eval at this step (None: none) -> None, {"diverged_at", "reason", "detail"}, or {"warning": "h_norm"}."""
        past = h_norm is not None and h_norm > self.h_norm_limit
        reason = "non-finite loss or gradients" if not finite else \
            f"||h_T|| > {self.h_norm_limit:g}" if past and self.h_norm_stops else None
        self.bad_steps = self.bad_steps + 1 if reason else 0
        if 0 < self.patience <= self.bad_steps:
            return {"diverged_at": step - self.bad_steps + 1, "reason": reason,
                    "detail": f"{self.bad_steps} steps in a row (to step {step})"}
        if val_loss is not None and self.patience > 0:
            learned = self.lowest_val_loss < self.uniform - VAL_LOSS_MARGIN
            lost = "non-finite val loss" if not math.isfinite(val_loss) else \
                "val loss back above a uniform guess" if learned and val_loss >= self.uniform else None
            if lost:
                return {"diverged_at": step, "reason": lost, "detail": f"{val_loss:.4f} against ln {self.vocab_size} "
                        f"= {self.uniform:.4f}, lowest before {self.lowest_val_loss:.4f}"}
        if val_loss is not None:
            self.lowest_val_loss = min(self.lowest_val_loss, val_loss)
        if past and not self.h_norm_stops and not self.warned:
            self.warned = True
            return {"warning": "h_norm", "h_norm": h_norm, "limit": self.h_norm_limit}
        return None
