"""
nanoparcae/checkpoint.py: checkpoint files, written, found and read back checked.
Each is run_dir(run)/ckpt_<step>.pt, a plain dict torch.load reads with weights_only=True.
Its jobs:

- write a checkpoint and prune the older ones (save_checkpoint, save_and_prune).
- find a run's newest (latest, find_checkpoint).
- read one checked: its form, each entry against its digest, its weights finite (read_checkpoint).
- build a model from its weights, without a random init where none is kept (training_model).
- load a trained run's model and tokenizer (load_run).
"""

import hashlib
import json
import os
import re
import shutil
import stat
import sys
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from model import Parcae, ParcaeConfig
from nanoparcae.command import EnvironmentFailure, first_sentence, size
from nanoparcae.files import FULL_DISK, disk_full, get_base_dir, write_atomically
from nanoparcae.ranks import print0, rank_and_world, wait_for_rank0, drift, gather
from nanoparcae.dataset import tokenizer_dir
from nanoparcae.tokenizer import Tokenizer


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")  # TEMP shim: helper "ckpt"'s rule; drop at merge


def run_dir(name=""):
    """<base dir>/runs/<name>: a run's folder. No name: the folder holding every run."""
    if name and not RUN_NAME.fullmatch(name):  # TEMP shim: helper "ckpt"'s rule; drop at merge
        raise ValueError(f"--run={name[:120]!r} is not a run name; use up to 100 letters, digits, '.', '_', '+' "
                         f"and '-', starting with a letter or digit")
    return get_base_dir() / "runs" / name


def save_checkpoint(path, model, **extra):
    """Write under a temporary name, then rename. A killed run never leaves a torn checkpoint.
    A disk or quota without room raises EnvironmentFailure (refuse_if_refused_room); the last checkpoint stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"config": asdict(model.config), "model": model.state_dict(), **extra}
    state["digest"] = digest_of(state)
    need = saved_bytes(state)
    if shutil.disk_usage(path.parent).free < need:
        disk_full(path.parent, f"a checkpoint needs {size(need)}")

    def write(partial):
        try:
            torch.save(state, partial)
        except (OSError, RuntimeError) as err:
            refuse_if_refused_room(err, path, partial, need)
            raise
    write_atomically(path, write)


# What torch's zip writer raises when a write fails (a disk or a quota refused it), with no errno
TORCH_WRITE_FAILED = re.compile(r"unexpected pos|failed writing|file write failed|iostream error")
ENFORCE = re.compile(r"^\[enforce fail at [^]]*\][\s.]*")  # the prefix of torch's own checks' messages


def refuse_if_refused_room(err, path, partial, need):
    """A checkpoint write a full disk or a quota cut short: EnvironmentFailure, its partial file removed.
    torch's writer gives no errno. Free space below what is left to write says a full disk.
    A quota leaves free space showing, so torch's own write error says it. Anything else returns."""
    written = partial.stat().st_size if partial.exists() else 0
    if getattr(err, "errno", None) in FULL_DISK or shutil.disk_usage(path.parent).free < need - written:
        partial.unlink(missing_ok=True)
        disk_full(path.parent, f"a checkpoint needs {size(need)}")
    if isinstance(err, RuntimeError) and TORCH_WRITE_FAILED.search(str(err)):
        partial.unlink(missing_ok=True)
        torch_says = first_sentence(RuntimeError(ENFORCE.sub("", str(err))))
        raise EnvironmentFailure(f"{path} could not be written ({torch_says}) though "
                                 f"{size(shutil.disk_usage(path.parent).free)} shows free at {path.parent}: a quota "
                                 f"or the disk refused it; the last checkpoint is kept: free space or raise the "
                                 f"quota there, then the same command continues from it") from None


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
    found = [Path(folder) / name for name in folder_names(folder) if CHECKPOINT.fullmatch(name)]
    return sorted(found, key=lambda path: int(CHECKPOINT.fullmatch(path.name)[1]))


def folder_names(folder, what="run folder"):
    """The names in a run folder (or the runs' folder); none where it does not exist.
    A file there, a dangling symlink or a folder this user cannot read: ValueError naming it."""
    folder = Path(folder)
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        if not folder.is_symlink():
            return []
        why = f"a symlink to {os.readlink(folder)}, which does not exist"
    except NotADirectoryError:
        why = "a file, not a folder" if folder.exists() else "under a file, not a folder"
    except PermissionError:
        why = "a folder this user may not read (permission denied)"
    raise ValueError(f"{what} {folder} is {why}; fix or move that path, or pass another run") from None


