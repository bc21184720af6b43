"""
train.py: train Parcae (or a baseline) with the paper's recipe (METHOD.md §2), on a CPU or 8 GPUs.

    torchrun --nproc_per_node=8 train.py             # the defaults: the paper's 140M on FineWeb-Edu
    torchrun --nproc_per_node=8 train.py --depth=24  # the paper's 1.3B
    python train.py --depth=24 --dry_run             # sizes, tokens, FLOPs, memory per GPU only
    bash runs/cpu.sh                                 # a small looped model on a CPU: its flags

Every optimiser step sees the same rows, depths and h0 whatever the number of processes.
Its micro-batches are "virtual ranks" v = rank * grad_accum + micro.
Each has its own share of the data and its own seed.
So two processes reproduce one, and a resumed run continues exactly.
Workers that torchrun --max_restarts restarts resume from the last checkpoint.

A run (--run, default d<depth>_<injection>) is defined by its RUN_FLAGS, which its checkpoint
records.

- The same command continues it from its last checkpoint; a finished run exits at once.
- A command whose run flags differ is refused, naming those flags.
- A diverged run stops with exit status 3 (docs/troubleshooting.md).
"""

import argparse
import math
import os
import sys
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from data import DataLoader, packing, val_batches
from eval_core import core_during_training, evaluate_during_training
from model import INJECTIONS, PAPER_TOKENS, SAMPLINGS, Parcae, ParcaeConfig, mean_steps
from optim import (build_optimizer, learning_rate_for_depth, lr_multiplier, muon_momentum,
                   optimizer_state_bytes, weight_decay_at)
from nanoparcae.common import (check_writable, exit_in_one_line, fail, init_distributed,
                               no_buffer_sync, parse_device, peak_bf16_flops, print0,
                               rank_and_world, spans)
from nanoparcae import dataset, flags, memory, ranks
from nanoparcae.checkpoint import (resume, resume_refusal, save_and_prune, saved_bytes,
                                   training_model)
from nanoparcae.divergence import Divergence
from nanoparcae.download import shared_eval_bundle
from nanoparcae.metrics import Metrics, compile_counts, read_at_once
from nanoparcae.run import claim_run, identify_run, run_folder
from nanoparcae.tokenizer import vocab_size_flag

sys.excepthook = exit_in_one_line  # a ValueError the library raises: one line, status 2

# -----------------------------------------------------------------------------
# Flags. The defaults are the paper's 140M recipe (METHOD.md §2); runs/cpu.sh passes a small one's.


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's layout and shows every default."""


parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter,
                                 allow_abbrev=False)
parser.error = fail  # an unknown flag or a bad value: one line, status 2
flag = parser.add_argument
# the model
flag("--depth", type=flags.positive(int), default=6, help="layers, L_P = L_R = L_C = depth/3")
flag("--d_model", type=flags.positive(int), default=None, help="width (None: 128 * (depth/3 + 4))")
flag("--head_dim", type=flags.positive(int), default=128, help="attention head width")
flag("--mu_rec", type=flags.positive(int), default=8, help="mean recurrence depth")
flag("--mu_bwd", type=flags.positive(int), default=None,
     help="backpropagated depth (None: ceil(mu_rec/2))")
flag("--injection", default="diagonal", choices=INJECTIONS,
     help="diagonal = Parcae, concat = RDM, add, none = fixed-depth Transformer")
flag("--depth_sampling", default="per_sequence", choices=list(SAMPLINGS), metavar="SCHEME",
     help=f"recurrence-depth sampler, one of {', '.join(SAMPLINGS)} (model.py)")
flag("--prelude_norm", type=int, default=1, choices=[0, 1], help="RMSNorm on the prelude's output")
flag("--vocab_size", type=vocab_size_flag, default=32768, help="tokens, the specials included")
flag("--seq_len", type=flags.positive(int), default=2048, help="tokens per row")
# the data and the horizon: the first given of --max_tokens, --target_flops, --param_data_ratio
flag("--data", default="fineweb-edu",
     help="fineweb-edu, stdlib, or a path / glob of .txt, .jsonl, .parquet, .py files")
