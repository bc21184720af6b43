"""
train.py: train Parcae (or a baseline) with the paper's recipe (METHOD.md §2), from one CPU to 8 GPUs.

    torchrun --nproc_per_node=8 train.py                 # the defaults: the paper's 140M on FineWeb-Edu
    torchrun --nproc_per_node=8 train.py --depth=24      # the paper's 1.3B
    python train.py --depth=24 --dry_run                 # print sizes, tokens, FLOPs and memory per GPU only
    bash runs/cpu.sh                                     # a small looped model on a CPU: its flags are there

Every optimiser step sees the same rows, depths and h0 whatever the number of processes: its
micro-batches are "virtual ranks" v = rank * grad_accum + micro, each with its own share of the data
and its own seed. So two processes reproduce one, and a resumed run continues exactly; workers that
torchrun --max_restarts restarts after a failure resume from the last checkpoint by themselves.

A run (--run, default d<depth>_<injection>) is defined by its model, data, recipe, seed and horizon, which its
checkpoint records: the same command continues it from its last checkpoint, a finished run exits at once, and a
command whose defining flags differ is refused with the flags it differs in. The rule that stops a diverged run
(exit status 3): docs/troubleshooting.md.
"""

import argparse
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from nanoparcae.checkpoint import find_checkpoint, read_checkpoint, save_checkpoint
from nanoparcae.common import (get_base_dir, init_distributed, parse_device, peak_bf16_flops, rank_and_world,
                               write_atomically)
from nanoparcae.divergence import Divergence
from data import DataLoader, val_batches
from nanoparcae.dataset import ChunkReader, get_tokenizer, tokenizer_dir
from model import SAMPLINGS
from eval_core import evaluate_bpb, evaluate_core
from nanoparcae.ranks import (agree_to_start, being_trained, checkpoint_digest, drift, lock_for_every_rank,
                              run_holder, shared_eval_bundle, stop)
from model import Parcae, ParcaeConfig
from nanoparcae.memory import largest_divisor, largest_fitting_batch, memory_plan
from optim import (build_optimizer, learning_rate_for_depth, lr_multiplier, muon_momentum, optimizer_state_bytes,
                   weight_decay_at)

# -----------------------------------------------------------------------------
# Flags. The defaults are the paper's 140M recipe (METHOD.md §2); runs/cpu.sh passes a small model's.

PAPER_TOKENS = {6: 11.2e9, 12: 29.6e9, 18: 61.6e9, 24: 104e9}  # METHOD.md §1: tokens trained per size


def fail(message):
    """One clear line instead of a traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's layout and shows every default."""


parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
parser.error = fail  # an unknown flag or a value of the wrong type: one line too (--help shows the usage)
# Every flag is declared once, as one of two kinds. Run-defining flags are recorded in the run's checkpoints
# (run_flags), and a command that continues the run with another value is refused; free flags may change when a
# run is continued. check: "positive" or "zero or more" (a None default, where there is one, lets the default stand).
RUN_FLAGS, FREE_FLAGS, CHECKS = [], [], {}


def declare_flag(kind, name, check=None, **kwargs):
    """--name added to the parser and to its kind's list (RUN_FLAGS or FREE_FLAGS), with its check."""
    kind.append(name)
    CHECKS[name] = check
    parser.add_argument(f"--{name}", **kwargs)


run_flag, free_flag = partial(declare_flag, RUN_FLAGS), partial(declare_flag, FREE_FLAGS)


# the model
run_flag("depth", "positive", type=int, default=6, help="layers, L_P = L_R = L_C = depth/3; 6/12/18/24 = 140M..1.3B")
run_flag("d_model", "positive", type=int, default=None, help="width (None: 128 * (depth/3 + 4))")
run_flag("head_dim", "positive", type=int, default=128, help="attention head width")
run_flag("mu_rec", "positive", type=int, default=8, help="mean recurrence depth")
run_flag("mu_bwd", "positive", type=int, default=None, help="backpropagated depth (None: ceil(mu_rec/2))")
run_flag("injection", default="diagonal", choices=["diagonal", "concat", "add", "none"],
         help="diagonal = Parcae, concat = RDM, add, none = fixed-depth Transformer")
run_flag("sampling", default="per_sequence", choices=list(SAMPLINGS), metavar="SCHEME",
         help=f"recurrence-depth sampler, one of {', '.join(SAMPLINGS)} (model.py says what each draws)")
