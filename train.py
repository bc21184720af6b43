"""
train.py: train Parcae (or a baseline) with the paper's recipe (METHOD.md §2), from a laptop CPU to 8 GPUs.

    python train.py                                            # no GPU: a small looped model on the
                                                               # stdlib corpus, no download, minutes
    torchrun --nproc_per_node=8 train.py --depth=24 --mu_rec=8 # the paper's 1.3B on FineWeb-Edu
    python train.py --depth=24 --mu_rec=8 --dry_run            # print sizes, tokens and FLOPs only

Every optimiser step sees the same rows, depths and h0 whatever the number of processes: its
micro-batches are "virtual ranks" v = rank * grad_accum + micro, each with its own share of the data
and its own seed. So two processes reproduce one, and --resume continues a run exactly; workers that
torchrun --max_restarts restarts after a failure resume from the last checkpoint by themselves.

A run folder that holds a checkpoint is continued from it, never restarted: the same command after a crash picks
up where the run stopped, with the same data order; a finished run exits at once; a new --run starts afresh.

A run whose loss or gradients are non-finite for --diverge_steps consecutive steps, or whose validation loss is
non-finite, far above a uniform guess's ln(vocab_size) (by LOST_MARGIN), or above it after an eval had been that far
below it, is declared diverged: it logs "diverged at step N" (the streak's first step, or the eval's) and which
checkpoint it keeps, writes {"diverged_at": N} to metrics.jsonl and exits with status 3. A large state ||h_T|| is
a bad step of that streak only in bfloat16, where past ~1e4 the input no longer registers beside it
(--diverge_h_norm); in float32 it is logged as a warning, never a stop.
"""

import argparse
import json
import math
import os
import pickle
import signal
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common import (find_checkpoint, first_sentence, get_base_dir, init_distributed, peak_bf16_flops, rank_and_world,
                    read_checkpoint, save_checkpoint, state_norm_limit, write_atomically)
from core_tasks import download_eval_bundle
from data import DataLoader, get_tokenizer, tokenizer_dir, val_batches
from depths import SAMPLINGS
from eval_core import evaluate_bpb, evaluate_core
from model import Parcae, ParcaeConfig
from optim import build_optimizer, learning_rate_for_depth, lr_multiplier, muon_momentum, weight_decay_at

# -----------------------------------------------------------------------------
# Flags. Two presets fill the ones left unset: the paper's setup (METHOD.md §2), and, on a machine with no
# GPU when no --depth is given, a small model on the stdlib corpus that trains in minutes. --help lists both.

CUDA = torch.cuda.is_available()
PAPER_TOKENS = {6: 11.2e9, 12: 29.6e9, 18: 61.6e9, 24: 104e9}  # METHOD.md §1: tokens trained per size
PAPER = dict(depth=6, head_dim=128, mu_rec=8, vocab_size=32768, seq_len=2048, device_batch_size=32,
             total_batch_size=524_288, eval_every=250, eval_tokens=10 * 524_288, core_every=2000,
             save_every=1000, log_every=1, compile=int(CUDA), dtype="bfloat16" if CUDA else "float32",
             data="fineweb-edu")
SMALL = dict(depth=3, d_model=128, head_dim=64, mu_rec=4, vocab_size=4096, seq_len=256, device_batch_size=16,
             total_batch_size=8192, max_tokens=3.2e6, eval_every=130, eval_tokens=65_536, core_every=-1,
             save_every=130, log_every=20, compile=0, dtype="float32", data="stdlib")

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="The CPU preset applies on a machine with no GPU when --depth is not given; "
                                        "the paper preset otherwise. A flag given explicitly always wins.")
parser.add_argument("--depth", type=int, help="layers, L_P = L_R = L_C = depth/3; 6/12/18/24 = 140M..1.3B")
parser.add_argument("--d_model", type=int, help="width")
parser.add_argument("--head_dim", type=int)
parser.add_argument("--mu_rec", type=int, help="mean recurrence depth")
parser.add_argument("--mu_bwd", type=int, help="backpropagated depth (default ceil(mu_rec/2))")
parser.add_argument("--injection", default="diagonal", choices=["diagonal", "concat", "add", "none"],
                    help="diagonal = Parcae, concat = RDM, add, none = fixed-depth Transformer")