flag("--max_tokens", type=flags.positive(float), default=None,
     help="tokens to train (None: the paper's)")
flag("--target_flops", type=flags.positive(float), default=None,
     help="horizon in FLOPs (the paper's C)")
flag("--param_data_ratio", type=flags.positive(float), default=None,
     help="horizon in tokens per param")
# the recipe
flag("--device_batch_size", type=flags.positive(int), default=None,
     help="sequences per micro-batch per process (None: the largest that fits)")
flag("--total_batch_size", type=flags.positive(int), default=524_288,
     help="tokens per optimiser step")
flag("--optimizer", default="muon", choices=["muon", "adamw"],
     help="muon: Muon on the blocks' matrices and AdamW on the rest; adamw: AdamW on all")
flag("--adamw_lr", type=flags.positive(float), default=None,
     help="AdamW's rate (None: 8e-3 up to the 370M, 6e-3 above)")
flag("--muon_lr", type=flags.positive(float), default=8e-3,
     help="Muon's rate on the blocks' matrices")
flag("--weight_decay", type=flags.zero_or_more(float), default=0.2,
     help="Muon's cautious weight decay")
flag("--grad_clip", type=flags.positive(float), default=1.0, help="gradient norm clip")
flag("--warmdown_frac", type=flags.unit_fraction, default=0.5,
     help="last fraction of steps, decaying the rate to 0")
flag("--seed", type=flags.zero_or_more(int), default=0,
     help="initial weights, data order, depths and h0")