def latest(folder):
    """The newest checkpoint in a run folder (its highest step), or None."""
    found = checkpoints(folder)
    return found[-1] if found else None


def find_checkpoint(runs_dir, run=None):
    """The newest checkpoint of the run named `run`; None: of the run saved last.
    FileNotFoundError when there is none."""
    runs_dir = Path(runs_dir)
    runs = [runs_dir / run] if run else [runs_dir / name for name in folder_names(runs_dir, "the runs' folder")
                                         if (runs_dir / name).is_dir() or (runs_dir / name).is_symlink()]
    found = [path for path in map(latest, runs) if path]
    if not found:
        where = runs_dir / run if run else runs_dir
        raise FileNotFoundError(f"no checkpoint under {where}; train one first with `python train.py`")
    return max(found, key=lambda path: (path.stat().st_mtime, path.name))


# -----------------------------------------------------------------------------
# Digests: torch.load checks a checkpoint's zip framing, never its bytes.
# A byte changed on disk, or an entry edited, would load as another model or step.
# So each entry carries a sha256 of its plain values and its tensors' bytes.
# sha256 runs at ~1.7 GB/s a core where the CPU hashes it natively (SHA-NI), and hashlib frees the GIL.
# So tensors hash on threads, in one pass; docs/performance.md gives the cost.

DIGEST_FORMAT = 2  # every entry signed; an earlier version's digest (no marker) signed the tensors alone


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


def hashed(tensors):
    """{id(tensor): its bytes' sha256 in hex} for tensors, hashed on threads."""
    unique = list({id(tensor): tensor for tensor in tensors}.values())
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        return {id(tensor): each.hex() for tensor, each in zip(unique, pool.map(tensor_sha256, unique))}


def tensors_digest(value):
    """The sha256 of value's tensors: each one's place, dtype, shape and bytes, in tensors_in's order -> hex.
    An earlier version's digest of an entry, still read."""
    pairs = tensors_in(value)
    hashes = hashed([tensor for _, tensor in pairs])
    digest = hashlib.sha256()
    for where, tensor in pairs:
        digest.update(f"{where} {tensor.dtype} {tuple(tensor.shape)}".encode() + bytes.fromhex(hashes[id(tensor)]))
    return digest.hexdigest()


def plain(value, hashes):
    """value as JSON, each tensor its dtype, shape and sha256 (hashes): a canonical text of the entry.
    Dict keys carry their type, so 1 and "1" differ; a tuple reads as a list."""
    if isinstance(value, torch.Tensor):
        return {"tensor": [str(value.dtype), list(value.shape), hashes[id(value)]]}
    if isinstance(value, dict):
        return {f"{type(key).__name__}:{key}": plain(item, hashes) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item, hashes) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"object": f"{type(value).__qualname__} {value!r}"}


def entry_digests(state, keys):
    """{key: sha256 hex} of state's entries named in keys: the key, its plain values and its tensors' bytes."""
    hashes = hashed([tensor for key in keys for _, tensor in tensors_in(state[key])])
    return {key: hashlib.sha256(f"{key}\n{json.dumps(plain(state[key], hashes), sort_keys=True)}".encode()).hexdigest()
            for key in keys}


def digest_of(state):
    """The digest save_checkpoint writes: every entry's (entry_digests), and the format's marker."""
    return {"format": DIGEST_FORMAT, "entries": entry_digests(state, [key for key in state if key != "digest"])}


def saved_digests(ckpt, path):
    """The digests ckpt was saved with -> ({entry: digest}, the entries they must cover, its format).
    An earlier version's covers the entries holding tensors. A digest of neither form: ValueError."""
    digest, entries = ckpt["digest"], [key for key in ckpt if key != "digest"]
    if isinstance(digest, dict) and digest.keys() == {"format", "entries"} and digest["format"] == DIGEST_FORMAT:
        saved, form = digest["entries"], DIGEST_FORMAT
    else:
        saved, form = digest, 1
        entries = [key for key in entries if tensors_in(ckpt[key])]
    if not (isinstance(saved, dict) and all(isinstance(each, str) for each in saved.values())):
        raise ValueError(f"checkpoint {path} is damaged: its digest is a {type(digest).__name__} of no form "
                         f"train.py writes; {advice(path)}")
    return saved, entries, form


