"""
nanoparcae/checkpoint.py: checkpoint files, written, found and read back checked.
Each is run_dir(run)/ckpt_<step>.pt, a plain dict torch.load reads with weights_only=True.
Its jobs:

- write a checkpoint and prune the older ones (save_checkpoint, save_and_prune).
- find a run's newest (latest, find_checkpoint).
- read one checked against its digests (read_checkpoint, check_digest, other_tokenizer).
- build a model from its weights, without a random init where none is kept (training_model).
- load a trained run's model and tokenizer (load_run).
"""

import hashlib
import os
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from model import Parcae, ParcaeConfig
from nanoparcae.common import (FULL_DISK, EnvironmentFailure, disk_full, first_sentence, get_base_dir, print0,
                               rank_and_world, size, wait_for_rank0, write_atomically)
from nanoparcae.dataset import tokenizer_dir
from nanoparcae.ranks import drift, gather
from nanoparcae.tokenizer import Tokenizer


def run_dir(name=""):
    """<base dir>/runs/<name>: a run's folder. No name: the folder holding every run."""
    return get_base_dir() / "runs" / name


def save_checkpoint(path, model, **extra):
    """Write under a temporary name, then rename. A killed run never leaves a torn checkpoint.
    A disk without room raises EnvironmentFailure (disk_full); the last checkpoint stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"config": asdict(model.config), "model": model.state_dict(), **extra}
    state["digest"] = {key: tensors_digest(value) for key, value in state.items() if tensors_in(value)}
    need = saved_bytes(state)
    if shutil.disk_usage(path.parent).free < need:
        disk_full(path.parent, f"a checkpoint needs {size(need)}")

    def write(partial):
        try:
            torch.save(state, partial)
        except (OSError, RuntimeError) as err:  # torch's writer says "iostream error", not ENOSPC
            written = partial.stat().st_size if partial.exists() else 0
            if getattr(err, "errno", None) in FULL_DISK or shutil.disk_usage(path.parent).free < need - written:
                partial.unlink(missing_ok=True)
                disk_full(path.parent, f"a checkpoint needs {size(need)}")
            raise
    write_atomically(path, write)


def saved_bytes(state):
    """An upper estimate of torch.save's file for `state`, in bytes.
    Tensors count their bytes and 1 KiB of framing each; the rest its written length; then 64 KiB."""
    def walk(value):
        if isinstance(value, torch.Tensor):
            return value.nbytes + 1024
        if isinstance(value, dict):
            return sum(walk(key) + walk(item) for key, item in value.items())
        if isinstance(value, (list, tuple)):
            return sum(map(walk, value)) + 2
        return len(repr(value)) + 2
    return walk(state) + 2**16


def remove_partial_saves(folder):
    """Removes the ckpt_*.pt.tmp of a save that never finished (a full disk, a kill), saying so."""
    for partial in sorted(Path(folder).glob("ckpt_*.pt.tmp")):
        print0(f"removed {partial} ({size(partial.stat().st_size)}), a checkpoint write that never finished")
        partial.unlink()


def save_and_prune(folder, step, model, loaders, **state):
    """Write ckpt_<step>.pt on rank 0, with `state`, every virtual rank's loader position and the tokenizer's digest.
    The run's older checkpoints are then removed: a 1.3B one with optimiser state is ~16 GB.
    The RNG state is a function of (seed, step, virtual rank), so nothing else is needed.
    If the ranks' weights drifted apart (ranks.drift), saves nothing: EnvironmentFailure."""
    if drifted := drift(model.state_dict()):
        raise EnvironmentFailure(f"at step {step} the ranks' weights have drifted apart: {drifted}; nothing "
                                 f"saved: the run's last checkpoint stays, and the same command resumes every "
                                 f"rank from it")
    loader_states = [each for states in gather([loader.state_dict() for loader in loaders]) for each in states]
    if rank_and_world()[0] == 0:
        path = folder / f"ckpt_{step:06d}.pt"
        older = checkpoints(folder)
        tokenizer = Tokenizer.files_digest(state["tokenizer_dir"])  # which one the run trains with
        save_checkpoint(path, model, step=step, loader=loader_states, tokenizer_digest=tokenizer, **state)
        for stale in older:
            if stale != path:
                stale.unlink()
        print0(f"saved {path}")
    wait_for_rank0()  # the others wait here, not in their next step's all-reduce, however slow the disk


CHECKPOINT = re.compile(r"ckpt_(\d+)\.pt")  # the names save_and_prune writes; a user's copy is none


def checkpoints(folder):
    """The checkpoints train.py wrote in a run folder, oldest step first."""
    found = [path for path in Path(folder).glob("ckpt_*.pt") if CHECKPOINT.fullmatch(path.name)]
    return sorted(found, key=lambda path: int(CHECKPOINT.fullmatch(path.name)[1]))


