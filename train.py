"""
train.py: train Parcae (or a baseline) with the paper's recipe (METHOD.md §2), on a CPU or 8 GPUs.

    torchrun --nproc_per_node=8 train.py             # the defaults: the paper's 140M on FineWeb-Edu
    torchrun --nproc_per_node=8 train.py --depth=24  # the paper's 1.3B
    python train.py --depth=24 --dry_run             # sizes, tokens, FLOPs, memory per GPU only
    bash runs/cpu.sh                                 # a small looped model on a CPU: its flags

Every optimiser step sees the same rows, depths and h0 whatever the number of processes.
Its micro-batches are "virtual ranks" v = rank * grad_accum + micro, each with its data and seed.
So two processes reproduce one, a resumed run continues exactly, and so do the workers that
torchrun --max_restarts restarts, from the last checkpoint.

A run (--run, default d<depth>_<injection>) is its RUN_FLAGS' values; its checkpoint records them.

- The same command continues it from its last checkpoint; a finished run exits at once.
- A command whose run flags differ is refused, naming those flags.
- A diverged run stops with exit status 3 (docs/troubleshooting.md).
"""

import math
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from eval_core import core_during_training, evaluate_during_training
from model import INJECTIONS, SAMPLINGS
from optim import build_optimizer, lr_multiplier, muon_momentum, weight_decay_at
from nanoparcae.checkpoint import save_and_prune
from nanoparcae.command import command_parser, run_command
from nanoparcae.ranks import no_buffer_sync, peak_bf16_flops, print0
from nanoparcae.divergence import Divergence
from nanoparcae.download import shared_eval_bundle
from nanoparcae.metrics import Metrics, compile_counts, read_at_once
from nanoparcae.prepare import prepare_run
from nanoparcae.tokenizer import vocab_size_flag

# A run is these flags' values: its checkpoints record them, and continuing it with another value
# of one is refused. Every other flag may change when a run continues.
RUN_FLAGS = ("depth", "d_model", "head_dim", "mu_rec", "mu_bwd", "injection", "depth_sampling",
             "prelude_norm", "vocab_size", "seq_len", "data", "max_tokens", "param_data_ratio",
             "target_flops", "device_batch_size", "total_batch_size", "optimizer", "adamw_lr",
             "muon_lr", "weight_decay", "grad_clip", "warmdown_frac", "seed")


def parse_args(argv=None):
    """The flags: the paper's 140M recipe by default (METHOD.md §2); runs/cpu.sh a small one's."""
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
    # the data and the horizon: the first given of --max_tokens, --target_flops, --param_data_ratio
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
    flag("--core_every", type=int, default=2000,
         help="steps between CORE evals, and at the end (-1: never)")
    flag("--core_max_per_task", type=int, default=500, help="CORE examples per task in training")
    flag("--save_every", type=int, default=1000, help="steps between checkpoints")
    flag("--log_every", type=int, default=1, help="steps between log lines")
    flag("--run", default=None, help="run name (None: d<depth>_<injection>)")
    flag("--resume", action="store_true", help="require a checkpoint to continue from")
    flag("--stop_at", type=int, default=None, help="end this command after that step")
    flag("--dry_run", action="store_true", help="print the configuration and memory plan, and exit")
    flag("--check", action="store_true", help="check the flags' values, and exit: nothing starts")
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
         help="seconds ranks wait for lone work: rank 0's save, tokenizer, CORE fetch, resume read")
    args = parser.parse_args(argv)
    check_values(args)
    return args


INT_LIMIT = 2**31 - 1  # an int flag past int32's range overflows a size or counter in torch
SEED_LIMIT = 2**28 - 1  # each step's seed, (seed * 1_000_003 + step) * 65_537 + v, must fit 64 bits


def check_values(args):
    """Every number flag's range, checked once after parsing: ValueError naming the flag and value.
    None leaves a flag to its default rule. --vocab_size's type is the tokenizer's check."""
    rules = {
        "a positive number": (lambda v: 0 < v < math.inf, (
            "max_tokens", "target_flops", "param_data_ratio", "adamw_lr", "muon_lr", "grad_clip",
            "diverge_h_norm", "collective_timeout", "rank0_timeout")),
        f"between 1 and {INT_LIMIT}": (lambda v: 1 <= v <= INT_LIMIT, (
            "depth", "d_model", "head_dim", "mu_rec", "mu_bwd", "seq_len", "device_batch_size",
            "total_batch_size", "eval_every", "eval_tokens", "core_max_per_task", "save_every",
            "log_every", "stop_at", "rho_every")),
        "zero or more": (lambda v: 0 <= v < math.inf, ("weight_decay",)),
        f"between 0 and {INT_LIMIT}": (lambda v: 0 <= v <= INT_LIMIT, ("diverge_steps",)),
        f"between 0 and {SEED_LIMIT}": (lambda v: 0 <= v <= SEED_LIMIT, ("seed",)),
        "between 0 and 1": (lambda v: 0 <= v <= 1, ("warmdown_frac",)),
        f"a number of steps up to {INT_LIMIT}, or -1 for never": (
            lambda v: 0 < v <= INT_LIMIT or v == -1, ("core_every",)),
    }
    for rule, (holds, names) in rules.items():
        for name in names:
            if (value := getattr(args, name)) is not None and not holds(value):
                raise ValueError(f"--{name}={value} must be {rule}")


