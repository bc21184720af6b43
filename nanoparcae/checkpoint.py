"""
nanoparcae/checkpoint.py: a run's checkpoints, run_dir(run)/ckpt_<step>.pt, saved, found, and read back checked.
It reads, prunes and removes only the files it names itself, never through a link.
"""

import errno
import hashlib
import json
import os
import re
import shutil
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from nanoparcae.command import EnvironmentFailure, first_sentence, size
from nanoparcae.files import disk_full, get_base_dir, write_atomically
from nanoparcae.ranks import drift, gather, print0, rank_and_world, wait_for_rank0
from nanoparcae.tokenizer import Tokenizer, checkpoint_tokenizer

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")  # one folder name, never a path or a pattern
STEP = r"ckpt_([0-9]{6}|[1-9][0-9]{6,})"  # ckpt_{step:06d}, as save_and_prune names a checkpoint


def run_dir(name=None):
    """<base dir>/runs/<name>, a run's folder, or the folder of every run. A name no command could find is refused."""
    if name is not None and not RUN_NAME.fullmatch(name):
        raise ValueError(f"--run={name[:120]!r} is not a run name; use up to 100 letters, digits, '.', '_', '+' "
                         f"and '-', starting with a letter or digit")
    return get_base_dir() / "runs" / (name or "")


def checkpoints(folder, suffix=".pt"):
    """The regular files in a run folder named as STEP and suffix, oldest step first; the rest is the user's."""
    try:
        entries = list(os.scandir(folder))
    except OSError as err:
        if isinstance(err, FileNotFoundError) and not os.path.islink(folder):
            return []
        raise ValueError(f"run folder {folder} cannot be listed ({err.strerror}); fix or move that path, or pass "
                         f"another run") from None
    found = {int(own[1]): Path(entry.path) for entry in entries
             if (own := re.fullmatch(STEP + re.escape(suffix), entry.name)) and entry.is_file(follow_symlinks=False)}
    return [found[step] for step in sorted(found)]


def latest(folder):
    """The newest checkpoint in a run folder (its highest step), or None."""
    return (checkpoints(folder) or [None])[-1]


def remove_partial_saves(folder):
    """Remove, saying so, the partial files of saves a full disk or a kill cut short."""
    for partial in checkpoints(folder, ".pt.tmp"):
        print0(f"removed {partial} ({size(partial.stat().st_size)}), a checkpoint write that never finished")
        partial.unlink()


def find_checkpoint(runs_dir, run=None):
    """The newest checkpoint of the run named `run`, or of the run saved last. FileNotFoundError when none."""
    runs = [runs_dir / run] if run else [path for path in sorted(Path(runs_dir).glob("*"))
                                         if path.is_dir() or path.is_symlink()]
    if not (found := [path for path in map(latest, runs) if path]):
        raise FileNotFoundError(f"no checkpoint under {runs[0] if run else runs_dir}; train one first with "
                                f"`python train.py`")
    return max(found, key=lambda path: (path.stat().st_mtime, path.name))

# -----------------------------------------------------------------------------
# Saving. A checkpoint is finite before it is written, and the previous one stays until the new one reads back.


def save_checkpoint(path, model, **extra):
    """Write the model's weights and `extra`, signed, under a temporary name, read back, then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"config": asdict(model.config), "model": model.state_dict(), **extra}
    state["digest"] = digest_of(state)
    if shutil.disk_usage(path.parent).free < (need := saved_bytes(state)):
        disk_full(path.parent, f"a checkpoint needs {size(need)}")

    def write(partial):
        with open(partial, "wb") as file:  # Python's file raises a full disk's errno (files.write_atomically)
            torch.save(state, file)
        try:  # whole and finite, or never renamed
            read_checkpoint(partial, mmap=True, unused=("optimizer", "loader"))
        except ValueError as err:
            raise EnvironmentFailure(f"{path} did not read back as written, so it is not kept ({err})") from None
    write_atomically(path, write)


def saved_bytes(state):
    """An upper estimate of torch.save's file for `state`, in bytes: its tensors, 1 KiB each, and its text."""
    tensors = {}
    text = json.dumps(plain(state, tensors), default=lambda tensor: 0)
    return sum(tensor.nbytes + 1024 for tensor in tensors.values()) + len(text) + 2**16


