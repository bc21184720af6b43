"""
nanoparcae/run.py: the bookkeeping of a training run, one call for each piece: its flags' value checks,
the device batch and its memory plan, the run's identity (its folder, and the flags its checkpoint
recorded against the command's), its lock, checkpoints kept newest-only, metrics.jsonl and the log line.
None of it is the method (METHOD.md); all of it decides whether a command trains, continues a run
exactly, or stops in one line before it writes anything.
"""

import argparse
import errno
import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from nanoparcae.checkpoint import disk_full, find_checkpoint, read_checkpoint, save_checkpoint
from nanoparcae.common import fail, get_base_dir, print0, rank_and_world, wait_for_rank0, write_atomically
from nanoparcae.dataset import FINEWEB_VAL_SHARD, fineweb_train_shards, tokenizer_dir, train_tokens
from nanoparcae.memory import largest_divisor, largest_fitting_batch, memory_plan
from nanoparcae.ranks import (agree_to_start, being_trained, checkpoint_digest, drift, lock_for_every_rank,
                              run_holder, stop)


# -----------------------------------------------------------------------------
# Flag values, checked as argparse parses them: a bad one is argparse's one-line error.


def checked(kind, rule, holds):
    """An argparse type: the text read as `kind`, refused unless holds(value), naming `rule`."""
    def parse(text):
        value = kind(text)
        if not holds(value):
            raise argparse.ArgumentTypeError(f"{text} must be {rule}")
        return value
    parse.__name__ = kind.__name__  # argparse's "invalid int value: 'x'" for text that is no number
    return parse


def positive(kind):
    return checked(kind, "a positive number", lambda value: 0 < value < math.inf)


def zero_or_more(kind):
    return checked(kind, "zero or more", lambda value: 0 <= value < math.inf)


unit_fraction = checked(float, "between 0 and 1", lambda value: 0 <= value <= 1)
steps_or_never = checked(int, "a number of steps, or -1 for never", lambda value: value > 0 or value == -1)

# -----------------------------------------------------------------------------
# The device batch and its memory plan (nanoparcae/memory.py), settled before anything is built


def choose_device_batch(model, args, device, world, optimizer_bytes):
    """--device_batch_size, or the largest size that divides each process's share of an optimiser step
    (gradient accumulation keeps the batch whole) and, on a GPU, whose memory plan fits in 90% of the memory
    free at start-up (of the least free GPU, across ranks); on a CPU the largest up to 32. It prints the plan
    (on a GPU, or for --dry_run) and the choice; a size that does not divide the step or does not fit is one
    line. -> namespace(size, given, sequences, world, plan, fitting, gpu, gpu_gb: the free GB planned for)."""
    given, seq_len, total = args.device_batch_size, args.seq_len, args.total_batch_size
    if given and total % (given * seq_len * world):
        fail(f"--total_batch_size={total} is not divisible by device_batch_size x seq_len x world = "
             f"{given} x {seq_len} x {world} = {given * seq_len * world}; change one of them")
    if total % (seq_len * world):
        fail(f"--total_batch_size={total} is not divisible by seq_len x world = {seq_len} x {world}; "
             f"change one of them")
    sequences = total // (seq_len * world)  # each process's share of an optimiser step
    bf16 = args.dtype == "bfloat16"
    gpu, gpu_gb = None, None
    if device.type == "cuda":  # what is free now: another process may hold some of the GPU
        free, total = (gb / 1e9 for gb in torch.cuda.mem_get_info(device))
        if dist.is_initialized():  # every rank must pick the same batch: the least free GPU decides
            least = torch.tensor([free, total], device=device)
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
            free, total = least.tolist()
        gpu_gb = free
        gpus, gpu = (gpu_gb,), (f"the {free:.1f} GB free of this GPU's {total:.1f} GB "
                                f"({torch.cuda.get_device_name(device)})")
        fitting = largest_fitting_batch(model, sequences, gpu_gb, bf16, optimizer_bytes)
        asked = memory_plan(model, given or 1, bf16, optimizer_bytes, gpus)  # or one sequence
        if asked["largest_batch"][gpu_gb] < (given or 1):
            fail(f"{f'--device_batch_size={given}' if given else 'one sequence per GPU'} plans "
                 f"{asked['total'] / 1e9:.1f} GB, over 90% of {gpu}; "
                 + (f"the largest device batch that fits is {fitting}" if fitting
                    else "free the GPU, or train a smaller --depth"))
        how = f"whose memory plan fits in 90% of {gpu}"
    else:  # no GPU memory to plan for: the plans for the two GPUs the paper's runs are sized for
        gpus = (80, 141)
        how = "up to 32 (no GPU; a GPU would get " + ", ".join(
            f"{largest_fitting_batch(model, sequences, gb, bf16, optimizer_bytes)} in {gb} GB"
            for gb in gpus) + ")"
        fitting = largest_divisor(sequences, 32)
    size = given or fitting
    plan = memory_plan(model, size, bf16, optimizer_bytes, gpus)
    if device.type == "cuda" or args.dry_run:
        print0(f"memory per GPU (GB): weights {plan['weights'] / 1e9:.1f} + grads {plan['grads'] / 1e9:.1f} "
               f"+ DDP buckets {plan['ddp_buckets'] / 1e9:.1f} + optimizer {plan['optimizer'] / 1e9:.1f} + "
               f"activations {plan['activations'] / 1e9:.1f} ({size} x {seq_len} at mu_bwd "
               f"{model.config.mu_bwd}, {args.dtype}) = {plan['total'] / 1e9:.1f} | largest device batch: "
               + ", ".join(f"{n} in {gb:.4g} GB" for gb, n in plan["largest_batch"].items())
               + " | an estimate until a GPU measures it (runs/gpu_check.sh)")
    print0(f"device batch: {size}, " + ("as given" if given else
           f"the largest divisor of the {sequences} sequences a process runs per step {how}"))
    return SimpleNamespace(size=size, given=given, sequences=sequences, world=world, plan=plan,
                           fitting=fitting, gpu=gpu, gpu_gb=gpu_gb)

