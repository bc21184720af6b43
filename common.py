"""
common.py: what every script shares and the model does not need: process setup, the base directory,
checkpoints, MFU (the GPU peak table and the matmul FLOPs executed), and the timing of the benchmarks.

model.py imports only depths.py, and data.py only tokenizer.py and download.py (this file takes the base directory
from data.py); train.py, eval_core.py, core_tasks.py and sample.py import this file, as do the experiments and interop/.
"""

import math
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from data import cache_dir
from depths import mean_steps
from model import Block, Parcae, ParcaeConfig

# -----------------------------------------------------------------------------
# Processes: torchrun sets RANK; NCCL on CUDA, gloo on CPU. A plain `python` run is one process.


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

get_base_dir = cache_dir  # $NANOPARCAE_BASE_DIR (default ~/.cache/nanoparcae), kept in data.py, which needs it too


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


# Checkpoints written before the injection was a submodule of Parcae hold its parameters under bare names
OLD_INJECTION_NAMES = ("A_log", "dt_bias", "B.weight", "adapter.weight")


def read_checkpoint(path, device="cpu"):
    """torch.load of a checkpoint (weights_only=True), its parameters under today's names: what every loader
    of our checkpoints reads (load_checkpoint, train.py's resume). An old checkpoint's A_log, dt_bias,
    B.weight and adapter.weight become injection.A_log ..., in the weights and in the optimiser's names."""
    ckpt = torch.load(path, map_location=device, weights_only=True)

    def renamed(name):
        return f"injection.{name}" if name in OLD_INJECTION_NAMES else name

    ckpt["model"] = {renamed(name): tensor for name, tensor in ckpt["model"].items()}
    for group in ckpt.get("optimizer", {}).get("param_groups", []):
        group["names"] = [renamed(name) for name in group["names"]]
    return ckpt


def load_optimizer_state(optimizer, saved):
    """optimizer.load_state_dict(saved), each saved parameter's state matched to ours by name (the groups'
    "names", optim.build_optimizer), not by position: an old checkpoint lists the injection's parameters
    elsewhere in the order. A name we lack raises KeyError."""
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        index = dict(zip(saved_group["names"], saved_group["params"]))
        saved_group["params"] = [index[name] for name in group["names"]]
        saved_group["names"] = group["names"]
    optimizer.load_state_dict(saved)


def load_checkpoint(path, device="cpu"):
    """-> (model in eval mode, the checkpoint dict). Never unpickles code (weights_only=True)."""
    path = Path(path)
    if path.is_dir():
        inside = sorted(path.glob("ckpt_*.pt"))
        raise FileNotFoundError(f"{path} is a folder, not a checkpoint file; pass --ckpt with a file" +
                                (f" such as its newest, {inside[-1]}, or --run={path.name}" if inside else
                                 ", or --run with a run name"))
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist; pass --ckpt with an existing file")
    try:
        ckpt = read_checkpoint(path, device)
        model = Parcae(ParcaeConfig(**ckpt["config"]))
        model.load_state_dict(ckpt["model"])
    except Exception as err:
        raise ValueError(f"checkpoint {path} is truncated, corrupt or not a nanoparcae checkpoint "
                         f"({first_sentence(err)}); pass --ckpt with another one (an earlier ckpt_*.pt of the run) "
                         f"or train again") from None
    return model.to(device).eval(), ckpt


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
# MFU: the matmul FLOPs executed (matmul_flops_per_token) against the GPU's peak

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, per GPU


def peak_bf16_flops(device):
    """The GPU's dense bf16 peak, the denominator of MFU; None on a CPU or an unlisted GPU."""
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else ""
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def matmul_flops_per_token(model, n=None, k=None, backward=True):
    """The matmul FLOPs a Parcae model executes per token in a training forward + backward (backward=False: a
    forward alone): the numerator of MFU and of every FLOP/s figure (METHOD.md §2). Parcae.flops_per_token is the
    paper's C, for budgets.

    n, k: loop steps per sequence without and with gradient, numbers or per-sequence tensors (their means
    count: each sequence runs its own steps); None: config.sampling's expected steps (depths.mean_steps).
    A forward runs 2 FLOPs per token for every nn.Linear weight, 2 d V for the tied head and, in each block,
    2 S d for QK^T and 2 S d for AV: causal attention counted in full over S, as FlopCounterMode counts SDPA
    and PaLM's MFU and nanochat's estimate_flops count attention. A backward runs twice its forward (input
    and weight gradients): the prelude, Bbar e, C_proj, coda and head cost 3x their forward (Bbar e enters
    every step with gradient, k >= 1 in every sampler, so the prelude is backpropagated in full), a loop step
    with gradient 3x, one without 1x. backward=False runs all n + k steps 1x. The embedding lookups (wte,
    value embeddings) are not matmuls. The Transformer runs its blocks once, whatever n and k.
    """
    c = model.config

    def forward_flops(modules):
        parts = [m for module in modules for m in module.modules()]
        linears = sum(m.weight.numel() for m in parts if isinstance(m, torch.nn.Linear))
        return 2 * linears + sum(isinstance(m, Block) for m in parts) * 4 * c.seq_len * c.d_model

    # per loop step: the recurrent blocks, and concat's adapter (Parcae's B makes Bbar e once per forward)
    per_step = [*model.recur, *([model.injection] if c.injection == "concat" else [])] \
        if model.injection is not None else []
    step = forward_flops(per_step)
    once = forward_flops([model]) - step + 2 * model.wte.weight.numel()
    if model.injection is None:
        return (3 if backward else 1) * once
    if n is None:
        n, k = mean_steps(c)
    n, k = (torch.as_tensor(x, dtype=torch.float64, device="cpu").mean().item() for x in (n, k))
    return 3 * once + (n + 3 * k) * step if backward else once + (n + k) * step


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


# -----------------------------------------------------------------------------
# Measuring (experiments/bench.py and decoding.py): progress on stderr, interleaved repeats timed and their
# medians, one markdown table

def log(message):
    print(message, file=sys.stderr, flush=True)


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    synchronize()
    t0 = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - t0


def median_seconds(fns, repeats, warmup=1):
    """{name: fn} -> {name: median seconds of fn()}; warm-up calls first, then the fns take turns each repeat."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    seconds = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            seconds[name].append(timed(fn))
    return {name: statistics.median(s) for name, s in seconds.items()}


def print_table(rows, what):
    print(f"| # | {what} | result | ratio | target |")
    print("|---|---|---|---|---|")
    for cells in rows:
        print("| " + " | ".join(cells) + " |")