def latest(folder):
    """The newest checkpoint in a run folder (its highest step), or None."""
    found = checkpoints(folder)
    return found[-1] if found else None


def find_checkpoint(runs_dir, run=None):
    """The newest checkpoint of the run named `run`; None: of the run saved last.
    FileNotFoundError when there is none."""
    runs_dir = Path(runs_dir)
    runs = [runs_dir / run] if run else [folder for folder in runs_dir.glob("*") if folder.is_dir()]
    found = [path for path in map(latest, runs) if path]
    if not found:
        where = runs_dir / run if run else runs_dir
        raise FileNotFoundError(f"no checkpoint under {where}; train one first with `python train.py`")
    return max(found, key=lambda path: (path.stat().st_mtime, path.name))


# -----------------------------------------------------------------------------
# Digests: torch.load checks a checkpoint's zip framing, never its tensors' bytes.
# A byte changed on disk would load as a wrong weight, so each entry's tensors carry a sha256.
# sha256 runs at ~1.7 GB/s a core where the CPU hashes it natively (SHA-NI), and hashlib frees the GIL.
# So tensors hash on threads; docs/performance.md gives the cost.

def tensors_in(value, where=""):
    """The tensors of value (a tensor, or dicts and lists of them) as (where, tensor) pairs, in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [(where, value)]
    if isinstance(value, dict):
        return [pair for key, item in value.items() for pair in tensors_in(item, f"{where}/{key}")]
    if isinstance(value, (list, tuple)):
        return [pair for i, item in enumerate(value) for pair in tensors_in(item, f"{where}/{i}")]
    return []


def tensor_sha256(tensor):
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy()).digest()


def tensors_digest(value):
    """The sha256 of value's tensors: each one's place, dtype, shape and bytes, in tensors_in's order -> hex."""
    pairs = tensors_in(value)
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        hashes = pool.map(tensor_sha256, [tensor for _, tensor in pairs])
        digest = hashlib.sha256()
        for (where, tensor), each in zip(pairs, hashes):
            digest.update(f"{where} {tensor.dtype} {tuple(tensor.shape)}".encode() + each)
    return digest.hexdigest()


def weights_digest(ckpt):
    """A checkpoint's weights as 12 hex digits, which the ranks compare before they start.
    read_checkpoint checked the saved digest against them; one that predates digests is hashed here."""
    return (ckpt.get("digest", {}).get("model") or tensors_digest(ckpt["model"]))[:12]


def check_digest(ckpt, path, unused=()):
    """Each of ckpt's entries but the unused whose tensors differ from their saved digest: ValueError naming it."""
    for key, digest in ckpt.get("digest", {}).items():
        if key not in unused and tensors_digest(ckpt.get(key)) != digest:
            raise ValueError(f"checkpoint {path} is damaged: its {key} tensors differ from the digest saved with "
                             f"them; remove it to start the run over (a run keeps its newest checkpoint only), or "
                             f"restore it from a copy")


def check_tokenizer(ckpt, path, directory, remedy):
    """The tokenizer at directory must be the one checkpoint path was trained with: ValueError, else.
    remedy: what the refusal advises. A checkpoint that predates digests records none: any passes."""
    trained_with = ckpt.get("tokenizer_digest")
    if trained_with and (found := Tokenizer.files_digest(directory)) != trained_with:
        raise ValueError(f"the tokenizer at {directory} (digest {found}) is not the one {path} was "
                         f"trained with (digest {trained_with}); {remedy}")


def warn_if_undigested(ckpt, path):
    """A checkpoint saved before digests is used with a warning: refusing it would strand every run holding one."""
    if "digest" not in ckpt:
        print0(f"warning: checkpoint {path} carries no digest (it predates them), so damage to its bytes goes "
               f"unseen; the run's next save adds one", file=sys.stderr)


