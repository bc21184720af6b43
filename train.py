"""
train.py: train Parcae (or a baseline) with the paper's recipe (METHOD.md §2), on a CPU or 8 GPUs.

    torchrun --nproc_per_node=8 train.py             # the defaults: the paper's 140M on FineWeb-Edu
    torchrun --nproc_per_node=8 train.py --depth=24  # the paper's 1.3B
    python train.py --depth=24 --dry_run             # sizes, tokens, FLOPs, memory per GPU only
    bash runs/cpu.sh                                 # a small looped model on a CPU: its flags

Every optimiser step sees the same rows, depths and h0 whatever the number of processes.
Its micro-batches are "virtual ranks" v = rank * grad_accum + micro, each with its data and seed.
So two processes reproduce one, and a resumed run continues exactly.

A run (--run, default d<depth>_<injection>) is its RUN_FLAGS' values, which its checkpoint records.
The same command continues it from its last checkpoint, and a finished run exits at once.
A command whose run flags differ is refused, naming them. A diverged run stops with exit status 3.
"""

import math
import os
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from data import DataLoader, evaluate_bpb, val_batches
from model import INJECTIONS, SAMPLINGS, Parcae, ParcaeConfig, from_weights, mean_steps
from optim import build_optimizer, learning_rate_for_depth, lr_multiplier, muon_momentum
from optim import optimizer_state_bytes, weight_decay_at
from nanoparcae import memory, ranks, run as runs
from nanoparcae.checkpoint import save_and_prune, saved_bytes, weights_digest
from nanoparcae.command import command_parser, run_command, spans
from nanoparcae.dataset import ChunkReader, check_horizon, data_key
from nanoparcae.divergence import Divergence
from nanoparcae.download import PAPER_TOKENS
from nanoparcae.files import check_writable
from nanoparcae.metrics import Metrics, read_step
from nanoparcae.ranks import init_distributed, no_buffer_sync, parse_device, peak_bf16_flops, print0
from nanoparcae.tokenizer import check_tokenizer, get_tokenizer, tokenizer_dir, vocab_size_flag

# A run is these flags' values. Its checkpoints record them, and continuing it with another value
# of one is refused. Every other flag may change when a run continues.
RUN_FLAGS = ("depth", "d_model", "head_dim", "mu_rec", "mu_bwd", "injection", "depth_sampling",
             "prelude_norm", "vocab_size", "seq_len", "data", "max_tokens", "param_data_ratio",
             "target_flops", "device_batch_size", "total_batch_size", "optimizer", "adamw_lr",
             "muon_lr", "weight_decay", "grad_clip", "warmdown_frac", "seed")