def save_and_prune(folder, step, model, loaders, **state):
    """Write ckpt_<step>.pt on rank 0 with `state`, every virtual rank's loader position and the tokenizer's digest
    (the RNG state is a function of (seed, step, virtual rank)), then remove the older ones (13.4 GB each at the
    1.3B). Weights that are not finite, or that differ across ranks, stop every rank before anything is written."""
    weights = model.state_dict()
    if bad := next(filter(None, gather(non_finite(weights))), None):  # before drift, as NaN equals no NaN
        raise ValueError(f"at step {step} the run's weights are not finite ({bad}), so it diverged; nothing was "
                         f"saved, and its last checkpoint stays ({latest(folder) or 'none yet'}; see "
                         f"docs/troubleshooting.md)")
    if drifted := drift(weights):
        raise EnvironmentFailure(f"at step {step} the ranks' weights have drifted apart ({drifted}); nothing was "
                                 f"saved, and the same command resumes every rank from the last checkpoint")
    loader_states = [each for states in gather([loader.state_dict() for loader in loaders]) for each in states]
    if rank_and_world()[0] == 0:
        path, older = folder / f"ckpt_{step:06d}.pt", checkpoints(folder)
        tokenizer = Tokenizer.files_digest(state["tokenizer_dir"])  # the one the run trains with
        save_checkpoint(path, model, step=step, loader=loader_states, tokenizer_digest=tokenizer, **state)
        for stale in set(older) - {path}:
            stale.unlink(missing_ok=True)
        print0(f"saved {path}")
    wait_for_rank0()  # the others wait here, not in their next step's all-reduce, however slow the disk

# -----------------------------------------------------------------------------
# Digests. torch.load checks a checkpoint's zip framing, never its bytes, so an edit would load as another model.

DIGEST_FORMAT = 2  # the format this version signs; a checkpoint of another is refused


def plain(value, tensors):
    """value as JSON (keys typed, tuples as lists), each tensor its dtype, shape and itself, kept in tensors."""
    if isinstance(value, torch.Tensor):
        tensors[id(value)] = value
        return {"tensor": [str(value.dtype), list(value.shape), value]}
    if isinstance(value, dict):
        return {f"{type(key).__name__}:{key}": plain(item, tensors) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item, tensors) for item in value]
    json_value = value is None or isinstance(value, (bool, int, float, str))
    return value if json_value else {"object": f"{type(value).__qualname__} {value!r}"}