# -----------------------------------------------------------------------------
# The data a run needs against the data on disk


def count(number):
    """104.0B, 12.3M or 47,370: a count of tokens as a person reads it."""
    return next((f"{number / size:.1f}{unit}" for unit, size in (("B", 1e9), ("M", 1e6)) if number >= size),
                f"{number:,.0f}")


def refuse_data(err, args, tokens, paper_horizon):
    """A data error in one line (status 2); without FineWeb-Edu's shards, naming the download this run needs
    and the small run that needs none."""
    if args.data == "fineweb-edu":
        sized = f"--depth={args.depth}" if paper_horizon else f"--tokens={tokens:.4g}"
        fail(f"{err} (`python -m nanoparcae.dataset download {sized}` fetches what this run reads); without a "
             f"GPU, `bash runs/cpu.sh` trains a small model on this Python's standard library, no download needed")
    fail(err)


def check_data(source, tokenizer, tokens):
    """The tokens the horizon needs against those the train split holds (nanoparcae/dataset.py train_tokens)
    -> the times the run reads them. A FineWeb-Edu run that would repeat its data while shards are still to
    download is refused in one line naming the download; another source repeats as it must, and says so."""
    held, bytes_per_token = train_tokens(source, tokenizer)
    shards = fineweb_train_shards() if source == "fineweb-edu" else None
    epochs = tokens / held
    if shards and epochs > 1 and len(shards) < FINEWEB_VAL_SHARD:
        per_shard = held / len(shards)
        needed = math.ceil(tokens / per_shard)
        still = (f"; all {FINEWEB_VAL_SHARD:,} training shards hold about {count(FINEWEB_VAL_SHARD * per_shard)} "
                 f"tokens, which the run would read {tokens / (FINEWEB_VAL_SHARD * per_shard):.2f} times"
                 if needed > FINEWEB_VAL_SHARD else "")
        fail(f"the run's {count(tokens)} tokens would read the {len(shards)} FineWeb-Edu training shards on disk "
             f"(about {count(held)} tokens) {epochs:.1f} times: run `python -m nanoparcae.dataset download "
             f"-n {min(needed, FINEWEB_VAL_SHARD) + 1}` first{still}, or give a smaller --max_tokens")
    # packing crops what does not fit a row, so a run reads a little more than it trains on
    print0(f"data: {source}, about {count(held)} training tokens ({bytes_per_token:.2f} bytes a token"
           + (f", {len(shards)} shards" if shards else "") + "): the run trains on "
           + (f"{epochs:.1%} of them" if epochs < 1 else f"them about {epochs:.2f} times"))
    return epochs