def parse_args(argv=None):
    """The flags, the paper's 140M recipe by default (METHOD.md §2), runs/cpu.sh a small one's."""
    parser = command_parser(__doc__)
    flag = parser.add_argument
    # the model
    flag("--depth", type=int, default=6, help="layers, L_P = L_R = L_C = depth/3")
    flag("--d_model", type=int, default=None, help="width (None: 128 * (depth/3 + 4))")
    flag("--head_dim", type=int, default=128, help="attention head width")
    flag("--mu_rec", type=int, default=8, help="mean recurrence depth")
    flag("--mu_bwd", type=int, default=None, help="backpropagated depth (None: ceil(mu_rec/2))")
    flag("--injection", default="diagonal", choices=INJECTIONS,
         help="diagonal = Parcae, concat = RDM, add, none = fixed-depth Transformer")
    flag("--depth_sampling", default="per_sequence", choices=list(SAMPLINGS), metavar="SCHEME",
         help=f"recurrence-depth sampler, one of {', '.join(SAMPLINGS)} (model.py)")
    flag("--prelude_norm", type=int, default=1, choices=[0, 1], help="RMSNorm after the prelude")
    flag("--vocab_size", type=vocab_size_flag, default=32768, help="tokens, the specials included")
    flag("--seq_len", type=int, default=2048, help="tokens per row")
    # the data, and the horizon: the first given of --max_tokens, --target_flops, --param_data_ratio
    flag("--data", default="fineweb-edu",
         help="fineweb-edu, stdlib, or a path / glob of .txt, .jsonl, .parquet, .py files")
    flag("--max_tokens", type=float, default=None, help="tokens to train (None: the paper's)")
    flag("--target_flops", type=float, default=None, help="horizon in FLOPs (the paper's C)")
    flag("--param_data_ratio", type=float, default=None, help="horizon in tokens per param")
    # the recipe
    flag("--device_batch_size", type=int, default=None,
         help="sequences per micro-batch per process (None: the largest that fits)")
    flag("--total_batch_size", type=int, default=524_288, help="tokens per optimiser step")
    flag("--optimizer", default="muon", choices=["muon", "adamw"],
         help="muon: Muon on the blocks' matrices and AdamW on the rest; adamw: AdamW on all")
    flag("--adamw_lr", type=float, default=None,
         help="AdamW's rate (None: 8e-3 up to the 370M, 6e-3 above)")
    flag("--muon_lr", type=float, default=8e-3, help="Muon's rate on the blocks' matrices")
    flag("--weight_decay", type=float, default=0.2, help="Muon's cautious weight decay")
    flag("--grad_clip", type=float, default=1.0, help="gradient norm clip")
    flag("--warmdown_frac", type=float, default=0.5, help="final fraction of steps, lr to 0")
    flag("--seed", type=int, default=0, help="initial weights, data order, depths and h0")
    # how it runs, evaluates, logs and saves. Without a GPU a bare `python train.py` runs the 140M
    # on the CPU; without FineWeb-Edu's shards it stops in one line naming their download.
    flag("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    flag("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
         help="autocast dtype of the matmuls (bfloat16 on a CPU runs the GPU's numerics)")
    flag("--compile", type=int, default=1, choices=[0, 1], help="torch.compile the blocks")
    flag("--eval_every", type=int, default=250, help="steps between validation evals")
    flag("--eval_tokens", type=int, default=10 * 524_288, help="validation tokens per eval")
    flag("--save_every", type=int, default=1000, help="steps between checkpoints")
    flag("--log_every", type=int, default=1, help="steps between log lines")
    flag("--run", default=None, help="run name (None: d<depth>_<injection>)")
    flag("--resume", action="store_true", help="require a checkpoint to continue from")
    flag("--stop_at", type=int, default=None, help="end this command after that step")
    flag("--dry_run", action="store_true", help="print the configuration and memory plan, and exit")
    flag("--check", action="store_true",
         help="run the checks training runs before it reads data, and exit: nothing starts")
    # how a run operates, not what it trains
    flag("--compile_backend", default="inductor", choices=["inductor", "eager"],
         help="eager: dynamo's tracing and guards without code generation")
    flag("--rho_every", type=int, default=None,
         help="steps between concat's rho, computed on the host (None: --eval_every)")
    flag("--diverge_steps", type=int, default=5,
         help="bad steps in a row that declare the run diverged (0: never)")
    flag("--diverge_h_norm", type=float, default=None,
         help="a state norm ||h_T|| that is a bad step in any dtype (None: 1e4 in bf16 only)")
    flag("--collective_timeout", type=float, default=600,
         help="seconds a collective waits for every rank before the run fails (NCCL's default)")
    flag("--rank0_timeout", type=float, default=3600,
         help="seconds ranks wait for lone work: rank 0's save, tokenizer, resume read")
    args = parser.parse_args(argv)
    for rule, holds, names in RANGES:  # --vocab_size's type is the tokenizer's own check
        for name in names.split():
            if (value := getattr(args, name)) is not None and not holds(value):
                raise ValueError(f"--{name}={value} must be {rule}")
    return args


INT_LIMIT = 2**31 - 1  # an int flag past int32's range overflows a size or counter in torch
SEED_LIMIT = 2**28 - 1  # each step's seed, (seed * 1_000_003 + step) * 65_537 + v, must fit 64 bits
RANGES = [  # each number flag's range, checked after parsing, where None keeps its default rule
    ("a positive number", lambda v: 0 < v < math.inf, "max_tokens target_flops param_data_ratio "
     "adamw_lr muon_lr grad_clip diverge_h_norm collective_timeout rank0_timeout"),
    (f"between 1 and {INT_LIMIT}", lambda v: 1 <= v <= INT_LIMIT, "depth d_model head_dim mu_rec "
     "mu_bwd seq_len device_batch_size total_batch_size eval_every eval_tokens "
     "save_every log_every stop_at rho_every"),
    ("zero or more", lambda v: 0 <= v < math.inf, "weight_decay"),
    (f"between 0 and {INT_LIMIT}", lambda v: 0 <= v <= INT_LIMIT, "diverge_steps"),
    (f"between 0 and {SEED_LIMIT}", lambda v: 0 <= v <= SEED_LIMIT, "seed"),
    ("between 0 and 1", lambda v: 0 <= v <= 1, "warmdown_frac")]


