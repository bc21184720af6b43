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

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common import (Divergence, find_checkpoint, get_base_dir, init_distributed, parse_device, peak_bf16_flops,
                    rank_and_world, read_checkpoint, save_checkpoint, write_atomically)
from core_tasks import download_eval_bundle
from data import DataLoader, val_batches
from dataset import ChunkReader, get_tokenizer, tokenizer_dir
from depths import SAMPLINGS
from eval_core import evaluate_bpb, evaluate_core
from model import Parcae, ParcaeConfig
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
# the model
parser.add_argument("--depth", type=int, default=6, help="layers, L_P = L_R = L_C = depth/3; 6/12/18/24 = 140M..1.3B")
parser.add_argument("--d_model", type=int, default=None, help="width (None: 128 * (depth/3 + 4))")
parser.add_argument("--head_dim", type=int, default=128, help="attention head width")
parser.add_argument("--mu_rec", type=int, default=8, help="mean recurrence depth")
parser.add_argument("--mu_bwd", type=int, default=None, help="backpropagated depth (None: ceil(mu_rec/2))")
parser.add_argument("--injection", default="diagonal", choices=["diagonal", "concat", "add", "none"],
                    help="diagonal = Parcae, concat = RDM, add, none = fixed-depth Transformer")
parser.add_argument("--sampling", default="per_sequence", choices=list(SAMPLINGS), metavar="SCHEME",
                    help=f"recurrence-depth sampler, one of {', '.join(SAMPLINGS)} (depths.py says what each draws)")
parser.add_argument("--prelude_norm", type=int, default=1, choices=[0, 1], help="RMSNorm on the prelude's output e")
parser.add_argument("--vocab_size", type=int, default=32768, help="tokens, the specials included")
parser.add_argument("--seq_len", type=int, default=2048, help="tokens per row")
# the data and the horizon
parser.add_argument("--data", default="fineweb-edu", help="fineweb-edu, stdlib, or a path / glob of .txt, .jsonl, "
                                                          ".parquet files")
parser.add_argument("--max_tokens", type=float, default=None,
                    help="training horizon in tokens (None: the paper's for the depth, "
                         + ", ".join(f"{t:.3g}" for t in PAPER_TOKENS.values()) + ")")
parser.add_argument("--param_data_ratio", type=float, default=None, help="horizon as tokens per parameter")
parser.add_argument("--target_flops", type=float, default=None, help="horizon as total training FLOPs (the paper's C)")
# the recipe
parser.add_argument("--device_batch_size", type=int, default=32, help="sequences per micro-batch per process")
parser.add_argument("--total_batch_size", type=int, default=524_288, help="tokens per optimiser step")
parser.add_argument("--optimizer", default="muon", choices=["muon", "adamw"],
                    help="muon: the recipe, Muon on the blocks' matrices and AdamW on the rest; adamw: AdamW on all")
parser.add_argument("--adamw_lr", type=float, default=None, help="None: 8e-3 (140M, 370M) or 6e-3 (770M, 1.3B)")
parser.add_argument("--muon_lr", type=float, default=8e-3, help="Muon's rate on the blocks' matrices")
parser.add_argument("--weight_decay", type=float, default=0.2, help="Muon's cautious weight decay")
parser.add_argument("--grad_clip", type=float, default=1.0, help="gradient norm clip")
parser.add_argument("--warmdown_frac", type=float, default=0.5, help="last fraction of steps decaying the rate to 0")
parser.add_argument("--seed", type=int, default=0, help="initial weights, data order, depths and h0")
# how it runs, evaluates, logs and saves: free to change when a run is continued
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="autocast dtype of the matmuls (bfloat16 on a CPU runs the GPU's numerics)")
parser.add_argument("--compile", type=int, default=1, choices=[0, 1], help="torch.compile the blocks")
parser.add_argument("--compile_backend", default="inductor", choices=["inductor", "eager"],
                    help="eager: dynamo's tracing and guards without code generation (counts recompilations fast)")