def entry_digests(state, keys):
    """{key: sha256 hex} of the entries of state named in keys, their tensors hashed on threads."""
    tensors = {}
    texts = {key: plain(state[key], tensors) for key in keys}
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        hashes = dict(zip(tensors, pool.map(lambda tensor: hashlib.sha256(
            tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest(), tensors.values())))
    return {key: hashlib.sha256(f"{key}\n{json.dumps(text, sort_keys=True, default=lambda t: hashes[id(t)])}"
                                .encode()).hexdigest() for key, text in texts.items()}


def digest_of(state):
    """The digest save_checkpoint writes: every entry's, and the format's marker."""
    return {"format": DIGEST_FORMAT, "entries": entry_digests(state, [key for key in state if key != "digest"])}


def check_digest(ckpt, path, unused=()):
    """Every entry of ckpt but `unused` checked against its digest."""
    digest = ckpt.get("digest")
    if digest is None or (isinstance(digest, dict) and "format" not in digest):  # nothing shows it whole
        raise ValueError(f"checkpoint {path} predates this version of nanoparcae's signed checkpoints; train the "
                         f"run again, or read it with the version that saved it")
    saved = digest.get("entries") if isinstance(digest, dict) and digest.get("format") == DIGEST_FORMAT else None
    if not (isinstance(saved, dict) and all(isinstance(each, str) for each in saved.values())):
        raise ValueError(f"checkpoint {path} is damaged, as its digest is of no form train.py writes; {advice(path)}")
    problems = [f"its {key} has no digest" for key in ckpt if key != "digest" and key not in saved]
    problems += [f"its digest names {key}, which it lacks" for key in saved if key == "digest" or key not in ckpt]
    found = entry_digests(ckpt, [key for key in saved if key in ckpt and key not in ("digest", *unused)])
    problems += [f"its {key} differs from the digest saved with it" for key in found if found[key] != saved[key]]
    if problems:
        raise ValueError(f"checkpoint {path} is damaged: {'; '.join(problems)}; {advice(path)}")


def weights_digest(ckpt):
    """A read checkpoint's weights as 12 hex digits, which the ranks compare before they start."""
    return ckpt["digest"]["entries"]["model"][:12]


def advice(path):
    """What a refusal of checkpoint path advises: removal only for a run's own ckpt_<step>.pt."""
    ours = re.fullmatch(STEP + r"\.pt", Path(path).name) and Path(path).resolve().parents[1] == run_dir().resolve()
    return ("remove it to start the run over (a run keeps its newest checkpoint only), or restore it from a copy"
            if ours else "restore it from a copy, or pass a checkpoint train.py wrote")


# -----------------------------------------------------------------------------
# Reading. Whatever a file holds, a refusal names it in one line.


def non_finite(weights):
    """Which of weights' tensors hold a NaN or an infinity, in a few words, or "" when none does."""
    bad = [name for name, tensor in weights.items() if tensor.is_floating_point() and not tensor.isfinite().all()]
    return bad and f"NaN or inf in {len(bad)} tensor(s): {', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}"


def read_checkpoint(path, device="cpu", mmap=False, unused=()):
    """The one reader of checkpoints, torch.load with weights_only=True, its form, digest and weights checked.
    `unused` names entries the caller never reads, left unhashed."""
    path = Path(path)
    try:
        ckpt = torch.load(path, map_location="cpu" if mmap else device, weights_only=True, mmap=mmap)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"checkpoint {path} does not exist; pass a ckpt_*.pt file, or a run's name under "
                                f"{run_dir()} for its newest") from None
    except IsADirectoryError:
        newest = f", such as its newest, {latest(path)}, or --run={path.name}" if latest(path) else ""
        raise ValueError(f"{path} is a folder, not a checkpoint file; pass one{newest}") from None
    except OSError as err:
        fix = "give this user permission to read it" if err.errno in (errno.EACCES, errno.EPERM) else "pass another"
        raise ValueError(f"checkpoint {path} cannot be read ({err.strerror or err}); {fix}") from None
    except Exception as err:
        with open(path, "rb") as file:  # torch.save's zip, or the start of one
            if b"PK\x03\x04".startswith(file.read(4)):
                whole = zipfile.is_zipfile(path)  # so memory (ulimit -v) or an edit inside refused it
                why = " ".join(str(err).split())[:300] if whole else first_sentence(err)  # the OS's cause last
                raise ValueError(f"checkpoint {path} is {'whole, yet' if whole else 'truncated, so'} unreadable ("
                                 f"{why}); " + "free memory or raise this process's limit if that names memory, "
                                 "else " * whole + advice(path)) from None
        ckpt = None

    def of(value, kinds):  # a dict of those kinds by name
        return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, kinds) for k, v in value.items())
    if not (isinstance(ckpt, dict) and of(ckpt.get("config"), (type(None), int, float, str))
            and of(ckpt.get("model"), torch.Tensor) and type(step := ckpt.get("step", 0)) is int and step >= 0):
        why = f"it holds a {type(ckpt).__name__}" if ckpt is not None else "torch.save writes a zip archive"
        raise ValueError(f"checkpoint {path} is not a nanoparcae checkpoint ({why}, not a config of plain values, a "
                         f"model's tensors and a step); pass one that train.py wrote")
    check_digest(ckpt, path, unused)
    if "model" not in unused and (bad := non_finite(ckpt["model"])):
        raise ValueError(f"checkpoint {path} holds non-finite weights ({bad}), so nothing can be computed from "
                         f"it; {advice(path)}")
    return ckpt


def load_run(run=None, ckpt=None):
    """The newest checkpoint of the run named `run`, the file `ckpt`, or with neither the run saved last -> (the
    checkpoint, its tokenizer, its path). Only the weights are read, mapped from the file."""
    path = Path(ckpt) if ckpt is not None else find_checkpoint(run_dir(), run and run_dir(run).name)
    ckpt = read_checkpoint(path, mmap=True, unused=(unused := ("optimizer", "loader")))
    return {key: value for key, value in ckpt.items() if key not in unused}, checkpoint_tokenizer(ckpt, path), path
