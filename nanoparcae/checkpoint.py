"""
nanoparcae/checkpoint.py: checkpoints, written and read: run_dir(run)/ckpt_<step>.pt, each a plain dict
that torch.load reads with weights_only=True; load_run rebuilds a trained model with its tokenizer, reading
its weights alone.
"""

from dataclasses import asdict
from pathlib import Path

import torch

from model import Parcae, ParcaeConfig
from nanoparcae.common import fail, first_sentence, get_base_dir, print0, rank_and_world, wait_for_rank0, \
    write_atomically
from nanoparcae.ranks import drift, gather
from nanoparcae.tokenizer import Tokenizer


def run_dir(name=""):
    """<base dir>/runs/<name>: a run's folder (no name: the folder that holds every run)."""
    return get_base_dir() / "runs" / name


def save_checkpoint(path, model, **extra):
    """Write to a temporary name, then rename: a killed run never leaves a torn checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"config": asdict(model.config), "model": model.state_dict(), **extra}
    write_atomically(path, lambda partial: torch.save(state, partial))


def save_and_prune(folder, step, model, loaders, **state):
    """ckpt_<step>.pt, written by rank 0 with every virtual rank's loader position and `state`; the run's
    older checkpoints are then removed (a 1.3B checkpoint with optimiser state is ~16 GB). The RNG state
    is a function of (seed, step, virtual rank), so nothing else is needed. Saves nothing, and stops the
    run (status 1), when the ranks' weights have drifted apart (ranks.drift)."""
    if drifted := drift(model.state_dict()):
        fail(f"at step {step} the ranks' weights have drifted apart: {drifted}; nothing saved: the run's "
             f"last checkpoint stays, and the same command resumes every rank from it", 1)
    loader_states = [each for states in gather([loader.state_dict() for loader in loaders]) for each in states]
    if rank_and_world()[0] == 0:
        path = folder / f"ckpt_{step:06d}.pt"
        older = sorted(folder.glob("ckpt_*.pt"))
        save_checkpoint(path, model, step=step, loader=loader_states, **state)
        for stale in older:
            if stale != path:
                stale.unlink()
        print0(f"saved {path}")
    wait_for_rank0()  # the others wait here, not in their next step's all-reduce, however slow the disk


def resume_refusal(folder):
    """--resume's refusal (a line) when the run folder holds no checkpoint, else None."""
    if not any(Path(folder).glob("ckpt_*.pt")):
        return f"there is no checkpoint of run {folder.name} under {folder} to resume; start it without --resume"
    return None


def find_checkpoint(runs_dir, run=None):
    """The newest checkpoint of `run`, or of the most recently written run when run is None."""
    runs_dir = Path(runs_dir)
    pattern = f"{run}/ckpt_*.pt" if run else "*/ckpt_*.pt"
    found = sorted(runs_dir.glob(pattern), key=lambda p: (p.stat().st_mtime, p.name))
    if not found:
        where = runs_dir / run if run else runs_dir
        raise FileNotFoundError(f"no checkpoint under {where}; train one first with `python train.py`")
    return found[-1]


def read_checkpoint(path, device="cpu", mmap=False):
    """torch.load of a checkpoint (weights_only=True), the one reader: train.py's resume and load_run. mmap: its
    tensors map the file, on the CPU, and are read when first touched. Raises FileNotFoundError when it is absent
    and ValueError naming it when torch cannot read it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location="cpu" if mmap else device, weights_only=True, mmap=mmap)
    except Exception as err:
        raise ValueError(f"checkpoint {path} is truncated or unreadable ({first_sentence(err)}): remove it to "
                         f"start the run over (a run keeps its newest checkpoint only), or restore it from a "
                         f"copy") from None


def sized_model(config):
    """A Parcae without weights, sized on the meta device (no random init), its RoPE tables computed."""
    with torch.device("meta"):
        model = Parcae(config)
    model.init_buffers()
    return model


def assign_weights(model, state_dict, device="cpu"):
    """sized_model's model, given state_dict's tensors as its own: cast to its dtypes where they differ, then moved
    to device, one copy at most (none for a CPU tensor already float32) -> the model in eval mode."""
    dtypes = {name: tensor.dtype for name, tensor in model.state_dict().items()}
    model.load_state_dict({name: tensor.to(dtypes.get(name, tensor.dtype)) for name, tensor in state_dict.items()},
                          assign=True)
    return model.to(device).eval()


def load_run(ckpt_or_run=None, device="cpu"):
    """A checkpoint file, a run's name (its newest checkpoint under <base dir>/runs) or None (the newest of the run
    written last) -> (model in eval mode, its tokenizer, the checkpoint dict, the checkpoint's path). Only the
    weights are read, into the model without a random init; the dict leaves out the optimizer's and the loaders'
    states, and its "model" is the model's state dict.

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
        path = find_checkpoint(run_dir(), ckpt_or_run)
    # Mapped, so that only the weights are read: the optimizer's state and the loaders' never are
    ckpt = read_checkpoint(path, mmap=True)
    try:  # torch read it, but it may hold no Parcae
        model = assign_weights(sized_model(ParcaeConfig(**ckpt["config"])), ckpt["model"], device)
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
        command = f"`python -m nanoparcae.dataset tokenizer --data={run['data']} --vocab_size={run['vocab_size']}`" \
            if {"data", "vocab_size"} <= run.keys() else \
            "`python -m nanoparcae.dataset tokenizer` and the run's --data and --vocab_size"
        where = f"neither at {places[0]} nor at {places[1]}" if len(places) > 1 else f"not at {places[0]}"
        raise FileNotFoundError(f"the tokenizer of checkpoint {path} is {where}; recreate it with {command}")
    tokenizer = Tokenizer.load(directory)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer at {directory} has {tokenizer.vocab_size} tokens, the model "
                         f"{model.config.vocab_size}: they are not from the same run")
    ckpt = {**{k: v for k, v in ckpt.items() if k not in ("optimizer", "loader")}, "model": model.state_dict()}
    return model, tokenizer, ckpt, path