parser.add_argument("--eval_every", type=int, default=250, help="steps between validation evals")
parser.add_argument("--eval_tokens", type=int, default=10 * 524_288, help="validation tokens per eval")
parser.add_argument("--core_every", type=int, default=2000, help="steps between CORE evals, and at the end (-1: never)")
parser.add_argument("--core_max_per_task", type=int, default=500, help="CORE examples per task during training")
parser.add_argument("--save_every", type=int, default=1000, help="steps between checkpoints")
parser.add_argument("--log_every", type=int, default=1, help="steps between log lines")
parser.add_argument("--diverge_steps", type=int, default=5,
                    help="bad steps in a row that declare the run diverged (0: never, nor by the val loss)")
parser.add_argument("--diverge_h_norm", type=float, default=None,
                    help="a state norm ||h_T|| that is a bad step in any dtype (None: 1e4 in bf16 only)")
parser.add_argument("--run", default=None, help="run name (None: d<depth>_<injection>)")
parser.add_argument("--resume", action="store_true",
                    help="require a checkpoint to continue from (a run folder holding one is continued without it too)")
parser.add_argument("--stop_at", type=int, default=None, help="end this invocation after that step (continue later)")
parser.add_argument("--dry_run", action="store_true", help="print the resolved configuration and exit")
args = parser.parse_args()

POSITIVE = ["depth", "d_model", "head_dim", "mu_rec", "mu_bwd", "vocab_size", "seq_len", "max_tokens",
            "param_data_ratio", "target_flops", "device_batch_size", "total_batch_size", "adamw_lr", "muon_lr",
            "grad_clip", "eval_every", "eval_tokens", "core_max_per_task", "save_every", "log_every",
            "diverge_h_norm", "stop_at"]  # None where allowed: the default stands in
for name in POSITIVE:
    value = getattr(args, name)
    if value is not None and not 0 < value < math.inf:
        fail(f"--{name}={value} must be a positive number")
for name in ["weight_decay", "diverge_steps", "seed"]:
    if not 0 <= getattr(args, name) < math.inf:
        fail(f"--{name}={getattr(args, name)} must be zero or more")
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

rows_per_step = args.device_batch_size * args.seq_len * world
if args.total_batch_size % rows_per_step != 0:
    fail(f"--total_batch_size={args.total_batch_size} is not divisible by device_batch_size x seq_len x world = "
         f"{args.device_batch_size} x {args.seq_len} x {world} = {rows_per_step}; change one of them")