# -----------------------------------------------------------------------------
# The run's identity: its folder, defined by the run flags its checkpoints record, and its lock


def identify_run(args, run_flags, batch, device, **resolved):
    """The run this command trains, checked on every rank before anything is built or written -> namespace(
    dir, name, tokenizer_dir, flags, checkpoint (its newest, or None), ckpt (read onto `device`), step,
    device_batch_size). flags: the run_flags' values, with what `resolved` gives for those whose defaults
    resolve (d_model, ...) and the data's content key for --data. A run whose checkpoint recorded other
    values, a live run, a --resume with no checkpoint, an unreadable checkpoint or a recorded device batch
    that does not divide this step: every rank stops alike, in one line (status 2)."""
    try:
        tokenizer_path = tokenizer_dir(args.data, args.vocab_size)  # recorded in each checkpoint
        data_key = tokenizer_path.name.removesuffix(f"-{args.vocab_size}")  # content, not path
        run_dir = get_base_dir() / "runs" / (args.run or f"d{args.depth}_{args.injection}")
    except (FileNotFoundError, ValueError) as err:
        fail(err)
    name, size, checkpoint, ckpt, refusal, start = run_dir.name, batch.size, None, None, None, (0, None)
    try:  # each rank keeps its refusal for the agreement below rather than stopping alone
        if holder := run_holder(run_dir):  # before a live run's checkpoint is read onto its GPUs
            raise ValueError(being_trained(run_dir, holder))
        checkpoint = find_checkpoint(run_dir.parent, name) if any(run_dir.glob("ckpt_*.pt")) else None
        if args.resume and checkpoint is None:
            raise ValueError(f"there is no checkpoint of run {name} under {run_dir} to resume; start it "
                             f"without --resume")
        recorded = {}
        if checkpoint:
            ckpt = read_checkpoint(checkpoint, device)  # unreadable: one line naming the file
            recorded = ckpt.get("run", {})
            if not batch.given and recorded.get("device_batch_size", batch.fitting) != batch.fitting:
                size = recorded["device_batch_size"]  # it fixes the run's data order
                tight = device.type == "cuda" and size > batch.plan["largest_batch"][batch.gpu_gb]
                print0(f"device batch: {size}, as run {name} recorded (it fixes the run's data order)"
                       + (f"; its plan no longer fits {batch.gpu}, where {batch.fitting} does" if tight
                          else ""))
        flags = {flag: getattr(args, flag) for flag in run_flags}
        flags.update(resolved, data=data_key, device_batch_size=size)
        if ckpt:
            differ = [f"{flag} {recorded.get(flag, 'unrecorded')} there, {value} here"
                      for flag, value in flags.items() if recorded.get(flag) != value]
            if differ:
                notes = {"data": "data: --data's content key, from its files' names, sizes and modification "
                                 "times, or stdlib's Python version",
                         "train_shards": "train_shards: the FineWeb-Edu training shards on disk, whose shuffle "
                                         "is the run's data order, so only the same shards continue it"}
                notes = "".join(f" ({note})" for flag, note in notes.items() if recorded.get(flag) != flags.get(flag))
                raise ValueError(f"run {name} ({checkpoint}) was started with other flags: {'; '.join(differ)}"
                                 f"{notes}; pass its flags to continue it, or --run=NAME to start another")
            start = ckpt["step"], checkpoint_digest(ckpt["model"])
        if batch.sequences % size:  # a recorded batch on another number of processes
            raise ValueError(f"run {name}'s device batch {size} does not divide the {batch.sequences} "
                             f"sequences each of {batch.world} process(es) runs per step; continue it on a "
                             f"number of processes it divides")
    except ValueError as err:
        refusal = str(err)
    try:  # every rank starts from the same checkpoint (none: step 0), or none starts
        agree_to_start(name, refusal, *start)
    except ValueError as err:
        stop(err, 2)
    return SimpleNamespace(dir=run_dir, name=name, tokenizer_dir=tokenizer_path, flags=flags,
                           checkpoint=checkpoint, ckpt=ckpt, step=start[0], device_batch_size=size)