def check_digest(ckpt, path, unused=()):
    """ckpt's entries against the digests saved with them. One without any (it predates them) passes.
    Every entry must have its digest and every digest its entry; unused: entries found but not hashed.
    Any difference: ValueError naming the checkpoint and the entry."""
    if "digest" not in ckpt:
        return
    saved, entries, form = saved_digests(ckpt, path)
    problems = [f"its {key} has no digest" for key in entries if key not in saved]
    problems += [f"its digest names {key}, which it lacks" for key in saved if key == "digest" or key not in ckpt]
    checked = [key for key in saved if key in entries and key not in unused]
    found = (entry_digests(ckpt, checked) if form == DIGEST_FORMAT else
             {key: tensors_digest(ckpt[key]) for key in checked})
    problems += [f"its {key} differs from the digest saved with it" for key in checked if found[key] != saved[key]]
    if problems:
        raise ValueError(f"checkpoint {path} is damaged: {'; '.join(problems)}; {advice(path)}")


def weights_digest(ckpt):
    """A checkpoint's weights as 12 hex digits, which the ranks compare before they start.
    read_checkpoint checked the saved digest against them; one that predates digests is hashed here."""
    if "digest" not in ckpt:
        return entry_digests(ckpt, ["model"])["model"][:12]
    return saved_digests(ckpt, "")[0]["model"][:12]


def advice(path):
    """What a refusal of checkpoint path advises. Removal only for a run's own ckpt_<step>.pt, which train.py wrote."""
    try:
        runs = run_dir().resolve()
    except ValueError:  # a base folder that cannot be written holds nothing this command could start over
        runs = None
    path = Path(path).resolve()
    if CHECKPOINT.fullmatch(path.name) and path.parent.parent == runs:
        return "remove it to start the run over (a run keeps its newest checkpoint only), or restore it from a copy"
    return "restore it from a copy, or pass a checkpoint train.py wrote"


def check_tokenizer(ckpt, path, directory, remedy):
    """The tokenizer at directory must be the one checkpoint path was trained with: ValueError, else.
    remedy: what the refusal advises. A checkpoint that predates digests records none: any passes."""
    trained_with = ckpt.get("tokenizer_digest")
    if trained_with and (found := Tokenizer.files_digest(directory)) != trained_with:
        raise ValueError(f"the tokenizer at {directory} (digest {found}) is not the one {path} was "
                         f"trained with (digest {trained_with}); {remedy}")


def warn_if_undigested(ckpt, path):
    """A checkpoint saved before digests, or before they covered every entry, is used with a warning.
    Refusing it would strand every run holding one."""
    digest = ckpt.get("digest")
    if digest is None:
        unchecked = "carries no digest (it predates them), so damage to its bytes goes unseen"
    elif digest.get("format") != DIGEST_FORMAT:
        unchecked = "carries an earlier version's digest, of its tensors alone, so an edit to its config or step " \
                    "goes unseen"
    else:
        return
    print0(f"warning: checkpoint {path} {unchecked}; the run's next save signs it whole", file=sys.stderr)


# -----------------------------------------------------------------------------
# Reading: whatever a file holds, a refusal names it in one line

CONFIG_TYPES = typing.get_type_hints(ParcaeConfig)


def of_type(value, hint):
    """Whether a config value has its field's type: an int passes for a float, a bool for no int."""
    kinds = typing.get_args(hint) or (hint,)
    kinds += (int,) if float in kinds else ()
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)


def form_problem(ckpt):
    """What keeps ckpt from being the dict save_checkpoint writes, or None.
    That is a config ParcaeConfig takes, a model state dict and a step."""
    if not isinstance(ckpt, dict):
        return f"it holds a {type(ckpt).__name__}, not a dict"
    if missing := [key for key in ("config", "model") if key not in ckpt]:
        return f"it has no {' or '.join(missing)}"
    config, model, step = ckpt["config"], ckpt["model"], ckpt.get("step", 0)
    if not isinstance(config, dict):
        return f"its config is a {type(config).__name__}, not a dict"
    if wrong := [f"{key}={value!r}"[:60] for key, value in config.items()
                 if key not in CONFIG_TYPES or not of_type(value, CONFIG_TYPES[key])]:
        return f"its config has {', '.join(wrong[:3])}: no field of a model's config takes that"
    if not isinstance(model, dict) or not all(isinstance(key, str) and isinstance(value, torch.Tensor)
                                              for key, value in model.items()):
        return "its model is not a state dict of tensors"
    if not of_type(step, int) or step < 0:
        return f"its step is {step!r}"[:60]
    try:
        ParcaeConfig(**config)
    except ValueError as err:
        return f"its config: {first_sentence(err)}"
    return None