def read_checkpoint(path, device="cpu", mmap=False, unused=()):
    """The one reader of checkpoints: torch.load with weights_only=True, its digest checked (check_digest).
    mmap: tensors map the file on the CPU, read when first touched.
    unused: entries whose tensors the caller never reads, left unchecked.
    Raises FileNotFoundError if it is absent, ValueError naming it if it is unreadable or damaged."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist: pass a ckpt_*.pt file, or a run's name under "
                                f"{run_dir()} for its newest")
    try:
        ckpt = torch.load(path, map_location="cpu" if mmap else device, weights_only=True, mmap=mmap)
    except Exception as err:
        raise ValueError(f"checkpoint {path} is truncated or unreadable ({first_sentence(err)}): remove it to "
                         f"start the run over (a run keeps its newest checkpoint only), or restore it from a "
                         f"copy") from None
    check_digest(ckpt, path, unused)
    return ckpt


def sized_model(config):
    """A Parcae sized on the meta device, without weights or random init. Its RoPE tables are computed."""
    with torch.device("meta"):
        model = Parcae(config)
    model.init_buffers()
    return model


def assign_weights(model, state_dict, device="cpu"):
    """Give sized_model's model state_dict's tensors as its own -> the model in eval mode.
    Each is cast to the model's dtype where they differ, then moved to device.
    That is one copy at most; none for a CPU tensor already float32."""
    dtypes = {name: tensor.dtype for name, tensor in model.state_dict().items()}
    model.load_state_dict({name: tensor.to(dtypes.get(name, tensor.dtype)) for name, tensor in state_dict.items()},
                          assign=True)
    return model.to(device).eval()


def training_model(config, device, seed, weights=None, initialise=True):
    """The model a rank trains, on device, in train mode. The random init runs only where asked:

    - weights (a resume's state dict): sized without it, then given those tensors.
    - initialise: drawn at seed on the CPU, as a fresh run's rank 0 draws them.
    - neither: sized, its parameters left empty for DDP to broadcast rank 0's into."""
    if weights is not None:
        return assign_weights(sized_model(config), weights, device).train()
    if initialise:
        torch.manual_seed(seed)
        return Parcae(config).to(device)
    model = sized_model(config).to_empty(device=device)
    model.init_buffers()  # to_empty left the RoPE tables empty too
    return model.to(device)


def load_run(ckpt_or_run=None, device="cpu"):
    """-> (model in eval mode, its tokenizer, the checkpoint dict, the checkpoint's path). ckpt_or_run is:

    - a checkpoint file.
    - a run's name: its newest checkpoint under <base dir>/runs.
    - None: the newest checkpoint of the run written last.

    Only the weights are read, into a model without random init.
    The dict leaves out the optimizer's and loaders' states; its "model" is the model's state dict.

    The tokenizer is the one the checkpoint records.
    If that folder is gone (a moved NANOPARCAE_BASE_DIR), it is the same-named one in this base folder's tokenizers/.
    One other than the checkpoint was trained with (its files' digest), or whose vocabulary outgrows the model's,
    is refused. FileNotFoundError and ValueError carry one line."""
    path = Path(ckpt_or_run) if ckpt_or_run else None
    if path is not None and path.is_dir():
        newest = latest(path)
        raise FileNotFoundError(f"{path} is a folder, not a checkpoint file; pass a checkpoint file" +
                                (f" such as its newest, {newest}, or the run's name, {path.name}" if newest else
                                 ", or a run's name"))
    if path is None or not (path.is_file() or path.suffix == ".pt" or len(path.parts) > 1):
        path = find_checkpoint(run_dir(), ckpt_or_run)
    # mapped: only the weights are read (and checked), never the optimizer's or the loaders' state
    unused = ("optimizer", "loader")
    ckpt = read_checkpoint(path, mmap=True, unused=unused)
    try:  # torch read it, but it may hold no Parcae
        model = assign_weights(sized_model(ParcaeConfig(**ckpt["config"])), ckpt["model"], device)
    except Exception as err:
        raise ValueError(f"checkpoint {path} is not a nanoparcae checkpoint ({first_sentence(err)}); pass one that "
                         f"train.py wrote") from None
    if "tokenizer_dir" not in ckpt:
        raise ValueError(f"checkpoint {path} names no tokenizer_dir; it was not written by train.py")
    recorded = Path(ckpt["tokenizer_dir"])
    places = list(dict.fromkeys((recorded, tokenizer_dir(key=recorded.name))))  # its path, its key here
    directory = next((place for place in places if Tokenizer.saved(place)), None)
    if directory is None:
        run = ckpt.get("args", {})
        command = f"`python -m nanoparcae.dataset tokenizer --data={run['data']} --vocab_size={run['vocab_size']}`" \
            if {"data", "vocab_size"} <= run.keys() else \
            "`python -m nanoparcae.dataset tokenizer` and the run's --data and --vocab_size"
        where = f"neither at {places[0]} nor at {places[1]}" if len(places) > 1 else f"not at {places[0]}"
        raise FileNotFoundError(f"the tokenizer of checkpoint {path} is {where}; recreate it with {command}")
    tokenizer = Tokenizer.load(directory)  # a torn file is named before the digest differs
    check_tokenizer(ckpt, path, directory, f"put that tokenizer ({recorded}) back, or load a checkpoint "
                                           f"trained with this one")
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer at {directory} has {tokenizer.vocab_size} tokens, the model "
                         f"{model.config.vocab_size}: they are not from the same run")
    warn_if_undigested(ckpt, path)
    ckpt = {**{k: v for k, v in ckpt.items() if k not in unused}, "model": model.state_dict()}
    return model, tokenizer, ckpt, path