parser.add_argument("--sampling", default="per_sequence", choices=list(SAMPLINGS), metavar="SCHEME",
                    help=f"recurrence-depth sampler, one of {', '.join(SAMPLINGS)} (depths.py says what each draws)")
parser.add_argument("--prelude_norm", type=int, default=1, choices=[0, 1])
parser.add_argument("--vocab_size", type=int)
parser.add_argument("--seq_len", type=int)
parser.add_argument("--device_batch_size", type=int, help="sequences per micro-batch per process")
parser.add_argument("--total_batch_size", type=int, help="tokens per optimiser step")
parser.add_argument("--max_tokens", type=float, help="training horizon in tokens")
parser.add_argument("--param_data_ratio", type=float, help="horizon as tokens per parameter")
parser.add_argument("--target_flops", type=float, help="horizon as total training FLOPs")
parser.add_argument("--adamw_lr", type=float, help="default 8e-3 (140M, 370M) or 6e-3 (770M, 1.3B)")
parser.add_argument("--muon_lr", type=float, default=8e-3)
parser.add_argument("--weight_decay", type=float, default=0.2, help="Muon's cautious weight decay")
parser.add_argument("--optimizer", default="muon", choices=["muon", "adamw"],
                    help="muon: the recipe, Muon on the blocks' matrices and AdamW on the rest; adamw: AdamW on all")
parser.add_argument("--grad_clip", type=float, default=1.0)
parser.add_argument("--warmdown_frac", type=float, default=0.5)
parser.add_argument("--eval_every", type=int, help="steps between validation evals")
parser.add_argument("--eval_tokens", type=int, help="validation tokens per eval")
parser.add_argument("--core_every", type=int, help="steps between CORE evals (-1: never; also at the end)")
parser.add_argument("--core_max_per_task", type=int, default=500, help="CORE examples per task during training")
parser.add_argument("--save_every", type=int, help="steps between checkpoints")
parser.add_argument("--log_every", type=int)
parser.add_argument("--diverge_steps", type=int, default=5,
                    help="bad steps in a row that declare the run diverged (0: never, nor by the val loss)")
parser.add_argument("--diverge_h_norm", type=float,
                    help="a state norm ||h_T|| that is a bad step in any dtype (default: 1e4 in bf16 only)")
parser.add_argument("--resume", action="store_true",
                    help="require a checkpoint to continue from (a run folder holding one is continued without it too)")
parser.add_argument("--compile", type=int, choices=[0, 1], help="torch.compile the blocks")
parser.add_argument("--compile_backend", default="inductor", choices=["inductor", "eager"],
                    help="eager: dynamo's tracing and guards without code generation (counts recompilations fast)")
parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                    help="autocast dtype of the matmuls (bfloat16 on a CPU runs the GPU's numerics)")
parser.add_argument("--data", help="fineweb-edu, stdlib, or a path / glob of .txt, .jsonl, .parquet files")
parser.add_argument("--run", help="run name (default d<depth>_<injection>)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--dry_run", action="store_true", help="print the resolved configuration and exit")
parser.add_argument("--stop_at", type=int, help="end this invocation after that step (continue with --resume)")
PAPER_HELP = {**PAPER, "d_model": "128 * (depth/3 + 4)", "compile": "1 on CUDA", "dtype": "bfloat16 on CUDA",
              "max_tokens": "the paper's for the depth, " + ", ".join(f"{t:.3g}" for t in PAPER_TOKENS.values())}
for action in parser._actions:  # --help shows what a run will use: the preset's value, or the fixed default
    if action.dest in SMALL:
        action.help = f"{action.help or ''} (paper preset: {PAPER_HELP[action.dest]}; " \
                      f"CPU preset: {SMALL[action.dest]})".lstrip()
    elif action.default not in (None, False, argparse.SUPPRESS):
        action.help = f"{action.help or ''} (default: {action.default})".lstrip()
args = parser.parse_args()
preset = SMALL if not CUDA and args.depth is None else PAPER
for name, value in preset.items():
    if getattr(args, name) is None:
        setattr(args, name, value)