grad_accum = args.total_batch_size // rows_per_step
num_steps = max(1, int(max_tokens // args.total_batch_size))
log(f"model: depth {args.depth} ({config.n_prelude}/{config.n_recur}/{config.n_coda}), d_model {config.d_model}, "
    f"{config.n_head} heads, injection {config.injection}, mu_rec {config.mu_rec}, mu_bwd {config.mu_bwd}, "
    f"sampling {config.sampling}, prelude_norm {config.prelude_norm}")
log(f"parameters: {num_params:,} | FLOPs/token (paper's C): {flops_per_token:.4e} | tokens: "
    f"{num_steps * args.total_batch_size:,} | total FLOPs: {flops_per_token * num_steps * args.total_batch_size:.4e} "
    f"| executed matmul FLOPs/token: {executed_flops_per_token:.4e}")
log(f"steps: {num_steps} x {args.total_batch_size:,} tokens = {world} process(es) x {grad_accum} micro-batch(es) x "
    f"{args.device_batch_size} x {args.seq_len} | data: {args.data} | device: {device}, {args.dtype}")

if args.dry_run:  # the memory per GPU a batch needs (model.py's accounting), then stop
    plan = meta_model.memory_plan(args.device_batch_size, args.dtype == "bfloat16",
                                  optimizer_state_bytes(meta_model, muon=args.optimizer == "muon"))
    log(f"memory per GPU (GB): weights {plan['weights'] / 1e9:.1f} + grads {plan['grads'] / 1e9:.1f} + DDP buckets "
        f"{plan['ddp_buckets'] / 1e9:.1f} + optimizer {plan['optimizer'] / 1e9:.1f} + activations "
        f"{plan['activations'] / 1e9:.1f} ({args.device_batch_size} x {args.seq_len} at mu_bwd {config.mu_bwd}, "
        f"{args.dtype}) = {plan['total'] / 1e9:.1f} | largest device batch: {plan['largest_batch'][80]} in 80 GB, "
        f"{plan['largest_batch'][141]} in 141 GB")
    sys.exit(0)

# -----------------------------------------------------------------------------
# The run: what defines it, and its last checkpoint, checked before any work

try:
    tokenizer_path = tokenizer_dir(args.data, args.vocab_size)  # recorded in every checkpoint, for sample.py
    data_key = tokenizer_path.name.removesuffix(f"-{args.vocab_size}")  # content, not path
    run_dir = get_base_dir() / "runs" / (args.run or f"d{args.depth}_{args.injection}")
except (FileNotFoundError, ValueError) as err:
    fail(err)
run_flags = dict(depth=args.depth, d_model=config.d_model, head_dim=config.head_dim, injection=config.injection,
                 mu_rec=config.mu_rec, mu_bwd=config.mu_bwd, sampling=config.sampling, prelude_norm=args.prelude_norm,
                 vocab_size=args.vocab_size, seq_len=args.seq_len, data=data_key, max_tokens=max_tokens,
                 optimizer=args.optimizer, adamw_lr=adamw_lr, muon_lr=args.muon_lr, weight_decay=args.weight_decay,
                 grad_clip=args.grad_clip, warmdown_frac=args.warmdown_frac, total_batch_size=args.total_batch_size,
                 device_batch_size=args.device_batch_size, seed=args.seed)
run_name = run_dir.name
resume_from = find_checkpoint(run_dir.parent, run_name) if any(run_dir.glob("ckpt_*.pt")) else None
if args.resume and resume_from is None:
    fail(f"there is no checkpoint of run {run_name} under {run_dir} to resume; start it without --resume")
ckpt = None
if resume_from:
    try:
        ckpt = read_checkpoint(resume_from, device)
    except ValueError as err:  # truncated or unreadable: the message names the file and what to do
        fail(err)
    recorded = ckpt.get("run", {})
    differ = [f"{name} {recorded.get(name, 'unrecorded')} there, {value} here" for name, value in run_flags.items()
              if recorded.get(name) != value]
    if differ:
        data = " (data: --data's content key, from its files' names, sizes and modification times, or stdlib's " \
            "Python version)" if recorded.get("data") != data_key else ""
        fail(f"run {run_name} ({resume_from}) was started with other flags: {'; '.join(differ)}{data}; "
             f"pass its flags to continue it, or --run=NAME to start another")
    if ckpt["step"] >= num_steps:
        log(f"run {run_name} is done: {resume_from} holds its last step, {num_steps}; nothing to train "
            f"(--run=NAME trains another)")
        sys.exit(0)
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
        fail(f"{err} (the 140M run reads about 240: `python dataset.py download -n 240`); without a GPU, "
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
               if name not in run_flags and name not in ("resume", "dry_run") and getattr(args, name, value) != value]
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
    bundle_dir = [None]
    if master:
        try:
            bundle_dir[0] = str(download_eval_bundle())
        except (OSError, ValueError) as err:
            log(f"CORE skipped: the eval bundle is not available ({err})")
    if ddp:
        dist.broadcast_object_list(bundle_dir)
    if bundle_dir[0] is None:
        return None
    result = evaluate_core(raw_model, tokenizer, bundle_dir[0], max_per_task=args.core_max_per_task, verbose=False)
    log(f"CORE {result['core']:.4f} at T={result['T']} ({result['seconds']:.0f}s)")
    return {"step": step, "core": result["core"], "core_T": result["T"]}


def save(step):
    """Model, optimiser, every virtual rank's loader position, the run's flags; the RNG state is a function of
    (seed, step, virtual rank), reseeded every micro-step, so nothing else is needed. Keeps the newest only."""
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
        entry = {"step": step, "loss": loss_sum.item() / grad_accum, "lr_mult": lrm, "grad_norm": grad_norm.item(),
                 **{f"{group['kind']}_lr": group["lr"] for group in optimizer.param_groups},  # adamw_lr, muon_lr
                 "tokens_per_s": tokens_per_second, "rho": raw_model.spectral_radius(), "skipped_steps": skipped_steps,
                 **{key: None if value is None else value.item() for key, value in stats.items()}}
        if peak_flops and tokens_per_second:
            entry["mfu"] = executed_flops_per_token * tokens_per_second / (peak_flops * world)
        if args.compile:  # a count that still grows after the first steps is recompiling (model.compile_blocks)
            entry["graphs"] = dynamo_counters["stats"]["unique_graphs"]
        if device.type == "cuda":  # against the --dry_run plan
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
    for result in filter(None, results):
        record(result)

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