def main(argv=None):
    args = parse_args(argv)

    # -----------------------------------------------------------------------------
    # The processes torchrun started (NCCL on CUDA, gloo on a CPU) or this one, and the device
    device = parse_device(args.device)
    ddp = "RANK" in os.environ and not (args.dry_run or args.check)  # a plan or a check starts none
    if ddp:
        device = init_distributed(device, timedelta(seconds=args.collective_timeout),
                                  timedelta(seconds=args.rank0_timeout))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.dry_run and rank:  # one plan for torchrun's processes, printed once
        return 0
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    # -----------------------------------------------------------------------------
    # The model's config and the run's horizon, counted in the paper's C (METHOD.md §2)
    config = ParcaeConfig.from_depth(
        args.depth, vocab_size=args.vocab_size, seq_len=args.seq_len, head_dim=args.head_dim,
        mu_rec=args.mu_rec, mu_bwd=args.mu_bwd, injection=args.injection,
        sampling=args.depth_sampling, prelude_norm=bool(args.prelude_norm),
        **({"d_model": args.d_model} if args.d_model else {}))
    with torch.device("meta"):  # sized, nothing allocated
        meta_model = Parcae(config)
    num_params = meta_model.num_params()
    C = meta_model.paper_flops_per_token()  # the horizon's unit; MFU counts what runs (executed)
    executed = meta_model.matmul_flops_per_token()
    max_tokens = (args.max_tokens or args.target_flops and args.target_flops / C
                  or args.param_data_ratio and args.param_data_ratio * num_params
                  or PAPER_TOKENS.get(args.depth))  # the first given, else the paper's
    if not max_tokens:
        raise ValueError(f"no default horizon for --depth={args.depth}; give --max_tokens, "
                         f"--target_flops or --param_data_ratio")
    num_steps = max(1, int(max_tokens // args.total_batch_size))
    tokens = num_steps * args.total_batch_size
    adamw_lr = args.adamw_lr or learning_rate_for_depth(args.depth)

    # -----------------------------------------------------------------------------
    # The run's name and each process's share of a step, in sequences. `--check` ends here, after
    # every check training runs before it reads data or allocates.
    folder = runs.run_folder(args)  # <base dir>/runs/<name>, a name every command finds
    rows = (args.device_batch_size or 1) * args.seq_len * world
    if args.total_batch_size % rows:  # accumulation keeps every micro-batch whole
        raise ValueError(f"--total_batch_size={args.total_batch_size} is not divisible by device "
                         f"batch x seq_len x processes = {args.device_batch_size or 1} x "
                         f"{args.seq_len} x {world}; change --total_batch_size, "
                         f"--device_batch_size or --seq_len")
    sequences = args.total_batch_size // (args.seq_len * world)
    if args.check:
        return 0
    c = config
    print0(f"model: depth {args.depth} ({c.n_prelude}/{c.n_recur}/{c.n_coda}), d_model "
           f"{c.d_model}, {c.n_head} heads, injection {c.injection}, mu_rec {c.mu_rec}, mu_bwd "
           f"{c.mu_bwd}, sampling {c.sampling}, prelude_norm {c.prelude_norm}")
    if c.mu_bwd > c.mu_rec:  # warned, not refused, since full backprop is an ablation
        no_grad, with_grad = mean_steps(c)
        print0(f"warning: --mu_bwd={c.mu_bwd} > --mu_rec={c.mu_rec}, so "
               f"{with_grad / (no_grad + with_grad):.0%} of the loop's steps are backpropagated "
               f"and memory grows with the depth drawn; for the paper's truncation (METHOD.md §2) "
               f"pass --mu_bwd={math.ceil(c.mu_rec / 2)} or leave it out")
    print0(f"parameters: {num_params:,} | FLOPs/token (paper's C, the horizon's unit): {C:.4e} | "
           f"tokens: {tokens:,} | total FLOPs: {C * tokens:.4e} | executed matmul FLOPs/token "
           f"(MFU's): {executed:.4e}, C / executed {C / executed:.2f}")

    # -----------------------------------------------------------------------------
    # The device batch, on a GPU the largest whose memory plan fits (nanoparcae/memory.py)
    optimizer_bytes = optimizer_state_bytes(meta_model, muon=args.optimizer == "muon")
    device_batch_size = memory.choose_device_batch(meta_model, args, device, sequences,
                                                   optimizer_bytes)
    if args.dry_run:
        return 0

    # -----------------------------------------------------------------------------
    # The run and its data, which each rank checks on its own disk. The ranks compare what they
    # found in one gather at the block's end, and a refusal or a difference stops every rank alike.
    with ranks.Agreement() as agreement:
        # --- the run: its newest checkpoint, and the flags it recorded against this command's
        checkpoint, ckpt = runs.open_run(folder, args.resume, device)
        shards = check_horizon(args.data, tokens)  # FineWeb-Edu's training shards, enough of them
        flags = {name: getattr(args, name) for name in RUN_FLAGS}
        flags.update(d_model=c.d_model, mu_bwd=c.mu_bwd, max_tokens=max_tokens, adamw_lr=adamw_lr,
                     data=data_key(args.data))  # the data's content, not its path
        if shards:  # their shuffle is the run's data order
            flags["train_shards"] = spans(shards, ",")
        if ckpt:
            runs.check_flags(checkpoint, ckpt, flags)
        start_step = ckpt["step"] if ckpt else 0
        agreement.share(start=f"run {folder.name} at step {start_step} ("
                        + (f"weights {weights_digest(ckpt)})" if ckpt else "no checkpoint)"))
        if start_step >= num_steps:
            raise ranks.Finished(f"run {folder.name} is done: {checkpoint} holds its last step, "
                                 f"{num_steps}; nothing to train (--run=NAME trains another)")

        # --- the device batch and grad_accum: a resumed run keeps its batch, its data order
        recorded = ckpt and ckpt.get("run", {}).get("device_batch_size")
        if recorded and not args.device_batch_size and recorded != device_batch_size:
            device_batch_size = recorded
            print0(f"device batch: {recorded}, as run {folder.name} recorded (its data order)")
        if sequences % device_batch_size:  # a recorded batch, on another number of processes
            raise ValueError(f"run {folder.name}'s device batch {device_batch_size} does not "
                             f"divide the {sequences} sequences each of {world} process(es) runs "
                             f"per step; continue it on a number of processes it divides")
        grad_accum = sequences // device_batch_size  # micro-batches per process per step
        flags["device_batch_size"] = device_batch_size
        agreement.share(batch=f"device batch {device_batch_size}")
        print0(f"steps: {num_steps} x {args.total_batch_size:,} tokens = {world} process(es) x "
               f"{grad_accum} micro-batch(es) x {device_batch_size} x {args.seq_len} | data: "
               f"{args.data} | device: {device}, {args.dtype}\noutput: {folder}")
        if rank == 0:  # the writer, stopped now by a folder or disk that cannot take a checkpoint
            check_writable(folder, "the run's checkpoints",
                           needs=saved_bytes({"model": meta_model.state_dict()}) + optimizer_bytes)

        # --- the tokenizer (global rank 0 trains it on first use) and the loaders
        tokenizer = get_tokenizer(args.data, args.vocab_size) if rank == 0 else None
        agreement.wait_for_rank0()
        # The other ranks load what rank 0 trained; None when there is none
        tokenizer = tokenizer or get_tokenizer(args.data, args.vocab_size, train=False)
        agreement.share(tokenizer=f"tokenizer {tokenizer.digest}" if tokenizer else "no tokenizer",
                        shards=shards and f"training shards {spans(shards)}")
        if tokenizer is None:
            raise FileNotFoundError(f"no tokenizer at {tokenizer_dir(args.data, args.vocab_size)}")
        if ckpt:  # a resumed run's tokenizer is the one its checkpoint was trained with
            check_tokenizer(ckpt, checkpoint, tokenizer, "or pass --run=NAME to start another run")
        reader = ChunkReader()  # one read of each chunk for the loaders of this process
        loaders = [DataLoader(tokenizer, args.data, "train", device_batch_size, args.seq_len,
                              rank=rank * grad_accum + micro, world_size=world * grad_accum,
                              seed=args.seed, device=device, reader=reader, sharers=grad_accum)
                   for micro in range(grad_accum)]  # one per virtual rank
        val_data = list(val_batches(tokenizer, args.data, device_batch_size, args.seq_len,
                                    args.eval_tokens, rank, world, device, reader))
    if agreement.finished:
        print0(agreement.finished)
        return 0
    lock = runs.claim(folder, checkpoint)  # one trainer per run, and its first write in the folder

    # -----------------------------------------------------------------------------
    # The model, from the checkpoint's weights or from a fresh run's init drawn on rank 0, which DDP
    # broadcasts to the others. Then it is compiled, and wrapped in DDP.
    if ckpt:
        model = from_weights(ckpt["config"], ckpt["model"], device).train()
    elif rank == 0:
        torch.manual_seed(args.seed)  # the init's draws (docs/reading.md)
        model = Parcae(config).to(device)
    else:  # sized without an init, for DDP to fill
        model = meta_model.to_empty(device=device)
        model.init_buffers()  # the RoPE tables, which to_empty left empty
    raw_model = model
    if args.compile:
        model.compile_regions(backend=args.compile_backend)
    if ddp:  # no buffers to sync at each forward, since the RoPE tables are constant
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    **no_buffer_sync())

    # -----------------------------------------------------------------------------
    # The optimizer, MuonAdamW (METHOD.md §2) or AdamW on all
    optimizer = build_optimizer(raw_model, adamw_lr=adamw_lr, muon_lr=args.muon_lr,
                                weight_decay=args.weight_decay, muon=args.optimizer == "muon")
    if args.compile:
        optimizer.compile(backend=args.compile_backend)  # each group's update fused (optim.py)

    # -----------------------------------------------------------------------------
    # The resume point, with the step, the counts, the optimizer's state and every loader's position
    step, skipped_steps, lowest_val_loss = 0, 0, math.inf
    if ckpt:
        step, skipped_steps = ckpt["step"], ckpt["skipped_steps"]
        lowest_val_loss = ckpt["lowest_val_loss"]  # the divergence rule's, across the resume
        optimizer.load_state_dict(ckpt["optimizer"])
        for micro, loader in enumerate(loaders):
            loader.load_state_dict(ckpt["loader"][rank * grad_accum + micro])
        changed = [f"--{name} {value} -> {getattr(args, name)}"
                   for name, value in ckpt["args"].items() if name in vars(args) and name not in
                   (*RUN_FLAGS, "resume", "dry_run") and getattr(args, name) != value]
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # torchrun --max_restarts
        print0(f"resumed {folder.name} at step {step}"
               + (f", elastic restart {restart}" if restart else "")
               + f", from {checkpoint} (--run=NAME trains another)"
               + (f"; changed: {', '.join(changed)}" if changed else ""))
        del ckpt  # the optimizer's and the loaders' states, now in their owners

    # -----------------------------------------------------------------------------
    # Training loop, and its evals
    bf16 = args.dtype == "bfloat16"  # the matmuls in bfloat16, the weights in float32
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    batches = [iter(loader) for loader in loaders]
    data_epoch = loaders[0].next_doc[0]  # the epoch of the training data the loaders read
    peak_flops = peak_bf16_flops(device)
    # each virtual rank draws its own depths (on the CPU) and h0 (where it is used), METHOD.md §2
    depth_generator, h0_generator = torch.Generator(), torch.Generator(device)
    divergence = Divergence(args.vocab_size, args.dtype, args.diverge_steps, args.diverge_h_norm,
                            lowest_val_loss)
    eval_depths = sorted({1, 2, 4, c.mu_rec}) if raw_model.injection else [1]
    val_key = f"val_loss_T{c.mu_rec if raw_model.injection else 1}"  # the divergence rule's
    host_rho = getattr(raw_model.injection, "rho_on_host", False)  # concat's, each --rho_every
    metrics = Metrics(folder, step, args.compile)
    t_run, save_due, verdict = time.time(), False, None
    while step < num_steps and (args.stop_at is None or step < args.stop_at):

        # --- one step: grad_accum micro-batches forward and backward, clip, schedules, update
        t0 = time.time()
        loss_sum, stats = torch.zeros((), device=device), {}
        for micro in range(grad_accum):
            # one seed per (seed, step, virtual rank), so any number of processes draws alike
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
        # optim.py scales each Muon group's lr by its shape, its decay by the lr (METHOD.md §2)
        lrm = lr_multiplier(step, num_steps, args.warmdown_frac)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            if group["kind"] == "muon":
                group["momentum"] = muon_momentum(step)
                group["weight_decay"] = weight_decay_at(step, num_steps, args.weight_decay)
        logged = read_step(grad_norm, loss_sum, stats)  # all skip when any rank's are non-finite
        if not logged["non_finite"]:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        # --- the step's bookkeeping: a skipped update, tokens/s and the log line (metrics.py)
        if logged["non_finite"]:
            skipped_steps += 1
            print0(f"step {step}: non-finite gradients, update skipped ({skipped_steps} so far)")
        tokens_per_s = metrics.speed(step, args.total_batch_size, time.time() - t0)
        if step % args.log_every == 0 or step == num_steps:
            rho_every = args.rho_every or args.eval_every
            rho = raw_model.spectral_radius() if not host_rho or step % rho_every == 0 \
                or step == num_steps else None  # after the update, its own wait
            entry = {"step": step, "loss": logged["loss"] / grad_accum, "lr_mult": lrm,
                     "grad_norm": logged["grad_norm"],
                     **{f"{group['kind']}_lr": group["lr"] for group in optimizer.param_groups},
                     "tokens_per_s": tokens_per_s, "rho": None if rho is None else rho.item(),
                     "skipped_steps": skipped_steps, **{key: logged[key] for key in stats}}
            if peak_flops and tokens_per_s:
                entry["mfu"] = executed * tokens_per_s / (peak_flops * world)
            metrics.log_step(entry, num_steps, args.total_batch_size, device)

        # --- a new epoch of the training data, read again in a new order
        if loaders[0].next_doc[0] > data_epoch:
            data_epoch = loaders[0].next_doc[0]
            print0(f"step {step}: the loaders began reading epoch {data_epoch + 1} of the data")

        # --- once in a while: the val loss at T in {1, 2, 4, mu_rec}, in the training's numerics
        # (METHOD.md §2). CORE is eval_core.py's, after training, as in the authors' code.
        val_loss = None
        if step % args.eval_every == 0 or step == num_steps:
            result = {"step": step}
            with autocast:
                for T in eval_depths:
                    result[f"val_loss_T{T}"], result[f"val_bpb_T{T}"] = \
                        evaluate_bpb(raw_model, tokenizer, val_data, T)
            print0("eval | " + " | ".join(f"T={T}: loss {result[f'val_loss_T{T}']:.4f} bpb "
                                          f"{result[f'val_bpb_T{T}']:.4f}" for T in eval_depths))
            metrics.record(result)  # with the graph count after it, as the eval compiles its own
            val_loss = result[val_key]

        # --- every step: the divergence rule (docs/troubleshooting.md)
        verdict = divergence.check(step, not logged["non_finite"], logged["worst_h_norm"], val_loss)
        if verdict:
            metrics.record(divergence.announce(verdict, step, folder))
            if "diverged_at" in verdict:
                break

        # --- once in a while: a checkpoint, never inside a streak of bad steps (maybe diverging)
        save_due = save_due or step % args.save_every == 0 or step in (num_steps, args.stop_at)
        if save_due and divergence.bad_steps == 0:
            save_and_prune(folder, step, raw_model, loaders, skipped_steps=skipped_steps,
                           optimizer=optimizer.state_dict(), run=flags,
                           args={**vars(args), "device_batch_size": device_batch_size},
                           tokenizer_dir=str(tokenizer_dir(args.data, args.vocab_size)),
                           lowest_val_loss=divergence.lowest_val_loss)
            save_due = False

    diverged = verdict is not None and "diverged_at" in verdict
    print0(f"{'stopped' if diverged else 'done'}: {step} steps in {(time.time() - t_run) / 60:.1f} "
           f"min, {skipped_steps} skipped")
    for loader in loaders:
        loader.close()
    del lock  # held to the end
    return 3 if diverged else 0  # a status of its own, neither success nor bad input (2)


if __name__ == "__main__":
    run_command(main)