def fail(message):
    """One clear line instead of a traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def read_faults(text):
    """The faults the tests inject, from NANOPARCAE_FAULT="nan_step=2,nan_steps=3,kill_step=6": the gradients of
    nan_steps steps from nan_step made non-finite; the last rank SIGKILLed after kill_step (first attempt only)."""
    faults = dict(nan_step=None, nan_steps=1, kill_step=None)
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in faults or not value.isdigit():
            fail(f"NANOPARCAE_FAULT: {item!r} is not one of nan_step=N, nan_steps=N, kill_step=N")
        faults[name] = int(value)
    return faults


fault = read_faults(os.environ.get("NANOPARCAE_FAULT", ""))


# -----------------------------------------------------------------------------
# Model configuration and the training horizon

try:
    config = ParcaeConfig.from_depth(
        args.depth, vocab_size=args.vocab_size, seq_len=args.seq_len, head_dim=args.head_dim, mu_rec=args.mu_rec,
        mu_bwd=args.mu_bwd, injection=args.injection, sampling=args.sampling, prelude_norm=bool(args.prelude_norm),
        **({"d_model": args.d_model} if args.d_model else {}))
except ValueError as err:
    fail(err)
with torch.device("meta"):  # sizes and FLOPs without allocating anything
    meta_model = Parcae(config)
num_params, flops_per_token = meta_model.num_params(), meta_model.flops_per_token()  # the paper's C: the horizon
executed_flops_per_token = meta_model.matmul_flops_per_token()  # at the sampler's mean depths: MFU
if args.max_tokens:
    max_tokens = args.max_tokens
elif args.target_flops:
    max_tokens = args.target_flops / flops_per_token
elif args.param_data_ratio:
    max_tokens = args.param_data_ratio * num_params
elif args.depth in PAPER_TOKENS:
    max_tokens = PAPER_TOKENS[args.depth]
else:
    fail(f"no default horizon for --depth={args.depth}; give --max_tokens, --target_flops or --param_data_ratio")

# -----------------------------------------------------------------------------
# Processes: torchrun sets RANK; NCCL on CUDA, gloo on CPU. Plain `python train.py` is one process.

ddp = "RANK" in os.environ and not args.dry_run
device = torch.device("cuda" if CUDA else "cpu")
restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # > 0: torchrun restarted the workers
if restart_count and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
    fail("torchrun restarted the workers but its shared rendezvous store still holds the failed attempt's "
         "addresses (pytorch issue 167288); launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
if ddp:
    device = init_distributed(device)  # the GPU of this local rank
rank, world = rank_and_world()
master = rank == 0
if CUDA:
    torch.backends.cuda.matmul.allow_tf32 = True
log = (lambda *a: print(*a, flush=True)) if master else (lambda *a: None)

rows_per_step = args.device_batch_size * args.seq_len * world
if args.total_batch_size % rows_per_step != 0:
    fail(f"--total_batch_size={args.total_batch_size} is not divisible by device_batch_size x seq_len x world = "
         f"{args.device_batch_size} x {args.seq_len} x {world} = {rows_per_step}; change one of them")
grad_accum = args.total_batch_size // rows_per_step
num_steps = max(1, int(max_tokens // args.total_batch_size))
run_name = args.run or f"d{args.depth}_{args.injection}"
run_dir = get_base_dir() / "runs" / run_name
resume_from = find_checkpoint(run_dir.parent, run_name) if any(run_dir.glob("ckpt_*.pt")) else None
if args.resume and not args.dry_run and resume_from is None:  # before the tokenizer and data
    fail(f"there is no checkpoint of run {run_name} under {run_dir} to resume; start it without --resume")
if resume_from and not args.dry_run and int(resume_from.stem.removeprefix("ckpt_")) >= num_steps:
    log(f"run {run_name} is done: {resume_from} holds its last step, {num_steps}; nothing to train "
        f"(a new --run trains afresh)")
    sys.exit(0)
log(f"model: depth {args.depth} ({config.n_prelude}/{config.n_recur}/{config.n_coda}), d_model {config.d_model}, "
    f"{config.n_head} heads, injection {config.injection}, mu_rec {config.mu_rec}, mu_bwd {config.mu_bwd}, "
    f"sampling {config.sampling}, prelude_norm {config.prelude_norm}")
log(f"parameters: {num_params:,} | FLOPs/token (paper's C): {flops_per_token:.4e} | tokens: "
    f"{num_steps * args.total_batch_size:,} | total FLOPs: {flops_per_token * num_steps * args.total_batch_size:.4e} "
    f"| executed matmul FLOPs/token: {executed_flops_per_token:.4e}")
log(f"steps: {num_steps} x {args.total_batch_size:,} tokens = {world} process(es) x {grad_accum} micro-batch(es) x "
    f"{args.device_batch_size} x {args.seq_len} | data: {args.data} | output: {run_dir}")


def memory_plan():
    """Estimated memory per GPU: float32 weights and gradients, DDP's gradient buckets (another copy),
    optimiser state (AdamW: two moments; Muon: momentum and a factored second moment), and activations
    at --device_batch_size and mu_bwd (model.activation_bytes). A batch 'fits' in 90% of the memory: the
    rest is for the backward's transient buffers, the CUDA context and fragmentation."""
    optimizer_bytes = 0
    for group in build_optimizer(meta_model, adamw_lr=1.0, muon=args.optimizer == "muon").param_groups:
        numel = sum(p.numel() for p in group["params"])
        if group["kind"] == "adamw":
            optimizer_bytes += 8 * numel
        else:
            optimizer_bytes += 4 * numel + 4 * len(group["params"]) * max(group["params"][0].shape)
    bf16 = args.dtype == "bfloat16"
    static = 3 * 4 * num_params + optimizer_bytes
    per_sequence = meta_model.activation_bytes(2, bf16) - meta_model.activation_bytes(1, bf16)
    activations = meta_model.activation_bytes(args.device_batch_size, bf16)
    fixed = activations - args.device_batch_size * per_sequence  # bf16's weight copies
    fits = {gb: int((0.9 * gb * 1e9 - static - fixed) // per_sequence) for gb in (80, 141)}
    log(f"memory per GPU (GB): weights {4 * num_params / 1e9:.1f} + grads {4 * num_params / 1e9:.1f} "
        f"+ DDP buckets {4 * num_params / 1e9:.1f} + optimizer {optimizer_bytes / 1e9:.1f} + activations "
        f"{activations / 1e9:.1f} ({args.device_batch_size} x {args.seq_len} at mu_bwd {config.mu_bwd}, {args.dtype}) "
        f"= {(static + activations) / 1e9:.1f} | largest device batch: {fits[80]} in 80 GB, {fits[141]} in 141 GB")


if args.dry_run:
    memory_plan()
    sys.exit(0)

# -----------------------------------------------------------------------------
# Tokenizer, data (one loader per virtual rank) and the model

try:
    if master:
        get_tokenizer(args.data, args.vocab_size)  # trains and caches it on first use, once
    if ddp:
        dist.barrier()
    tokenizer = get_tokenizer(args.data, args.vocab_size)
    tokenizer_path = str(tokenizer_dir(args.data, args.vocab_size))  # recorded in every checkpoint
    virtual_world = world * grad_accum
    loaders = [DataLoader(tokenizer, args.data, "train", args.device_batch_size, args.seq_len,
                          rank=rank * grad_accum + micro, world_size=virtual_world, seed=args.seed, device=device,
                          sharers=grad_accum)  # one read of each chunk for this process's loaders
               for micro in range(grad_accum)]
except (FileNotFoundError, ValueError) as err:
    fail(err)

torch.manual_seed(args.seed)  # the same initial weights on every rank
model = Parcae(config).to(device)
raw_model = model
if args.compile:
    model.compile_blocks(backend=args.compile_backend)
    from torch._dynamo.utils import counters as dynamo_counters  # graphs compiled so far, logged per step
if ddp:
    model = DDP(model, device_ids=[device.index] if CUDA else None, broadcast_buffers=False)  # RoPE tables: constant
adamw_lr = args.adamw_lr or learning_rate_for_depth(args.depth)
optimizer = build_optimizer(raw_model, adamw_lr=adamw_lr, muon_lr=args.muon_lr, weight_decay=args.weight_decay,
                            muon=args.optimizer == "muon")
autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else nullcontext()

start_step, skipped_steps, lowest_val_loss = 0, 0, math.inf
# a run folder holding a checkpoint is continued (the docstring), also when torchrun --max_restarts restarts the workers
if resume_from:
    try:
        ckpt = read_checkpoint(resume_from, device)
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        for micro, loader in enumerate(loaders):
            loader.load_state_dict(ckpt["loader"][rank * grad_accum + micro])
        start_step, skipped_steps = ckpt["step"], ckpt["skipped_steps"]
        lowest_val_loss = ckpt.get("lowest_val_loss", math.inf)
    except (FileNotFoundError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError, KeyError, IndexError) as err:
        fail(f"cannot resume {run_name} with these flags ({first_sentence(err)}); "
             f"pass the flags and process count it was started with, or a new --run to start afresh")
    if ckpt.get("tokenizer_dir", tokenizer_path) != tokenizer_path:
        fail(f"the files of --data={args.data} are not the ones run {run_name} was trained on (their sizes or "
             f"modification times changed since {resume_from}); restore them, or pass a new --run to start afresh")
    log(f"resumed {run_name} at step {start_step}" + (f", elastic restart {restart_count}" if restart_count else "")
        + f", from {resume_from} (a new --run trains afresh)")
batches = [iter(loader) for loader in loaders]

# -----------------------------------------------------------------------------
# Evaluation and checkpoints

val_data = list(val_batches(tokenizer, args.data, args.device_batch_size, args.seq_len, args.eval_tokens, rank, world,
                            device))  # read and tokenized once, the same batches at every eval and every T


def evaluate(step):
    """METHOD.md §2: validation loss (and bits per byte) at T in {1, 2, 4, mu_rec}."""
    depths = [1] if config.injection == "none" else sorted({1, 2, 4, config.mu_rec})
    result = {"step": step}
    for T in depths:
        result[f"val_loss_T{T}"], result[f"val_bpb_T{T}"] = evaluate_bpb(raw_model, tokenizer, val_data, T)
    log("eval | " + " | ".join(f"T={T}: loss {result[f'val_loss_T{T}']:.4f} bpb {result[f'val_bpb_T{T}']:.4f}"
                              for T in depths))
    return result


def evaluate_core_subset(step):
    """METHOD.md §3 CORE on the first --core_max_per_task examples of each task, at T = mu_rec."""
    bundle_dir = [None]
    if master:
        try:
            bundle_dir[0] = str(download_eval_bundle())
        except (OSError, ValueError, SystemExit) as err:
            log(f"CORE skipped: the eval bundle is not available ({err})")
    if ddp:
        dist.broadcast_object_list(bundle_dir)
    if bundle_dir[0] is None:
        return None
    result = evaluate_core(raw_model, tokenizer, bundle_dir[0], max_per_task=args.core_max_per_task, verbose=False)
    log(f"CORE {result['core']:.4f} at T={result['T']} ({result['seconds']:.0f}s)")
    return {"step": step, "core": result["core"], "core_T": result["T"]}


def save(step):
    """Model, optimiser, every virtual rank's loader position, config and args; the RNG state is a
    function of (seed, step, virtual rank), reseeded every micro-step, so nothing else is needed."""
    loader_states = [loader.state_dict() for loader in loaders]
    if ddp:
        gathered = [None] * world
        dist.all_gather_object(gathered, loader_states)
        loader_states = [state for states in gathered for state in states]
    if master:
        old = sorted(run_dir.glob("ckpt_*.pt"))
        save_checkpoint(run_dir / f"ckpt_{step:06d}.pt", raw_model, step=step, skipped_steps=skipped_steps,
                        optimizer=optimizer.state_dict(), loader=loader_states, args=vars(args),
                        tokenizer_dir=tokenizer_path, seed=args.seed, lowest_val_loss=lowest_val_loss)
        for path in old:  # keep the newest only: a 1.3B checkpoint with optimiser state is ~16 GB
            if path.name != f"ckpt_{step:06d}.pt":
                path.unlink()
        log(f"saved {run_dir / f'ckpt_{step:06d}.pt'}")


def metrics_up_to(path, last_step):
    """Keep metrics.jsonl's records up to last_step, the checkpoint resumed from (0: none): the steps a killed run
    logged past it are logged again as the run redoes them, so each step stays once, in order. Rewritten under a
    temporary name; a torn last line goes too."""
    kept = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            if json.loads(line).get("step", 0) <= last_step:
                kept.append(line + "\n")
        except ValueError:
            pass
    write_atomically(path, lambda partial: partial.write_text("".join(kept)))


def micro_seed(step, virtual_rank):
    return (args.seed * 1_000_003 + step) * 65_537 + virtual_rank


def log_line(record, num_steps):
    """The step's log line, from its metrics record (fields that are None are left out)."""
    fields = [("loss", "loss {:.4f}"), ("lr_mult", "lrm {:.2f}"), ("tokens_per_s", "{:,.0f} tok/s"),
              ("mfu", "mfu {:.1%}"), ("rho", "rho {:.4f}"), ("h_norm", "|h_T| {:.2f}"),
              ("update_ratio", "dh/h {:.4f}")]
    parts = [f"step {record['step']}/{num_steps}"]
    parts += [form.format(record[key]) for key, form in fields if record.get(key) is not None]
    tokens_per_s = record["tokens_per_s"]
    eta = (num_steps - record["step"]) * args.total_batch_size / tokens_per_s if tokens_per_s else float("nan")
    return " | ".join(parts + [f"eta {eta / 60:.1f} min"])


def poison_gradient(param):
    """A test's fault (NANOPARCAE_FAULT nan_step): make that step's gradients non-finite; the loop must skip it."""
    if 0 <= step - fault["nan_step"] < fault["nan_steps"]:
        param.grad.fill_(float("nan"))


if fault["nan_step"] is not None:
    next(raw_model.parameters()).register_post_accumulate_grad_hook(poison_gradient)

# -----------------------------------------------------------------------------
# Training loop

peak_flops = peak_bf16_flops(device)
depth_generator = torch.Generator()  # METHOD.md §2: each virtual rank samples depths with its own generator
if master:
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_up_to(run_dir / "metrics.jsonl", start_step)
    metrics_file = open(run_dir / "metrics.jsonl", "a")
tokens_per_second, t_run = None, time.time()
step = start_step
bad_steps, diverged_at, save_due, h_norm_warned = 0, None, False, False  # the divergence rule (see the docstring)
h_norm_limit, h_norm_stops = state_norm_limit(args.dtype, args.diverge_h_norm)
val_key, uniform_loss = f"val_loss_T{1 if config.injection == 'none' else config.mu_rec}", math.log(args.vocab_size)
LOST_MARGIN = 1.0  # nats: weights near their initialisation score ln V give or take a few tenths (a uniform guess)


def val_loss_lost(val_loss):
    """The val-loss rule -> its reason, or None: non-finite, far above a uniform guess (a model confidently wrong,
    which initial weights are not), or above it after an eval had been far below it (learned, then lost)."""
    if not math.isfinite(val_loss):
        return "non-finite val loss"
    if val_loss > uniform_loss + LOST_MARGIN:
        return "val loss far above a uniform guess"
    if val_loss >= uniform_loss and lowest_val_loss < uniform_loss - LOST_MARGIN:
        return "val loss back above a uniform guess"
    return None


def declare_diverged(at, reason, detail):
    kept = sorted(run_dir.glob("ckpt_*.pt"))
    log(f"diverged at step {at}: {reason}, {detail}; " + (f"the last checkpoint, {kept[-1]}, from before, is kept"
                                                         if kept else "no checkpoint was saved before it"))
    if master:
        metrics_file.write(json.dumps({"step": step, "diverged_at": at, "reason": reason}) + "\n")
        metrics_file.flush()


while step < num_steps and (args.stop_at is None or step < args.stop_at):
    t0 = time.time()
    loss_sum = torch.zeros((), device=device)
    logged = (step + 1) % args.log_every == 0 or step + 1 == num_steps
    for micro in range(grad_accum):
        seed = micro_seed(step, rank * grad_accum + micro)
        torch.manual_seed(seed)  # h0, drawn inside the forward
        depth_generator.manual_seed(seed)
        x, y = next(batches[micro])
        last = micro == grad_accum - 1
        with (model.no_sync() if ddp and not last else nullcontext()), autocast:
            if last:  # ||h_T|| and the update ratio, for the divergence rule and the log line, from one micro-batch
                diagnostics = {}
                loss = model(x, y, depth_generator=depth_generator, diagnostics=diagnostics)
            else:
                loss = model(x, y, depth_generator=depth_generator)
        (loss / grad_accum).backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip)
    h_norm = diagnostics["h_norm"]
    state_too_large = torch.zeros((), device=device) if h_norm is None else (h_norm > h_norm_limit).float()
    # [gradients finite, state within bound], reduced at once: every rank skips, and stops, at the same step
    health = torch.stack([torch.isfinite(grad_norm).float(), 1 - state_too_large])
    if ddp:
        dist.all_reduce(health, op=dist.ReduceOp.MIN)
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
    finite, state_ok = health.tolist()
    lrm = lr_multiplier(step, num_steps, args.warmdown_frac)
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * lrm
        if group["kind"] == "muon":
            group["momentum"] = muon_momentum(step)
            group["weight_decay"] = weight_decay_at(step, num_steps, args.weight_decay)
    if finite:
        optimizer.step()
    else:
        skipped_steps += 1
        log(f"step {step + 1}: non-finite gradients, update skipped ({skipped_steps} so far)")
    optimizer.zero_grad(set_to_none=True)
    step += 1

    dt = time.time() - t0
    if step > start_step + 1:  # the first step pays for compilation and warm-up
        tokens_per_second = args.total_batch_size / dt if tokens_per_second is None \
            else 0.9 * tokens_per_second + 0.1 * args.total_batch_size / dt
    if master and logged:
        record = {"step": step, "loss": loss_sum.item() / grad_accum, "lr_mult": lrm, "grad_norm": grad_norm.item(),
                  **{f"{group['kind']}_lr": group["lr"] for group in optimizer.param_groups},  # adamw_lr, muon_lr
                  "tokens_per_s": tokens_per_second, "rho": raw_model.spectral_radius(), "skipped_steps": skipped_steps,
                  **{key: None if value is None else value.item() for key, value in diagnostics.items()}}
        if peak_flops and tokens_per_second:
            record["mfu"] = executed_flops_per_token * tokens_per_second / (peak_flops * world)
        if args.compile:  # a count that still grows after the first steps is recompiling (model.compile_blocks)
            record["graphs"] = dynamo_counters["stats"]["unique_graphs"]
        if CUDA:  # against the --dry_run plan (memory_plan)
            record["peak_memory"] = torch.cuda.max_memory_allocated(device)
        log(log_line(record, num_steps))
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
    if not state_ok and not h_norm_stops and not h_norm_warned:
        h_norm_warned = True
        log(f"warning: step {step}: ||h_T|| {h_norm.item():.3g} > {h_norm_limit:g}; a bfloat16 run would have lost "
            f"its input here, this {args.dtype} one goes on")
        if master:
            metrics_file.write(json.dumps({"step": step, "warning": "h_norm", "h_norm": h_norm.item()}) + "\n")
    reason = "non-finite loss or gradients" if not finite else \
        f"||h_T|| > {h_norm_limit:g}" if not state_ok and h_norm_stops else None
    bad_steps = bad_steps + 1 if reason else 0
    if 0 < args.diverge_steps <= bad_steps:
        diverged_at = step - bad_steps + 1
        declare_diverged(diverged_at, reason, f"{bad_steps} steps in a row (to step {step})")
        break
    results = []
    with autocast:  # evals run the training's numerics (eval_core keeps a caller's CPU autocast)
        if step % args.eval_every == 0 or step == num_steps:
            results.append(evaluate(step))
        if args.core_every > 0 and (step % args.core_every == 0 or step == num_steps):
            results.append(evaluate_core_subset(step))
    if master:
        for result in filter(None, results):
            metrics_file.write(json.dumps(result) + "\n")
        metrics_file.flush()
    val_loss = next((r[val_key] for r in filter(None, results) if val_key in r), None)
    lost = val_loss_lost(val_loss) if args.diverge_steps > 0 and val_loss is not None else None
    if lost:
        diverged_at = step
        declare_diverged(step, lost, f"{val_loss:.4f} against ln {args.vocab_size} = {uniform_loss:.4f}" +
                         (f", lowest before {lowest_val_loss:.4f}" if math.isfinite(lowest_val_loss) else ""))
        break
    lowest_val_loss = min(lowest_val_loss, math.inf if val_loss is None else val_loss)
    save_due = save_due or step % args.save_every == 0 or step == num_steps or step == args.stop_at
    if save_due and bad_steps == 0:  # during a streak the state may be the diverging one: save after it
        save(step)
        save_due = False
    if fault["kill_step"] == step and rank == world - 1 and restart_count == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # as a node fault or the OOM killer would

log(f"{'stopped' if diverged_at else 'done'}: {step} steps in {(time.time() - t_run) / 60:.1f} min, "
    f"{skipped_steps} skipped")
for loader in loaders:
    loader.close()
if ddp:
    dist.destroy_process_group()
if diverged_at:
    sys.exit(3)  # a status of its own: neither success nor bad input (2)