run_flag("prelude_norm", type=int, default=1, choices=[0, 1], help="RMSNorm on the prelude's output e")
run_flag("vocab_size", "positive", type=int, default=32768, help="tokens, the specials included")
run_flag("seq_len", "positive", type=int, default=2048, help="tokens per row")
# the data and the horizon
run_flag("data", default="fineweb-edu", help="fineweb-edu, stdlib, or a path / glob of .txt, .jsonl, .parquet files")
run_flag("max_tokens", "positive", type=float, default=None,
         help="training horizon in tokens (None: the paper's for the depth, "
              + ", ".join(f"{t:.3g}" for t in PAPER_TOKENS.values()) + ")")
run_flag("param_data_ratio", "positive", type=float, default=None, help="horizon as tokens per parameter")
run_flag("target_flops", "positive", type=float, default=None, help="horizon as total training FLOPs (the paper's C)")
# the recipe
run_flag("device_batch_size", "positive", type=int, default=None,
         help="sequences per micro-batch per process (None: on a GPU the largest whose memory plan fits it, on a CPU "
              "the largest up to 32, among those that divide total_batch_size / (seq_len x processes))")
run_flag("total_batch_size", "positive", type=int, default=524_288, help="tokens per optimiser step")
run_flag("optimizer", default="muon", choices=["muon", "adamw"],
         help="muon: the recipe, Muon on the blocks' matrices and AdamW on the rest; adamw: AdamW on all")
