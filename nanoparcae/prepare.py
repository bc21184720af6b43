"""
nanoparcae/prepare.py: train.py's set-up, everything settled before its first step, in one call.
Its jobs:

- size the model and its horizon on the meta device (plan_run).
- start the processes torchrun launched (start_processes).
- settle the run: its device batch, identity, data and lock (prepare_run).
- continue a run from its checkpoint: weights, loaders and counts (resume).

prepare_run raises ValueError (or EnvironmentFailure) alike on every rank before anything is written.
"""

import math
import os
from datetime import timedelta
from types import SimpleNamespace

import torch

from data import DataLoader, val_batches
from model import Parcae, ParcaeConfig, mean_steps
from optim import learning_rate_for_depth, optimizer_state_bytes
from nanoparcae import dataset, memory, ranks
from nanoparcae.checkpoint import latest, saved_bytes, training_model
from nanoparcae.command import spans
from nanoparcae.download import PAPER_TOKENS
from nanoparcae.tokenizer import get_tokenizer
from nanoparcae.files import check_writable
from nanoparcae.ranks import init_distributed, parse_device, print0, rank_and_world
from nanoparcae import run as runs


def plan_run(args):
    """The model sized on the meta device, and its horizon -> namespace.
    Fields: config, meta_model, num_params, flops_per_token, executed_flops_per_token, max_tokens,
    num_steps, tokens (what the steps train), adamw_lr. Nothing is allocated."""
    config = ParcaeConfig.from_depth(
        args.depth, vocab_size=args.vocab_size, seq_len=args.seq_len, head_dim=args.head_dim,
        mu_rec=args.mu_rec, mu_bwd=args.mu_bwd, injection=args.injection, sampling=args.depth_sampling,
        prelude_norm=bool(args.prelude_norm), **({"d_model": args.d_model} if args.d_model else {}))
    with torch.device("meta"):
        meta_model = Parcae(config)
    num_params = meta_model.num_params()
    flops_per_token = meta_model.paper_flops_per_token()  # C (METHOD.md §2): the horizon's unit
    if args.max_tokens:
        max_tokens = args.max_tokens
    elif args.target_flops:
        max_tokens = args.target_flops / flops_per_token
    elif args.param_data_ratio:
        max_tokens = args.param_data_ratio * num_params
    elif args.depth in PAPER_TOKENS:
        max_tokens = PAPER_TOKENS[args.depth]
    else:
        raise ValueError(f"no default horizon for --depth={args.depth}; give --max_tokens, --target_flops "
                         f"or --param_data_ratio")
    num_steps = max(1, int(max_tokens // args.total_batch_size))
    return SimpleNamespace(config=config, meta_model=meta_model, num_params=num_params,
                           flops_per_token=flops_per_token, max_tokens=max_tokens,
                           executed_flops_per_token=meta_model.matmul_flops_per_token(),  # MFU's
                           num_steps=num_steps, tokens=num_steps * args.total_batch_size,
                           adamw_lr=args.adamw_lr or learning_rate_for_depth(args.depth))


def start_processes(args):
    """Join torchrun's processes (RANK set; NCCL on CUDA, gloo on CPU) -> (device, ddp, rank, world).
    A --dry_run joins none: rank 0 plans for torchrun's world, the others return world None."""
    device = parse_device(args.device)
    ddp = "RANK" in os.environ and not args.dry_run
    if ddp:  # the GPU of this local rank
        device = init_distributed(device, timedelta(seconds=args.collective_timeout),
                                  timedelta(seconds=args.rank0_timeout))
    rank, world = rank_and_world()
    if args.dry_run and "RANK" in os.environ:  # one plan for all torchrun's processes, printed once
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    return device, ddp, rank, (None if rank and args.dry_run else world)


def describe(args, plan):
    """The model, its sizes and its horizon, in three lines (and a warning for full backprop)."""
    config, tokens = plan.config, plan.tokens
    print0(f"model: depth {args.depth} ({config.n_prelude}/{config.n_recur}/{config.n_coda}), d_model "
           f"{config.d_model}, {config.n_head} heads, injection {config.injection}, mu_rec {config.mu_rec}, "
           f"mu_bwd {config.mu_bwd}, sampling {config.sampling}, prelude_norm {config.prelude_norm}")
    if config.mu_bwd > config.mu_rec:  # warned, not refused: full backprop is an ablation
        no_grad, with_grad = mean_steps(config)
        print0(f"warning: --mu_bwd={config.mu_bwd} > --mu_rec={config.mu_rec}: "
               f"{with_grad / (no_grad + with_grad):.0%} of the loop's steps are backpropagated, and memory "
               f"grows with the depth drawn; for the paper's truncation (METHOD.md §2) pass "
               f"--mu_bwd={math.ceil(config.mu_rec / 2)} or leave it out")
    print0(f"parameters: {plan.num_params:,} | FLOPs/token (paper's C, the horizon's unit): "
           f"{plan.flops_per_token:.4e} | tokens: {tokens:,} | total FLOPs: {plan.flops_per_token * tokens:.4e} "
           f"| executed matmul FLOPs/token (MFU's): {plan.executed_flops_per_token:.4e}, C / executed "
           f"{plan.flops_per_token / plan.executed_flops_per_token:.2f}")


def prepare_run(args, run_flags):
    """Do everything before the first step -> namespace, or None when there is nothing to train.
    None means a --dry_run (the plan printed) or a finished run (said so). The namespace holds:

    - plan_run's fields, device, ddp, rank, world and grad_accum.
    - the run (run.py's identity, its lock held).
    - tokenizer, loaders and val_data.
    - model (on device, in train mode).
    - step, skipped_steps, lowest_val_loss and optimizer_state (None: a fresh run).

    Every check that can refuse the command comes before the run's lock, its first write."""
    plan = plan_run(args)
    device, ddp, rank, world = start_processes(args)
    if world is None:  # a --dry_run's other ranks: rank 0 prints the plan
        return None
    describe(args, plan)
    # On a GPU the device batch is the largest whose memory plan fits (nanoparcae/memory.py)
    optimizer_bytes = optimizer_state_bytes(plan.meta_model, muon=args.optimizer == "muon")
    batch = memory.choose_device_batch(plan.meta_model, args, device, world, optimizer_bytes)
    if args.dry_run:
        return None
    # A refusal one rank meets stops every rank, in one line; a missing shard names its download
    tokens = plan.tokens
    paper_run = plan.max_tokens == PAPER_TOKENS.get(args.depth)
    sized = f"--depth={args.depth}" if paper_run else f"--tokens={tokens:.4g}"  # its own download
    with ranks.refusing_alike():  # --resume with nothing to resume says so before any data check
        folder = runs.run_folder(args)
        if args.resume and not latest(folder):
            raise ValueError(f"there is no checkpoint of run {folder.name} under {folder} to resume; start "
                             f"it without --resume")
        # the run's FineWeb-Edu order is a shuffle of the training shards: its checkpoint records them
        shards = spans(dataset.fineweb_train_shards(sized), ",") if args.data == "fineweb-edu" else None
    run = runs.identify_run(args, run_flags, batch, device, d_model=plan.config.d_model,
                            mu_bwd=plan.config.mu_bwd, max_tokens=plan.max_tokens, adamw_lr=plan.adamw_lr,
                            **({"train_shards": shards} if shards else {}))
    args.device_batch_size = run.device_batch_size  # a run keeps its batch: it fixes the data order
    if run.step >= plan.num_steps:
        print0(f"run {run.name} is done: {run.checkpoint} holds its last step, {plan.num_steps}; nothing to "
               f"train (--run=NAME trains another)")
        return None
    print0(f"steps: {plan.num_steps} x {args.total_batch_size:,} tokens = {world} process(es) x "
           f"{run.grad_accum} micro-batch(es) x {args.device_batch_size} x {args.seq_len} | data: "
           f"{args.data} | device: {device}, {args.dtype}")
    print0(f"output: {run.dir}")
    if rank == 0:  # the writer: a folder or disk that cannot take a checkpoint stops it before the data
        check_writable(run.dir, "the run's checkpoints",
                       needs=saved_bytes({"model": plan.meta_model.state_dict()}) + optimizer_bytes)
    data = open_data(args, tokens, shards, run.grad_accum, device)
    run.lock = runs.claim_run(run)  # one trainer per run, until this process ends
    # The random init runs once: on a fresh run's rank 0, whose weights DDP broadcasts to the others
    model = training_model(plan.config, device, args.seed, run.ckpt and run.ckpt["model"],
                           initialise=rank == 0)
    return SimpleNamespace(**vars(plan), **vars(data), device=device, ddp=ddp, rank=rank, world=world,
                           grad_accum=run.grad_accum, run=run, model=model,
                           **resume(run, data.loaders, rank * run.grad_accum, args, run_flags))


def open_data(args, tokens, shards, grad_accum, device):
    """The run's tokenizer, checked data, loaders and validation batches -> namespace.
    One loader per virtual rank v = rank * grad_accum + micro, one read of each chunk for all."""
    rank, world = rank_and_world()
    with ranks.refusing_alike():  # global rank 0 alone trains the tokenizer, on first use
        if rank == 0:
            get_tokenizer(args.data, args.vocab_size)
    with ranks.refusing_alike():  # a rank's own refusal (none of its share to read) included
        tokenizer = get_tokenizer(args.data, args.vocab_size, train=False)  # None: not here
        ranks.agree_on_data(tokenizer, shards)  # rank 0's tokenizer and shards on every node
        dataset.check_horizon(args.data, tokens)
        reader = dataset.ChunkReader()
        loaders = [DataLoader(tokenizer, args.data, "train", args.device_batch_size, args.seq_len,
                              rank=rank * grad_accum + micro, world_size=world * grad_accum,
                              seed=args.seed, device=device, reader=reader, sharers=grad_accum)
                   for micro in range(grad_accum)]
        val_data = list(val_batches(tokenizer, args.data, args.device_batch_size, args.seq_len,
                                    args.eval_tokens, rank, world, device, reader))  # every eval's
    return SimpleNamespace(tokenizer=tokenizer, loaders=loaders, val_data=val_data)


def resume(run, loaders, first, args, run_flags):
    """Continue `run` from its checkpoint run.ckpt (None: a fresh run) -> dict of the loop's start:
    step, skipped_steps, lowest_val_loss and optimizer_state (None: fresh).
    It loads each loader's position (loaders[i] reads for virtual rank first + i).
    It says which other flags changed, then frees the checkpoint."""
    if run.ckpt is None:
        return dict(step=0, skipped_steps=0, lowest_val_loss=math.inf, optimizer_state=None)
    ckpt, run.ckpt = run.ckpt, None
    for i, loader in enumerate(loaders):
        loader.load_state_dict(ckpt["loader"][first + i])
    changed = [f"--{name} {value} -> {getattr(args, name)}" for name, value in ckpt["args"].items()
               if name in vars(args) and name not in (*run_flags, "resume", "dry_run")
               and getattr(args, name) != value]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # torchrun --max_restarts restarted it
    print0(f"resumed {run.name} at step {ckpt['step']}" + (f", elastic restart {restart}" if restart else "")
           + f", from {run.checkpoint} (--run=NAME trains another)"
           + (f"; changed: {', '.join(changed)}" if changed else ""))
    return dict(step=ckpt["step"], skipped_steps=ckpt["skipped_steps"], lowest_val_loss=ckpt["lowest_val_loss"],
                optimizer_state=ckpt["optimizer"])