def main(argv=None):
    args = parse_args(argv)
    if args.check:  # the flags parse and hold their ranges; nothing is made or started
        return 0
    # sizes, processes, the run's identity, data, lock and resume point (nanoparcae/prepare.py)
    setup = prepare_run(args, RUN_FLAGS)
    if setup is None:  # a --dry_run, or a finished run
        return 0
    device, ddp, rank, world = setup.device, setup.ddp, setup.rank, setup.world
    run, loaders, tokenizer, num_steps = setup.run, setup.loaders, setup.tokenizer, setup.num_steps
    grad_accum = setup.grad_accum  # micro-batches per step: the step's rows / (world x batch)

    # The model and the optimizer: MuonAdamW (METHOD.md §2), or AdamW on all
    model = raw_model = setup.model
    if args.compile:
        model.compile_regions(backend=args.compile_backend)
        from torch._dynamo.utils import counters as dynamo_counters
    if ddp:  # the RoPE tables are constant: no buffers to sync at each forward
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    **no_buffer_sync())
    optimizer = build_optimizer(raw_model, adamw_lr=setup.adamw_lr, muon_lr=args.muon_lr,
                                weight_decay=args.weight_decay, muon=args.optimizer == "muon")
    if args.compile:
        optimizer.compile(backend=args.compile_backend)  # each group's update fused (optim.py)
    if setup.optimizer_state:  # a resume: the checkpoint's optimizer state, then freed
        optimizer.load_state_dict(setup.optimizer_state)
        del setup.optimizer_state
    bf16 = args.dtype == "bfloat16"  # autocast: the matmuls in bfloat16, the weights in float32
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    start_step, skipped_steps = setup.step, setup.skipped_steps
    batches = [iter(loader) for loader in loaders]
    data_epoch = loaders[0].next_doc[0]  # the epoch of the training data the loaders read

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
                            setup.lowest_val_loss)
    val_key = f"val_loss_T{setup.config.mu_rec if raw_model.injection else 1}"  # the rule's eval
    host_rho = getattr(raw_model.injection, "rho_on_host", False)  # concat's: per --rho_every
    metrics = Metrics(run.dir, start_step)
    tokens_per_second, t_run, step, save_due, verdict = None, time.time(), start_step, False, None
    while step < num_steps and (args.stop_at is None or step < args.stop_at):

        # --- one step: grad_accum micro-batches forward and backward, clip, schedules, update
        t0, graphs = time.time(), compile_counts(dynamo_counters)["graphs"] if args.compile else 0
        loss_sum, stats = torch.zeros((), device=device), {}
        for micro in range(grad_accum):
            # one seed per (seed, step, virtual rank): any number of processes draws alike
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
        # [any rank's gradients non-finite, the largest ||h_T||], reduced at once: all skip alike
        h_norm = stats["h_norm"]
        worst = torch.stack([(~torch.isfinite(grad_norm)).float(),
                             torch.zeros((), device=device) if h_norm is None else h_norm.float()])
        if ddp:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        # the skip rule's read brings the log line's values too: one wait for the device, not two
        non_finite, worst_h_norm = worst.unbind()
        logged = read_at_once({"non_finite": non_finite, "worst_h_norm": worst_h_norm,
                               "loss": loss_sum, "grad_norm": grad_norm, **stats})
        non_finite, worst_h_norm = logged["non_finite"], logged["worst_h_norm"]
        if non_finite:
            skipped_steps += 1
            print0(f"step {step + 1}: non-finite gradients, update skipped "
                   f"({skipped_steps} so far)")
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
                executed = setup.executed_flops_per_token * tokens_per_second
                entry["mfu"] = executed / (peak_flops * world)
            metrics.log_step(entry, num_steps, args.total_batch_size, args.compile, device)

        # --- a new epoch of the training data, read again in a new order
        if loaders[0].next_doc[0] > data_epoch:
            data_epoch = loaders[0].next_doc[0]
            print0(f"step {step}: the loaders began reading epoch {data_epoch + 1} of the data")

        # --- once in a while: evals, in the training's numerics
        results = []
        with autocast:
            if step % args.eval_every == 0 or step == num_steps:
                results.append(evaluate_during_training(step, raw_model, tokenizer, setup.val_data))
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

        # --- once in a while: a checkpoint, never inside a streak of bad steps (maybe diverging)
        save_due = (save_due or step % args.save_every == 0 or step == num_steps
                    or step == args.stop_at)
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
    return 3 if diverged else 0  # a status of its own: neither success nor bad input (2)


if __name__ == "__main__":
    run_command(main)