run_flag("adamw_lr", "positive", type=float, default=None, help="None: 8e-3 (140M, 370M) or 6e-3 (770M, 1.3B)")
run_flag("muon_lr", "positive", type=float, default=8e-3, help="Muon's rate on the blocks' matrices")
run_flag("weight_decay", "zero or more", type=float, default=0.2, help="Muon's cautious weight decay")
run_flag("grad_clip", "positive", type=float, default=1.0, help="gradient norm clip")
run_flag("warmdown_frac", type=float, default=0.5, help="last fraction of steps decaying the rate to 0")
run_flag("seed", "zero or more", type=int, default=0, help="initial weights, data order, depths and h0")
# how it runs, evaluates, logs and saves
free_flag("device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
free_flag("dtype", default="bfloat16", choices=["float32", "bfloat16"],
          help="autocast dtype of the matmuls (bfloat16 on a CPU runs the GPU's numerics)")
free_flag("compile", type=int, default=1, choices=[0, 1], help="torch.compile the blocks")
free_flag("compile_backend", default="inductor", choices=["inductor", "eager"],
          help="eager: dynamo's tracing and guards without code generation (counts recompilations fast)")
free_flag("eval_every", "positive", type=int, default=250, help="steps between validation evals")
free_flag("eval_tokens", "positive", type=int, default=10 * 524_288, help="validation tokens per eval")
free_flag("core_every", type=int, default=2000, help="steps between CORE evals, and at the end (-1: never)")
free_flag("core_max_per_task", "positive", type=int, default=500, help="CORE examples per task during training")
free_flag("save_every", "positive", type=int, default=1000, help="steps between checkpoints")
free_flag("log_every", "positive", type=int, default=1, help="steps between log lines")
free_flag("rho_every", "positive", type=int, default=None,
          help="steps between the concat (RDM) baseline's rho, an eigendecomposition on the host (None: "
               "--eval_every); the other injections' rho is on every log line")
free_flag("diverge_steps", "zero or more", type=int, default=5,
          help="bad steps in a row that declare the run diverged (0: never, nor by the val loss)")
free_flag("diverge_h_norm", "positive", type=float, default=None,
          help="a state norm ||h_T|| that is a bad step in any dtype (None: 1e4 in bf16 only)")
free_flag("run", default=None, help="run name (None: d<depth>_<injection>)")
free_flag("resume", action="store_true",
          help="require a checkpoint to continue from (a run folder holding one is continued without it too)")
free_flag("stop_at", "positive", type=int, default=None, help="end this invocation after that step (continue later)")
free_flag("dry_run", action="store_true", help="print the resolved configuration and the memory plan, and exit")
args = parser.parse_args()
assert set(vars(args)) == set(CHECKS), f"declare {sorted(set(vars(args)) - set(CHECKS))} by run_flag or free_flag"

for name, check in CHECKS.items():
    value = getattr(args, name)
    if check == "positive" and value is not None and not 0 < value < math.inf:
        fail(f"--{name}={value} must be a positive number")
    if check == "zero or more" and not 0 <= value < math.inf:
        fail(f"--{name}={value} must be zero or more")
if not 0 <= args.warmdown_frac <= 1:
    fail(f"--warmdown_frac={args.warmdown_frac} must be between 0 and 1")
if args.core_every == 0 or args.core_every < -1:
    fail(f"--core_every={args.core_every} must be a number of steps, or -1 for never")
try:
    device = parse_device(args.device)
except ValueError as err:
    fail(err)

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
adamw_lr = args.adamw_lr or learning_rate_for_depth(args.depth)

# -----------------------------------------------------------------------------
# Processes: torchrun sets RANK; NCCL on CUDA, gloo on CPU. Plain `python train.py` is one process.

ddp = "RANK" in os.environ and not args.dry_run
restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # > 0: torchrun restarted the workers
if restart_count and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # pytorch issue 167288
    fail("torchrun restarted the workers into the failed attempt's rendezvous store; launch it with "
         "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
if ddp:
    device = init_distributed(device)  # the GPU of this local rank
rank, world = rank_and_world()
master = rank == 0
if device.type == "cuda":
    torch.backends.cuda.matmul.allow_tf32 = True
log = (lambda *a: print(*a, flush=True)) if master else (lambda *a: None)

num_steps = max(1, int(max_tokens // args.total_batch_size))
log(f"model: depth {args.depth} ({config.n_prelude}/{config.n_recur}/{config.n_coda}), d_model {config.d_model}, "
    f"{config.n_head} heads, injection {config.injection}, mu_rec {config.mu_rec}, mu_bwd {config.mu_bwd}, "
    f"sampling {config.sampling}, prelude_norm {config.prelude_norm}")
log(f"parameters: {num_params:,} | FLOPs/token (paper's C, the horizon's unit): {flops_per_token:.4e} | tokens: "
    f"{num_steps * args.total_batch_size:,} | total FLOPs: {flops_per_token * num_steps * args.total_batch_size:.4e} "
    f"| executed matmul FLOPs/token (MFU's): {executed_flops_per_token:.4e}, C / executed "
    f"{flops_per_token / executed_flops_per_token:.2f}")

# -----------------------------------------------------------------------------
# The device batch and its memory plan (model.py's accounting), settled before anything is built or compiled

given_batch = args.device_batch_size
if given_batch and args.total_batch_size % (given_batch * args.seq_len * world):
    fail(f"--total_batch_size={args.total_batch_size} is not divisible by device_batch_size x seq_len x world = "
         f"{given_batch} x {args.seq_len} x {world} = {given_batch * args.seq_len * world}; change one of them")
if args.total_batch_size % (args.seq_len * world):
    fail(f"--total_batch_size={args.total_batch_size} is not divisible by seq_len x world = {args.seq_len} x "
         f"{world}; change one of them")
sequences = args.total_batch_size // (args.seq_len * world)  # each process's share of an optimiser step
bf16 = args.dtype == "bfloat16"
optimizer_bytes = optimizer_state_bytes(meta_model, muon=args.optimizer == "muon")
if device.type == "cuda":
    gpu_name, gpu_gb = torch.cuda.get_device_name(device), torch.cuda.mem_get_info(device)[1] / 1e9
    if ddp:  # every rank must pick the same batch: the smallest GPU decides
        smallest = torch.tensor(gpu_gb, device=device)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        gpu_gb = smallest.item()
    gpus, gpu = (gpu_gb,), f"this GPU's {gpu_gb:.1f} GB ({gpu_name})"
    fitting = largest_fitting_batch(meta_model, sequences, gpu_gb, bf16, optimizer_bytes)
    asked = memory_plan(meta_model, given_batch or 1, bf16, optimizer_bytes, gpus)  # the user's size, or one sequence
    if asked["largest_batch"][gpu_gb] < (given_batch or 1):
        fail(f"{f'--device_batch_size={given_batch}' if given_batch else 'one sequence per GPU'} plans "
             f"{asked['total'] / 1e9:.1f} GB, over 90% of {gpu}; "
             + (f"the largest device batch that fits is {fitting}" if fitting else "train a smaller --depth"))
    how = f"whose memory plan fits in 90% of {gpu}"
else:  # no GPU memory to plan for: the plans for the two GPUs the paper's runs are sized for
    gpus = (80, 141)
    how = "up to 32 (no GPU; a GPU would get " + ", ".join(
        f"{largest_fitting_batch(meta_model, sequences, gb, bf16, optimizer_bytes)} in {gb} GB" for gb in gpus) + ")"
    fitting = largest_divisor(sequences, 32)
args.device_batch_size = given_batch or fitting
plan = memory_plan(meta_model, args.device_batch_size, bf16, optimizer_bytes, gpus)
if device.type == "cuda" or args.dry_run:
    log(f"memory per GPU (GB): weights {plan['weights'] / 1e9:.1f} + grads {plan['grads'] / 1e9:.1f} + DDP buckets "
        f"{plan['ddp_buckets'] / 1e9:.1f} + optimizer {plan['optimizer'] / 1e9:.1f} + activations "
        f"{plan['activations'] / 1e9:.1f} ({args.device_batch_size} x {args.seq_len} at mu_bwd {config.mu_bwd}, "
        f"{args.dtype}) = {plan['total'] / 1e9:.1f} | largest device batch: "
        + ", ".join(f"{n} in {gb:.4g} GB" for gb, n in plan["largest_batch"].items())
        + " | an estimate until a GPU measures it (runs/gpu_check.sh)")
log(f"device batch: {args.device_batch_size}, " + ("as given" if given_batch else
    f"the largest divisor of the {sequences} sequences a process runs per step {how}"))
if args.dry_run:
    sys.exit(0)

# -----------------------------------------------------------------------------
# The run: what defines it, and its last checkpoint, checked before any work

try:
    tokenizer_path = tokenizer_dir(args.data, args.vocab_size)  # recorded in every checkpoint, for sample.py
    data_key = tokenizer_path.name.removesuffix(f"-{args.vocab_size}")  # content, not path
    run_dir = get_base_dir() / "runs" / (args.run or f"d{args.depth}_{args.injection}")
except (FileNotFoundError, ValueError) as err:
    fail(err)
run_name = run_dir.name
resume_from, ckpt, refusal, start = None, None, None, (0, None)  # start: the checkpoint's step and weights digest
try:  # on every rank; each keeps its refusal for the agreement below rather than stopping alone
    if holder := run_holder(run_dir):  # before a live run's checkpoint is read onto its GPUs
        raise ValueError(being_trained(run_dir, holder))
    resume_from = find_checkpoint(run_dir.parent, run_name) if any(run_dir.glob("ckpt_*.pt")) else None
    if args.resume and resume_from is None:
        raise ValueError(f"there is no checkpoint of run {run_name} under {run_dir} to resume; start it without "
                         f"--resume")
    if resume_from:
        ckpt = read_checkpoint(resume_from, device)  # unreadable: the message names the file and what to do
        recorded = ckpt.get("run", {})
        if not given_batch and recorded.get("device_batch_size", fitting) != fitting:  # it fixes the data order
            args.device_batch_size = recorded["device_batch_size"]
            log(f"device batch: {args.device_batch_size}, as run {run_name} recorded (it fixes the run's data "
                f"order)" + (f"; its plan no longer fits {gpu}, where {fitting} does" if device.type == "cuda"
                              and args.device_batch_size > plan["largest_batch"][gpu_gb] else ""))
    # recorded with what the defaults resolved to, and the data's content key
    run_flags = {name: getattr(args, name) for name in RUN_FLAGS}
    run_flags.update(d_model=config.d_model, mu_bwd=config.mu_bwd, data=data_key, max_tokens=max_tokens,
                     adamw_lr=adamw_lr)
    if ckpt:
        differ = [f"{name} {recorded.get(name, 'unrecorded')} there, {value} here"
                  for name, value in run_flags.items() if recorded.get(name) != value]
        if differ:
            data = " (data: --data's content key, from its files' names, sizes and modification times, or " \
                "stdlib's Python version)" if recorded.get("data") != data_key else ""
            raise ValueError(f"run {run_name} ({resume_from}) was started with other flags: {'; '.join(differ)}"
                             f"{data}; pass its flags to continue it, or --run=NAME to start another")
        start = ckpt["step"], checkpoint_digest(ckpt["model"])
    if sequences % args.device_batch_size:  # a recorded batch on another number of processes
        raise ValueError(f"run {run_name}'s device batch {args.device_batch_size} does not divide the {sequences} "
                         f"sequences each of {world} process(es) runs per step; continue it on a number of processes "
                         f"it divides")
except ValueError as err:
    refusal = str(err)
try:  # every rank starts from the same checkpoint (none: step 0), then one trainer per run
    agree_to_start(run_name, refusal, *start)
    if start[0] >= num_steps:
        log(f"run {run_name} is done: {resume_from} holds its last step, {num_steps}; nothing to train "
            f"(--run=NAME trains another)")
        sys.exit(0)
    run_lock = lock_for_every_rank(run_dir)  # held until this process ends, before anything is written there
except ValueError as err:
    stop(err, 2)  # every rank stops alike; each node logs the line once
grad_accum = sequences // args.device_batch_size
log(f"steps: {num_steps} x {args.total_batch_size:,} tokens = {world} process(es) x {grad_accum} micro-batch(es) x "
    f"{args.device_batch_size} x {args.seq_len} | data: {args.data} | device: {device}, {args.dtype}")
log(f"output: {run_dir}")

# -----------------------------------------------------------------------------
# Tokenizer, data (one loader per virtual rank), the model and the optimiser

try:
    if master:
        get_tokenizer(args.data, args.vocab_size)  # trains and caches it on first use, once
    if ddp:
        dist.barrier()
    tokenizer = get_tokenizer(args.data, args.vocab_size)
    virtual_world = world * grad_accum
    reader = ChunkReader()  # one read of each chunk for this process's loaders
    loaders = [DataLoader(tokenizer, args.data, "train", args.device_batch_size, args.seq_len,
                          rank=rank * grad_accum + micro, world_size=virtual_world, seed=args.seed, device=device,
                          reader=reader, sharers=grad_accum)
               for micro in range(grad_accum)]
    val_data = list(val_batches(tokenizer, args.data, args.device_batch_size, args.seq_len, args.eval_tokens, rank,
                                world, device, reader))  # read and tokenized once, the same batches at every eval and T
except (FileNotFoundError, ValueError) as err:
    if args.data == "fineweb-edu":
        fail(f"{err} (the 140M run reads about 240: `python -m nanoparcae.dataset download -n 240`); without a GPU, "
             f"`bash runs/cpu.sh` trains a small model on this Python's standard library, no download needed")
    fail(err)

torch.manual_seed(args.seed)  # the same initial weights on every rank
model = Parcae(config).to(device)
raw_model = model
if args.compile:
    model.compile_blocks(backend=args.compile_backend)
    from torch._dynamo.utils import counters as dynamo_counters  # graphs compiled so far, logged per step
if ddp:
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                broadcast_buffers=False)  # RoPE tables: constant
optimizer = build_optimizer(raw_model, adamw_lr=adamw_lr, muon_lr=args.muon_lr, weight_decay=args.weight_decay,
                            muon=args.optimizer == "muon")
autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else nullcontext()

start_step, skipped_steps, lowest_val_loss = 0, 0, math.inf
if ckpt:  # also when torchrun --max_restarts restarted the workers
    raw_model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    for micro, loader in enumerate(loaders):
        loader.load_state_dict(ckpt["loader"][rank * grad_accum + micro])
    start_step, skipped_steps, lowest_val_loss = ckpt["step"], ckpt["skipped_steps"], ckpt["lowest_val_loss"]
    changed = [f"--{name} {value} -> {getattr(args, name)}" for name, value in ckpt["args"].items()
               if name in FREE_FLAGS and name not in ("resume", "dry_run") and getattr(args, name) != value]
    log(f"resumed {run_name} at step {start_step}" + (f", elastic restart {restart_count}" if restart_count else "")
        + f", from {resume_from} (--run=NAME trains another)" + (f"; changed: {', '.join(changed)}" if changed else ""))
    del ckpt
batches = [iter(loader) for loader in loaders]

# -----------------------------------------------------------------------------
# Evaluation, checkpoints and the log


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
    bundle_dir, why = shared_eval_bundle(device)  # on every rank, or CORE skipped on every rank
    if bundle_dir is None:
        log(f"CORE skipped: {why}")
        return None
    result = evaluate_core(raw_model, tokenizer, bundle_dir, max_per_task=args.core_max_per_task, verbose=False)
    log(f"CORE {result['core']:.4f} at T={result['T']} ({result['seconds']:.0f}s)")
    return {"step": step, "core": result["core"], "core_T": result["T"]}


def save(step):
    """Model, optimiser, every virtual rank's loader position, the run's flags; the RNG state is a function of
    (seed, step, virtual rank), reseeded every micro-step, so nothing else is needed. Keeps the newest only.
    Saves nothing, and stops the run, when the ranks' weights have drifted apart (guards.drift)."""
    if drifted := drift(raw_model.state_dict()):
        stop(f"at step {step} the ranks' weights have drifted apart: {drifted}; nothing saved: the run's last "
             f"checkpoint stays, and the same command resumes every rank from it", 1)
    loader_states = [loader.state_dict() for loader in loaders]
    if ddp:
        gathered = [None] * world
        dist.all_gather_object(gathered, loader_states)
        loader_states = [state for states in gathered for state in states]
    if master:
        path = run_dir / f"ckpt_{step:06d}.pt"
        old = sorted(run_dir.glob("ckpt_*.pt"))
        save_checkpoint(path, raw_model, step=step, skipped_steps=skipped_steps, optimizer=optimizer.state_dict(),
                        loader=loader_states, run=run_flags, args=vars(args), tokenizer_dir=str(tokenizer_path),
                        lowest_val_loss=divergence.lowest_val_loss)
        for stale in old:  # a 1.3B checkpoint with optimiser state is ~16 GB
            if stale != path:
                stale.unlink()
        log(f"saved {path}")


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


def record(entry):
    if master:
        metrics_file.write(json.dumps(entry) + "\n")
        metrics_file.flush()


def log_line(entry):
    """The step's log line, from its metrics record (fields that are None are left out)."""
    fields = [("loss", "loss {:.4f}"), ("lr_mult", "lrm {:.2f}"), ("tokens_per_s", "{:,.0f} tok/s"),
              ("mfu", "mfu {:.1%}"), ("rho", "rho {:.4f}"), ("h_norm", "|h_T| {:.2f}"),
              ("update_ratio", "dh/h {:.4f}")]
    parts = [f"step {entry['step']}/{num_steps}"]
    parts += [form.format(entry[key]) for key, form in fields if entry.get(key) is not None]
    tokens_per_s = entry["tokens_per_s"]
    eta = (num_steps - entry["step"]) * args.total_batch_size / tokens_per_s if tokens_per_s else float("nan")
    return " | ".join(parts + [f"eta {eta / 60:.1f} min"])


def micro_seed(step, virtual_rank):
    return (args.seed * 1_000_003 + step) * 65_537 + virtual_rank


# -----------------------------------------------------------------------------
# Training loop

peak_flops = peak_bf16_flops(device)
depth_generator = torch.Generator()  # METHOD.md §2: each virtual rank samples depths with its own generator
divergence = Divergence(args.vocab_size, args.dtype, args.diverge_steps, args.diverge_h_norm, lowest_val_loss)
val_key = f"val_loss_T{1 if config.injection == 'none' else config.mu_rec}"  # the val loss the rule watches
host_rho = getattr(raw_model.injection, "rho_on_host", False)  # concat's rho: every --rho_every steps, not each line
if master:
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_up_to(run_dir / "metrics.jsonl", start_step)
    metrics_file = open(run_dir / "metrics.jsonl", "a")
tokens_per_second, t_run, step, save_due, verdict = None, time.time(), start_step, False, None
while step < num_steps and (args.stop_at is None or step < args.stop_at):

    # --- one step: grad_accum micro-batches forward and backward, clip, the schedules, the update
    t0 = time.time()
    loss_sum, stats = torch.zeros((), device=device), {}
    for micro in range(grad_accum):
        seed = micro_seed(step, rank * grad_accum + micro)
        torch.manual_seed(seed)  # h0, drawn inside the forward
        depth_generator.manual_seed(seed)
        x, y = next(batches[micro])
        last = micro == grad_accum - 1
        with (model.no_sync() if ddp and not last else nullcontext()), autocast:  # DDP all-reduces on the last
            loss = model(x, y, depth_generator=depth_generator, diagnostics=stats if last else None)
        (loss / grad_accum).backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip)
    lrm = lr_multiplier(step, num_steps, args.warmdown_frac)
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * lrm
        if group["kind"] == "muon":
            group["momentum"] = muon_momentum(step)
            group["weight_decay"] = weight_decay_at(step, num_steps, args.weight_decay)
    # [any rank's gradients non-finite, the largest ||h_T||], reduced at once: every rank skips, and stops, alike
    worst = torch.stack([(~torch.isfinite(grad_norm)).float(),
                         torch.zeros((), device=device) if stats["h_norm"] is None else stats["h_norm"].float()])
    if ddp:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
    non_finite, h_norm = worst.tolist()
    if non_finite:
        skipped_steps += 1
        log(f"step {step + 1}: non-finite gradients, update skipped ({skipped_steps} so far)")
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    step += 1

    # --- once in a while: the log line
    dt = time.time() - t0
    if step > start_step + 1:  # the first step pays for compilation and warm-up
        tokens_per_second = args.total_batch_size / dt if tokens_per_second is None \
            else 0.9 * tokens_per_second + 0.1 * args.total_batch_size / dt
    if step % args.log_every == 0 or step == num_steps:
        # the line's values are 0-d tensors on the device, read in one transfer: the only wait for the device
        # beyond the skip rule's (rho after the update, so that wait includes it; concat's rho: every --rho_every)
        rho_due = not host_rho or step % (args.rho_every or args.eval_every) == 0 or step == num_steps
        logged = {"loss": loss_sum, "grad_norm": grad_norm, "rho": raw_model.spectral_radius() if rho_due else None,
                  **stats}
        present = [key for key, value in logged.items() if value is not None]
        logged.update(zip(present, torch.stack([logged[key].float() for key in present]).tolist()))
        entry = {"step": step, "loss": logged["loss"] / grad_accum, "lr_mult": lrm, "grad_norm": logged["grad_norm"],
                 **{f"{group['kind']}_lr": group["lr"] for group in optimizer.param_groups},  # adamw_lr, muon_lr
                 "tokens_per_s": tokens_per_second, "rho": logged["rho"], "skipped_steps": skipped_steps,
                 **{key: logged[key] for key in stats}}
        if peak_flops and tokens_per_second:
            entry["mfu"] = executed_flops_per_token * tokens_per_second / (peak_flops * world)
        if args.compile:  # a count that still grows after the first steps is recompiling (model.compile_blocks)
            entry["graphs"] = dynamo_counters["stats"]["unique_graphs"]
        if device.type == "cuda":  # against the memory plan printed at the start
            entry["peak_memory"] = torch.cuda.max_memory_allocated(device)
        log(log_line(entry))
        record(entry)

    # --- once in a while: evals
    results = []
    with autocast:  # evals run the training's numerics (eval_core keeps a caller's CPU autocast)
        if step % args.eval_every == 0 or step == num_steps:
            results.append(evaluate(step))
        if args.core_every > 0 and (step % args.core_every == 0 or step == num_steps):
            results.append(evaluate_core_subset(step))
    for result in filter(None, results):  # the graph count after evals: they compile their own (compile_blocks)
        record({**result, "graphs": dynamo_counters["stats"]["unique_graphs"]} if args.compile else result)

    # --- every step: the divergence rule (docs/troubleshooting.md)
    val_loss = next((r[val_key] for r in filter(None, results) if val_key in r), None)
    verdict = divergence.check(step, not non_finite, None if stats["h_norm"] is None else h_norm, val_loss)
    if verdict and "warning" in verdict:
        log(f"warning: step {step}: ||h_T|| {h_norm:.3g} > {verdict['limit']:g}; this {args.dtype} run goes on")
        record({"step": step, **verdict})
    elif verdict:
        kept = sorted(run_dir.glob("ckpt_*.pt"))
        log(f"diverged at step {verdict['diverged_at']}: {verdict['reason']}, {verdict['detail']}; " +
            (f"the last checkpoint, {kept[-1]}, from before, is kept" if kept else "no checkpoint was saved before it"))
        record({"step": step, "diverged_at": verdict["diverged_at"], "reason": verdict["reason"]})
        break

    # --- once in a while: a checkpoint, never inside a streak of bad steps (its state may be the diverging one)
    save_due = save_due or step % args.save_every == 0 or step == num_steps or step == args.stop_at
    if save_due and divergence.bad_steps == 0:
        save(step)
        save_due = False

diverged = verdict is not None and "diverged_at" in verdict
log(f"{'stopped' if diverged else 'done'}: {step} steps in {(time.time() - t_run) / 60:.1f} min, "
    f"{skipped_steps} skipped")
for loader in loaders:
    loader.close()
if ddp:
    dist.destroy_process_group()
if diverged:
    sys.exit(3)  # a status of its own: neither success nor bad input (2)