def check_finite(ckpt, path):
    """Weights holding a NaN or an infinity: ValueError naming the file and the tensors, whatever the digest says.
    One float32 sum a tensor shows either; only a sum that overflowed is looked at closely."""
    floats = {name: tensor for name, tensor in ckpt["model"].items() if tensor.is_floating_point()}
    sums = [tensor.sum(dtype=torch.float32) for tensor in floats.values()]
    if not sums or torch.stack(sums).isfinite().all():
        return
    bad = [name for name, tensor in floats.items() if not torch.isfinite(tensor).all()]
    if bad:
        raise ValueError(f"checkpoint {path} holds non-finite weights (NaN or inf in {len(bad)} tensor(s): "
                         f"{', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); nothing can be computed from "
                         f"it: {advice(path)}")


def not_ours(path, why):
    """The refusal of a file that holds no checkpoint train.py wrote: a user's, never to be removed."""
    return ValueError(f"checkpoint {path} is not a nanoparcae checkpoint ({why}); pass one that train.py wrote")


def unreadable(path, err):
    """The refusal of a checkpoint the machine would not read (permission denied, an I/O error)."""
    return ValueError(f"checkpoint {path} cannot be read ({err.strerror or err}); give this user permission to read "
                      f"it, or pass another")


def file_mode(path):
    """path's st_mode, or None where nothing is there. A path this user may not reach: ValueError naming it."""
    try:
        return path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        raise unreadable(path, err) from None


def read_checkpoint(path, device="cpu", mmap=False, unused=()):
    """The one reader of checkpoints: torch.load with weights_only=True, then checked before any use.
    Its form (form_problem), its digest (check_digest), and its weights finite (check_finite).
    mmap: tensors map the file on the CPU, read when first touched.
    unused: entries the caller never reads, left unhashed; "model" among them: weights unchecked too.
    Raises FileNotFoundError if it is absent; ValueError naming it, one line, for anything else."""
    path = Path(path)
    mode = file_mode(path)
    if mode is None:
        raise FileNotFoundError(f"checkpoint {path} does not exist: pass a ckpt_*.pt file, or a run's name under "
                                f"{run_dir()} for its newest")
    if stat.S_ISDIR(mode):
        raise ValueError(f"checkpoint {path} is a folder, not a checkpoint file; pass a ckpt_*.pt file")
    try:
        ckpt = torch.load(path, map_location="cpu" if mmap else device, weights_only=True, mmap=mmap)
    except OSError as err:
        raise unreadable(path, err) from None
    except Exception as err:
        with open(path, "rb") as file:
            zipped = b"PK\x03\x04".startswith(file.read(4))  # torch.save's zip (or none of it): cut short
        if zipped:
            raise ValueError(f"checkpoint {path} is truncated or unreadable ({first_sentence(err)}): "
                             f"{advice(path)}") from None
        raise not_ours(path, "torch.save writes a zip archive, and it is none") from None
    if why := form_problem(ckpt):
        raise not_ours(path, why)
    check_digest(ckpt, path, unused)
    if "model" not in unused:
        check_finite(ckpt, path)
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
    mode = path and file_mode(path)
    if mode and stat.S_ISDIR(mode):
        newest = latest(path)
        raise FileNotFoundError(f"{path} is a folder, not a checkpoint file; pass a checkpoint file" +
                                (f" such as its newest, {newest}, or the run's name, {path.name}" if newest else
                                 ", or a run's name"))
    if path is None or not (mode or path.suffix == ".pt" or len(path.parts) > 1):
        path = find_checkpoint(run_dir(), ckpt_or_run)
    # mapped: only the weights are read (and checked), never the optimizer's or the loaders' state
    unused = ("optimizer", "loader")
    ckpt = read_checkpoint(path, mmap=True, unused=unused)
    try:  # torch read it, but it may hold no Parcae
        model = assign_weights(sized_model(ParcaeConfig(**ckpt["config"])), ckpt["model"], device)
    except Exception as err:
        raise not_ours(path, first_sentence(err)) from None
    if not isinstance(ckpt.get("tokenizer_dir"), str):
        raise not_ours(path, "it names no tokenizer_dir")
    recorded = Path(ckpt["tokenizer_dir"])
    places = list(dict.fromkeys((recorded, tokenizer_dir(key=recorded.name))))  # its path, its key here
    directory = next((place for place in places if Tokenizer.saved(place)), None)
    if directory is None:
        run = ckpt["args"] if isinstance(ckpt.get("args"), dict) else {}
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