def claim_run(run_dir):
    """The run's lock (nanoparcae/ranks.py), taken by rank 0 after every check that can refuse the
    command, as the first thing it writes in the run folder -> the open lock file, to keep until the
    process ends. A live run holding it: every rank stops alike, in one line (status 2)."""
    try:
        return lock_for_every_rank(run_dir)
    except ValueError as err:
        stop(err, 2)

# -----------------------------------------------------------------------------
# What a run writes: its newest checkpoint, metrics.jsonl and the log line


def save_and_prune(run_dir, step, model, loaders, **state):
    """ckpt_<step>.pt, written by rank 0 with every virtual rank's loader position and `state`; the run's
    older checkpoints are then removed (a 1.3B checkpoint with optimiser state is ~16 GB). The RNG state
    is a function of (seed, step, virtual rank), so nothing else is needed. Saves nothing, and stops the
    run (status 1), when the ranks' weights have drifted apart (ranks.drift)."""
    if drifted := drift(model.state_dict()):
        stop(f"at step {step} the ranks' weights have drifted apart: {drifted}; nothing saved: the run's "
             f"last checkpoint stays, and the same command resumes every rank from it", 1)
    loader_states = [loader.state_dict() for loader in loaders]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, loader_states)
        loader_states = [each for states in gathered for each in states]
    if rank_and_world()[0] == 0:
        path = run_dir / f"ckpt_{step:06d}.pt"
        older = sorted(run_dir.glob("ckpt_*.pt"))
        save_checkpoint(path, model, step=step, loader=loader_states, **state)
        for stale in older:
            if stale != path:
                stale.unlink()
        print0(f"saved {path}")
    wait_for_rank0()  # the others wait here, not in their next step's all-reduce, however slow the disk


class Metrics:
    """metrics.jsonl in the run folder, one JSON record a line (steps, evals, warnings, the divergence
    verdict), written by rank 0. Opened for a run resumed from `step` (0: none), it keeps the records up
    to that step: those a killed run logged past its checkpoint come again as the run redoes them, so each
    step stays once, in order. Rewritten under a temporary name; a torn last line goes too."""

    def __init__(self, run_dir, step):
        self.file = None
        if rank_and_world()[0] != 0:
            return
        path, kept = run_dir / "metrics.jsonl", []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line + "\n")
            except ValueError:
                pass
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            write_atomically(path, lambda partial: partial.write_text("".join(kept)))
            self.file = open(path, "a")
        except OSError as err:
            self.full_disk(err, run_dir)

    def record(self, entry):
        if self.file:
            try:
                self.file.write(json.dumps(entry) + "\n")
                self.file.flush()
            except OSError as err:
                self.full_disk(err, Path(self.file.name).parent)

    @staticmethod
    def full_disk(err, run_dir):
        """A full disk stops the run in one line; any other error goes on up."""
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise err
        disk_full(run_dir, "metrics.jsonl cannot be written")


def compile_counts(counters):
    """dynamo's counters -> {graphs: the graphs it built, recompile_limits: the times it hit a recompile
    limit and left a frame to run eagerly}. A graph count that stops growing is no proof of no recompiles:
    past the limit dynamo stops compiling, so both are recorded."""
    hits = sum(n for why, n in counters["unimplemented"].items() if "Limit type:" in why and "recompile" in why)
    return {"graphs": counters["stats"]["unique_graphs"], "recompile_limits": hits}


def log_line(entry, num_steps, total_batch_size):
    """A step's log line, from its metrics record (fields that are None are left out)."""
    fields = [("loss", "loss {:.4f}"), ("lr_mult", "lrm {:.2f}"), ("tokens_per_s", "{:,.0f} tok/s"),
              ("mfu", "mfu {:.1%}"), ("rho", "rho {:.4f}"), ("h_norm", "|h_T| {:.2f}"),
              ("update_ratio", "dh/h {:.4f}")]
    parts = [f"step {entry['step']}/{num_steps}"]
    parts += [form.format(entry[key]) for key, form in fields if entry.get(key) is not None]
    tokens_per_s = entry["tokens_per_s"]
    eta = (num_steps - entry["step"]) * total_batch_size / tokens_per_s if tokens_per_s else float("nan")
    return " | ".join(parts + [f"eta {eta / 60:.1f} min"])