# how it runs, evaluates, logs and saves
# Without a GPU, a bare `python train.py` runs the paper's 140M on the CPU (bfloat16, compiled).
# Without the shards it stops in one line naming their download and runs/cpu.sh.
# With them it trains the 140M at a CPU's pace.
flag("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
flag("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
     help="autocast dtype of the matmuls (bfloat16 on a CPU runs the GPU's numerics)")
flag("--compile", type=int, default=1, choices=[0, 1], help="torch.compile the blocks")
flag("--eval_every", type=flags.positive(int), default=250, help="steps between validation evals")
flag("--eval_tokens", type=flags.positive(int), default=10 * 524_288,
     help="validation tokens per eval")
flag("--core_every", type=flags.steps_or_never, default=2000,
     help="steps between CORE evals, and at the end (-1: never)")
flag("--core_max_per_task", type=flags.positive(int), default=500,
     help="CORE examples per task during training")
flag("--save_every", type=flags.positive(int), default=1000, help="steps between checkpoints")
flag("--log_every", type=flags.positive(int), default=1, help="steps between log lines")
flag("--run", default=None, help="run name (None: d<depth>_<injection>)")
flag("--resume", action="store_true", help="require a checkpoint to continue from")
flag("--stop_at", type=flags.positive(int), default=None, help="end this command after that step")
flag("--dry_run", action="store_true", help="print the configuration and memory plan, and exit")
flags.add_operational(parser)  # timeouts, divergence thresholds, the compile backend
args = parser.parse_args()
device = parse_device(args.device)
# A run is these flags' values: its checkpoints record them, and continuing it with another value
# of one is refused. Every other flag may change when a run continues.
RUN_FLAGS = ("depth", "d_model", "head_dim", "mu_rec", "mu_bwd", "injection", "depth_sampling",
             "prelude_norm", "vocab_size", "seq_len", "data", "max_tokens", "param_data_ratio",
             "target_flops", "device_batch_size", "total_batch_size", "optimizer", "adamw_lr",
             "muon_lr", "weight_decay", "grad_clip", "warmdown_frac", "seed")

# -----------------------------------------------------------------------------
# The model and its horizon, sized on the meta device: nothing is allocated

config = ParcaeConfig.from_depth(
    args.depth, vocab_size=args.vocab_size, seq_len=args.seq_len, head_dim=args.head_dim,
    mu_rec=args.mu_rec, mu_bwd=args.mu_bwd, injection=args.injection,
    sampling=args.depth_sampling, prelude_norm=bool(args.prelude_norm),
    **({"d_model": args.d_model} if args.d_model else {}))
with torch.device("meta"):
    meta_model = Parcae(config)
num_params = meta_model.num_params()
flops_per_token = meta_model.paper_flops_per_token()  # C (METHOD.md §2): the horizon's unit
executed_flops_per_token = meta_model.matmul_flops_per_token()  # at the mean depths: MFU's
if args.max_tokens:
    max_tokens = args.max_tokens
elif args.target_flops:
    max_tokens = args.target_flops / flops_per_token
elif args.param_data_ratio:
    max_tokens = args.param_data_ratio * num_params
elif args.depth in PAPER_TOKENS:
    max_tokens = PAPER_TOKENS[args.depth]
else:
    fail(f"no default horizon for --depth={args.depth}; give --max_tokens, --target_flops or "
         f"--param_data_ratio")
num_steps = max(1, int(max_tokens // args.total_batch_size))
tokens = num_steps * args.total_batch_size
adamw_lr = args.adamw_lr or learning_rate_for_depth(args.depth)

# -----------------------------------------------------------------------------
# Processes: torchrun sets RANK; NCCL on CUDA, gloo on CPU. A plain `python train.py` is one.

ddp = "RANK" in os.environ and not args.dry_run
if ddp:
    device = init_distributed(device, timedelta(seconds=args.collective_timeout),
                              timedelta(seconds=args.rank0_timeout))  # the GPU of this local rank
rank, world = rank_and_world()
if args.dry_run and "RANK" in os.environ:  # torchrun's processes: one plan for all, printed once
    if int(os.environ["RANK"]):
        sys.exit(0)
    world = int(os.environ["WORLD_SIZE"])
if device.type == "cuda":
    torch.backends.cuda.matmul.allow_tf32 = True
print0(f"model: depth {args.depth} ({config.n_prelude}/{config.n_recur}/{config.n_coda}), "
       f"d_model {config.d_model}, {config.n_head} heads, injection {config.injection}, mu_rec "
       f"{config.mu_rec}, mu_bwd {config.mu_bwd}, sampling {config.sampling}, prelude_norm "
       f"{config.prelude_norm}")
if config.mu_bwd > config.mu_rec:  # warned, not refused: full backprop is an ablation
    no_grad, with_grad = mean_steps(config)
    print0(f"warning: --mu_bwd={config.mu_bwd} > --mu_rec={config.mu_rec}: "
           f"{with_grad / (no_grad + with_grad):.0%} of the loop's steps are backpropagated, and "
           f"memory grows with the depth drawn; for the paper's truncation (METHOD.md §2) pass "
           f"--mu_bwd={math.ceil(config.mu_rec / 2)} or leave it out")
print0(f"parameters: {num_params:,} | FLOPs/token (paper's C, the horizon's unit): "
       f"{flops_per_token:.4e} | tokens: {tokens:,} | total FLOPs: {flops_per_token * tokens:.4e} "
       f"| executed matmul FLOPs/token (MFU's): {executed_flops_per_token:.4e}, C / executed "
       f"{flops_per_token / executed_flops_per_token:.2f}")

# -----------------------------------------------------------------------------
# The device batch, the run and its data, settled before anything is built or written

# On a GPU the device batch is the largest whose memory plan fits (nanoparcae/memory.py)
optimizer_bytes = optimizer_state_bytes(meta_model, muon=args.optimizer == "muon")
batch = memory.choose_device_batch(meta_model, args, device, world, optimizer_bytes)
if args.dry_run:
    sys.exit(0)
# A refusal that one rank meets stops every rank, in one line; a missing shard names its download
paper_run = max_tokens == PAPER_TOKENS.get(args.depth)
sized = f"--depth={args.depth}" if paper_run else f"--tokens={tokens:.4g}"  # this run's download
with ranks.refusing_alike():  # --resume with nothing to resume says so before any data check
    if args.resume and (refusal := resume_refusal(run_folder(args))):
        raise ValueError(refusal)
    # the run's FineWeb-Edu order is a shuffle of the training shards: its checkpoint records them
    shards = spans(dataset.fineweb_train_shards(sized), ",") if args.data == "fineweb-edu" else None
run = identify_run(args, RUN_FLAGS, batch, device, d_model=config.d_model, mu_bwd=config.mu_bwd,
                   max_tokens=max_tokens, adamw_lr=adamw_lr,
                   **({"train_shards": shards} if shards else {}))
args.device_batch_size = run.device_batch_size  # a run keeps its batch: it fixes the data order
grad_accum = run.grad_accum  # micro-batches per step: the step's rows / (world x device batch)
if run.step >= num_steps:
    print0(f"run {run.name} is done: {run.checkpoint} holds its last step, {num_steps}; nothing "
           f"to train (--run=NAME trains another)")
    sys.exit(0)
print0(f"steps: {num_steps} x {args.total_batch_size:,} tokens = {world} process(es) x "
       f"{grad_accum} micro-batch(es) x {args.device_batch_size} x {args.seq_len} | data: "
       f"{args.data} | device: {device}, {args.dtype}")
print0(f"output: {run.dir}")
if rank == 0:  # the writer: a folder or disk that cannot take a checkpoint stops it before the data
    check_writable(run.dir, "the run's checkpoints",
                   needs=saved_bytes({"model": meta_model.state_dict()}) + optimizer_bytes)
with ranks.refusing_alike():  # global rank 0 alone trains the tokenizer, on first use
    if rank == 0:
        dataset.get_tokenizer(args.data, args.vocab_size)
with ranks.refusing_alike():  # a rank's own refusal (none of its share to read) included
    tokenizer = dataset.get_tokenizer(args.data, args.vocab_size, train=False)  # None: not here
    ranks.agree_on_data(tokenizer, shards)  # rank 0's tokenizer and shards on every node
    # the horizon against the tokens the loader keeps: a FineWeb-Edu run never repeats unasked
    held = dataset.train_tokens(args.data, tokenizer)  # a split without documents is named first
    packed = packing(tokenizer, args.data, args.seq_len, args.seed, world * grad_accum)
    dataset.check_data(args.data, held, tokens, packed, args.seq_len, world * grad_accum)
    # one loader per virtual rank v = rank * grad_accum + micro, one read of each chunk for all
    reader = dataset.ChunkReader()
    loaders = [DataLoader(tokenizer, args.data, "train", args.device_batch_size, args.seq_len,
                          rank=rank * grad_accum + micro, world_size=world * grad_accum,
                          seed=args.seed, device=device, reader=reader, sharers=grad_accum)
               for micro in range(grad_accum)]
    val_data = list(val_batches(tokenizer, args.data, args.device_batch_size, args.seq_len,
                                args.eval_tokens, rank, world, device, reader))  # every eval's
# The lock comes after every check that can refuse the command: a refused one writes nothing.
# Holding it, the run's folder must be as identify_run checked it: none trained it meanwhile
run_lock = claim_run(run)  # one trainer per run, until this process ends

# -----------------------------------------------------------------------------
# The model and the optimizer: MuonAdamW (METHOD.md §2), or AdamW on all

# The random init runs once: on a fresh run's rank 0, whose weights DDP broadcasts to the others;
# a resume gives every rank its checkpoint's weights instead
model = raw_model = training_model(config, device, args.seed, run.ckpt and run.ckpt["model"],
                                   initialise=rank == 0)
if args.compile:
    model.compile_regions(backend=args.compile_backend)
    from torch._dynamo.utils import counters as dynamo_counters
if ddp:  # the RoPE tables are constant: no buffers to sync at each forward
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                **no_buffer_sync())
optimizer = build_optimizer(raw_model, adamw_lr=adamw_lr, muon_lr=args.muon_lr,
                            weight_decay=args.weight_decay, muon=args.optimizer == "muon")
if args.compile:
    optimizer.compile(backend=args.compile_backend)  # each group's update fused (optim.py)
bf16 = args.dtype == "bfloat16"  # autocast: the matmuls in bfloat16, the weights in float32
autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
# a resume (also of workers torchrun --max_restarts restarted): the optimizer's and loaders' state
start_step, skipped_steps, lowest_val_loss = resume(run, optimizer, loaders, rank * grad_accum,
                                                    args, RUN_FLAGS)
batches = [iter(loader) for loader in loaders]
data_epoch = loaders[0].next_doc[0]  # the epoch of the training data the loaders read

# -----------------------------------------------------------------------------
# Training loop, and its evals

bundle_dir = None  # CORE's tasks, fetched once before step 1, on every rank or on none
if args.core_every > 0:
    bundle_dir, why = shared_eval_bundle()
    if bundle_dir is None:
        print0(f"CORE skipped for this run: {why}")
peak_flops = peak_bf16_flops(device)
# METHOD.md §2: each virtual rank draws its own depths (on the CPU) and h0 (where it is used)
depth_generator, h0_generator = torch.Generator(), torch.Generator(device)
divergence = Divergence(args.vocab_size, args.dtype, args.diverge_steps, args.diverge_h_norm,
                        lowest_val_loss)
val_key = f"val_loss_T{1 if config.injection == 'none' else config.mu_rec}"  # what the rule reads
host_rho = getattr(raw_model.injection, "rho_on_host", False)  # concat's: every --rho_every steps
metrics = Metrics(run.dir, start_step)
tokens_per_second, t_run, step, save_due, verdict = None, time.time(), start_step, False, None
while step < num_steps and (args.stop_at is None or step < args.stop_at):

    # --- one step: grad_accum micro-batches forward and backward, clip, the schedules, the update
    t0, graphs = time.time(), compile_counts(dynamo_counters)["graphs"] if args.compile else 0
    loss_sum, stats = torch.zeros((), device=device), {}
    for micro in range(grad_accum):
        # one seed per (seed, step, virtual rank): any number of processes draws the same h0, depths
        seed = (args.seed * 1_000_003 + step) * 65_537 + rank * grad_accum + micro
        depth_generator.manual_seed(seed)
        h0_generator.manual_seed(seed)
        x, y = next(batches[micro])
        last = micro == grad_accum - 1  # DDP all-reduces the gradients there only
        with (model.no_sync() if ddp and not last else nullcontext()), autocast:
            loss = model(x, y, depth_generator=depth_generator, h0_generator=h0_generator,
                         diagnostics=stats if last else None)
        (loss / grad_accum).backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip)
    # optim.py also scales each Muon group's lr by its shape and its decay by the lr (METHOD.md §2)
    lrm = lr_multiplier(step, num_steps, args.warmdown_frac)
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * lrm
        if group["kind"] == "muon":
            group["momentum"] = muon_momentum(step)
            group["weight_decay"] = weight_decay_at(step, num_steps, args.weight_decay)
    # [any rank's gradients non-finite, the largest ||h_T||], reduced at once: all skip alike
    h_norm = stats["h_norm"]
    worst = torch.stack([(~torch.isfinite(grad_norm)).float(),
                         torch.zeros((), device=device) if h_norm is None else h_norm.float()])
    if ddp:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
    # the skip rule's read brings the log line's values too: one wait for the device, not two
    non_finite, worst_h_norm = worst.unbind()
    logged = read_at_once({"non_finite": non_finite, "worst_h_norm": worst_h_norm, "loss": loss_sum,
                           "grad_norm": grad_norm, **stats})
    non_finite, worst_h_norm = logged["non_finite"], logged["worst_h_norm"]
    if non_finite:
        skipped_steps += 1
        print0(f"step {step + 1}: non-finite gradients, update skipped ({skipped_steps} so far)")
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    step += 1

    # --- once in a while: the log line
    dt = time.time() - t0
    # steady state: past the first step's warm-up, and not a step that compiled a graph
    if step > start_step + 1 and (not args.compile or compile_counts(dynamo_counters)["graphs"]
                                  == graphs):
        tokens_per_second = args.total_batch_size / dt if tokens_per_second is None \
            else 0.9 * tokens_per_second + 0.1 * args.total_batch_size / dt
    if step % args.log_every == 0 or step == num_steps:
        rho_every = args.rho_every or args.eval_every
        rho_due = not host_rho or step % rho_every == 0 or step == num_steps
        rho = raw_model.spectral_radius() if rho_due else None  # after the update: its own wait
        logged["rho"] = None if rho is None else rho.item()
        entry = {"step": step, "loss": logged["loss"] / grad_accum, "lr_mult": lrm,
                 "grad_norm": logged["grad_norm"],
                 **{f"{group['kind']}_lr": group["lr"] for group in optimizer.param_groups},
                 "tokens_per_s": tokens_per_second, "rho": logged["rho"],
                 "skipped_steps": skipped_steps, **{key: logged[key] for key in stats}}
        if peak_flops and tokens_per_second:
            entry["mfu"] = executed_flops_per_token * tokens_per_second / (peak_flops * world)
        metrics.log_step(entry, num_steps, args.total_batch_size, args.compile, device)

    # --- a new epoch of the training data, read again in a new order
    if loaders[0].next_doc[0] > data_epoch:
        data_epoch = loaders[0].next_doc[0]
        print0(f"step {step}: the loaders began reading epoch {data_epoch + 1} of the data")

    # --- once in a while: evals, in the training's numerics
    results = []
    with autocast:
        if step % args.eval_every == 0 or step == num_steps:
            results.append(evaluate_during_training(step, raw_model, tokenizer, val_data))
        if bundle_dir and (step % args.core_every == 0 or step == num_steps):
            results.append(core_during_training(step, raw_model, tokenizer, bundle_dir,
                                                args.core_max_per_task))
    results = [result for result in results if result]
    for result in results:  # the graph count after evals: they compile graphs of their own
        metrics.record(result, args.compile)

    # --- every step: the divergence rule (docs/troubleshooting.md)
    val_loss = next((result[val_key] for result in results if val_key in result), None)
    verdict = divergence.check(step, not non_finite, None if h_norm is None else worst_h_norm,
                               val_loss)
    if verdict:
        metrics.record(divergence.announce(verdict, step, run.dir))
        if "diverged_at" in verdict:
            break

    # --- once in a while: a checkpoint, never inside a streak of bad steps (it may be diverging)
    save_due = save_due or step % args.save_every == 0 or step == num_steps or step == args.stop_at
    if save_due and divergence.bad_steps == 0:
        save_and_prune(run.dir, step, raw_model, loaders, skipped_steps=skipped_steps,
                       optimizer=optimizer.state_dict(), run=run.flags, args=vars(args),
                       tokenizer_dir=str(run.tokenizer_dir),
                       lowest_val_loss=divergence.lowest_val_loss)
        save_due = False

diverged = verdict is not None and "diverged_at" in verdict
print0(f"{'stopped' if diverged else 'done'}: {step} steps in {(time.time() - t_run) / 60:.1f} "
       f"min, {skipped_steps} skipped")
for loader in loaders:
    loader.close()
if ddp:
    dist.destroy_process_group()
if diverged:
    sys.exit(3)  # a status of its own: neither success nor bad input (2)
