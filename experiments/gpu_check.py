"""
gpu_check.py: runs/gpu_check.sh's Python, the table and the helpers the script calls.
The table is built from what the stages left.
The helpers give the GPU count and free memory, a made-up CORE bundle, the depth-24 plan's batch and the faults.

    python -m experiments.gpu_check table WORK RUNS_DIR --gpus N --memory BYTES [--tiny]
    python -m experiments.gpu_check gpus | free_memory            # what torch sees, printed
    python -m experiments.gpu_check bundle DIR                    # a CORE bundle of 3 made-up tasks
    python -m experiments.gpu_check planned_batch LOG BYTES       # the batch a --dry_run log plans for BYTES
    python -m experiments.gpu_check perturb CKPT                  # a weight scaled by 1.01: a wrong resume
    python -m experiments.gpu_check run [--fault=F] [--fake_gpu=BYTES] SCRIPT ARGS...   # SCRIPT, with a fault

WORK holds each stage's output (NAME.log) and its "exit status, time limit" (NAME.rc).
It also holds bench.py's --json, bench.json, and sampling.json, row 3 at the depth-24 plan's device batch.
RUNS_DIR holds the train.py runs gpu_check_NAME.
It is Python rather than shell because the rows read JSON and apply targets.
Every row is built on its own; one that cannot be built says "failed: " and why in one line.
A row is held to its target where this machine can meet it.
The GPU's figures are held only on a GPU, and not with --tiny.
The exit status is 1 when a row failed or a held one says "not met".
"""

import argparse
import csv
import json
import math
import os
import re
import runpy
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from nanoparcae.command import command_parser, first_sentence, run_command, positive
from nanoparcae.files import read_json
from nanoparcae.core_tasks import CORE_TASKS
from nanoparcae.dataset import list_chunks
from nanoparcae.metrics import read_metrics
from experiments.bench import device_name, si

WARMUP_STEPS = 10  # train.py's compiled blocks may still compile graphs (the batch dimension going dynamic) until here
# FLOP/s against the Transformer, per-sequence sampling's overhead (paper: +1.8%), MFU, memory against the plan, bf16,
# a resumed run against an unbroken one on a GPU (its kernels' atomics need not add in the same order twice), and
# all GPUs against one in bf16 (an estimate: DDP sums the gradients in another order, and bf16 rounds the difference
# up; a rank reading other data moves 2 ranks' losses ~1%, 8 ranks' ~1/8 of that)
TARGETS = {"flops_ratio": 1.0, "sampling_overhead": 0.02, "mfu": 0.40, "memory": 0.15, "bf16": 0.01, "resume": 1e-3,
           "world": 2e-3}
WORLD_CPU = 1e-3  # the same in float32 on a CPU: the tiny run's 3 steps end ~1e-4 apart
LIMIT_WARNING = re.compile(r"torch\._dynamo hit config\.(\w+) \((\d+)\)")  # a recompile limit, as dynamo logs it
CUDA = torch.cuda.is_available()
DEFAULT_STEP_SEQUENCES = 524_288 // 2048  # train.py's --total_batch_size in sequences of --seq_len


class Failed(Exception):
    """A row that could not be measured; its message is the one line the table shows."""


def verdict(ok):
    return "met" if ok else "not met"


def on_gpu(args):
    """Whether the GPU's own figures are judged: a CPU, or --tiny's model, cannot meet or miss them."""
    return CUDA and not args.tiny


def judged(target, ok, args):
    """A GPU figure's target cell: its verdict on a GPU, else said and not judged."""
    return f"{target}: {verdict(ok) if on_gpu(args) else 'not judged (no GPU)'}"


# -----------------------------------------------------------------------------
# What the stages left

def stage(work, name):
    """Raise Failed with the stage's one-line reason unless it exited 0."""
    rc_file = work / f"{name}.rc"
    if not rc_file.exists():
        raise Failed(f"stage {name} did not run")
    status, limit = map(int, rc_file.read_text().split())
    if status in (124, 137):  # timeout's status, or its SIGKILL after the grace period
        raise Failed(f"{name} timed out after {limit} s")
    if status != 0:
        raise Failed(f"{name} exited {status}: {last_error(work / f'{name}.log')}")


def last_error(log, limit=200):
    """The line that says what went wrong: the last one naming an error (torchrun's teardown follows it), else the
    last line; cut at a word under `limit` characters."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"([\w.]+(Error|Exception|Exit)\b|error:)", line)]
    line = (errors or lines or ["no output"])[-1]
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + " ..."


def run_records(runs_dir, name):
    """Every record of run gpu_check_NAME (metrics.jsonl): steps and evals."""
    return read_metrics(runs_dir / f"gpu_check_{name}" / "metrics.jsonl")


def step_records(runs_dir, name):
    """The training records of run gpu_check_NAME, or Failed."""
    records = [r for r in run_records(runs_dir, name) if "loss" in r]
    if not records:
        raise Failed(f"run gpu_check_{name} logged no step")
    return records


def bench_json(work, name="bench"):
    """What bench.py --json wrote in stage `name`; {} when it wrote nothing."""
    return read_json(work / f"{name}.json") or {}


def bench_row(work, number, name="bench"):
    """bench.py's row `number` as (what, result, ratio, target), from stage `name`'s json.
    A row it did not write raises Failed with the stage's reason."""
    found = [row for row in bench_json(work, name).get("rows", []) if row[0] == number]
    if not found:
        stage(work, name)
        raise Failed(f"bench.py wrote no row {number} in stage {name}")
    return found[0][1:]


def bench_figure(work, key):
    figures = bench_json(work).get("figures", {})
    if key not in figures:
        stage(work, "bench")
        raise Failed(f"bench.py recorded no {key}")
    return figures[key]


# -----------------------------------------------------------------------------
# The rows: each returns (check, result, target); the stage names are runs/gpu_check.sh's

def versions(work, runs_dir, args):
    if CUDA:
        where = f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    else:
        where = f"no GPU ({device_name(torch.device('cpu'))})"
    try:
        rate = si(bench_figure(work, "step")["matmul_rate"], "FLOP/s")
    except Failed as err:
        rate = f"failed: {err}"
    sizes = bench_json(work).get("sizes", "?")
    return (f"versions; the {'bf16' if CUDA else 'float32'} matmul rate at the MLP's shape (bench.py row 9, {sizes})",
            f"torch {torch.__version__}, {where}; matmul {rate}", "")


def throughput(work, runs_dir, args):
    """bench.py's row 9, the step train.py runs, compiled: Parcae per-sequence against the Transformer."""
    _, parcae, _, _ = bench_row(work, "9a")
    _, gpt, _, _ = bench_row(work, "9c")
    step = bench_figure(work, "step")
    flops_ratio = step["Parcae per-sequence"]["flops"] / step["Transformer"]["flops"]
    return ("bench.py row 9: the step train.py runs, compiled, Parcae (per-sequence) vs the Transformer of the same "
            "depth; matmul FLOPs executed", f"Parcae {parcae}; Transformer {gpt}; FLOP/s {flops_ratio:.2f}x",
            judged(f"FLOP/s >= {TARGETS['flops_ratio']:.1f}x", flops_ratio >= TARGETS['flops_ratio'], args))


def mfu(work, runs_dir, args):
    what, result, _, _ = bench_row(work, "9")
    value = bench_figure(work, "step")["Parcae per-sequence"]["mfu_measured"]
    return (f"bench.py row 9: {what}", f"{result}; Parcae {value:.1%} of the measured rate",
            judged(f"Parcae >= {TARGETS['mfu']:.0%}", value >= TARGETS['mfu'], args))


def sampling(work, runs_dir, args):
    """Show row 3b at the paper's 32 sequences, held to the paper's overhead.
    Beside it goes row 3 of stage sampling, at the device batch the depth-24 plan picks.
    There the 1.3B's calls of one or two rows show."""
    what, result, ratio, _ = bench_row(work, "3b")
    overhead = bench_figure(work, "sampling_overhead")
    stage(work, "plan")
    batch = planned_batch((work / "plan.log").read_text(), args.memory)
    if batch is None:
        raise Failed("train.py --dry_run printed no device batch")
    at_plan = "as at 32"
    if batch != 32:
        _, planned, planned_ratio, _ = bench_row(work, "3a", "sampling")
        at_plan = f"{planned}; {planned_ratio}"
    return (f"bench.py row 3b: {what}; and row 3 at the depth-24 plan's device batch",
            f"{result}; {ratio}. At the plan's {batch}: {at_plan}",
            judged(f"<= {TARGETS['sampling_overhead']:.0%} at 32", overhead <= TARGETS['sampling_overhead'], args))


def quoted(number, gpu_figure):
    """bench.py's row `number` as it stands, its own target included; a GPU figure's verdict only on a GPU."""
    def build(work, runs_dir, args):
        what, result, ratio, target = bench_row(work, number)
        if gpu_figure and not on_gpu(args):
            target = target.rsplit(": ", 1)[0] + ": not judged (no GPU)"
        return f"bench.py row {number}: {what}", f"{result}; {ratio}", target
    return build


def plan_figures(text):
    """train.py --dry_run's output -> (the device batch it planned, its total GB, {GPU GB: largest batch that fits});
    a figure it does not print is None (or {}). Lenient: the plan's line may change wording around its numbers."""
    lines = [line for line in text.splitlines() if "memory" in line.lower() and "GB" in line]
    totals = [re.findall(r"=\s*([\d.]+)", line) for line in lines]
    total = float(next((t[-1] for t in reversed(totals) if t), "nan"))
    planned = re.search(r"\((\d+) x \d+ at mu_bwd", text) or re.search(r"device[_ ]batch(?:_size)?\D{0,3}(\d+)", text)
    largest = {int(gb): int(n) for n, gb in re.findall(r"(\d+) in (\d+) GB", text)}
    return (int(planned[1]) if planned else None), (None if math.isnan(total) else total), largest


def planned_batch(text, memory_bytes):
    """Pick the device batch the check runs the depth-24 step at.
    It is the dry run's own when its plan fits this GPU's memory, since train.py plans the batch it picks.
    Otherwise it is the largest size dividing the default step's sequences, as train.py's rule says.
    That size must fit, by the plan, the biggest GPU size it lists within this one."""
    planned, total, largest = plan_figures(text)
    if planned is not None and total is not None and total * 1e9 <= memory_bytes:
        return planned
    sizes = [gb for gb in largest if gb * 1e9 <= memory_bytes * 1.0001]
    fits = largest[max(sizes)] if sizes else None
    return max((n for n in range(1, (fits or 0) + 1) if DEFAULT_STEP_SEQUENCES % n == 0), default=None)


def plan(work, runs_dir, args):
    stage(work, "plan")
    stage(work, "plan_at")
    batch = planned_batch((work / "plan.log").read_text(), args.memory)
    _, total, _ = plan_figures((work / "plan_at.log").read_text())
    if batch is None or total is None:
        raise Failed("train.py --dry_run printed no device batch or memory plan")
    where = "a GPU faked to report" if args.tiny else "this GPU's"
    what = ("train.py --depth=24 --mu_rec=8 --dry_run: the device batch it picks and its memory plan, against the "
            "peak torch.cuda.max_memory_allocated of one compiled step at that batch (3b)")
    result = f"device batch {batch}: plan {total:.1f} GB per GPU, {where} {args.memory / 1e9:.0f} GB free"
    target = f"peak within {TARGETS['memory']:.0%} of the plan"
    if not on_gpu(args):
        return what, f"{result}; peak: no GPU", judged(target, False, args)
    stage(work, "step24")
    peak = step_records(runs_dir, "step24")[0]["peak_memory"] / 1e9
    return (what, f"{result}; peak {peak:.1f} GB ({peak / total - 1:+.0%})",
            judged(target, abs(peak / total - 1) <= TARGETS["memory"], args))


def step24(work, runs_dir, args):
    stage(work, "step24")
    first = step_records(runs_dir, "step24")[0]
    if not on_gpu(args):
        return ("one compiled step under torchrun, its workers killed after it (the tiny model stands in for the "
                "depth-24)", f"step 1: loss {first['loss']:.3f}; peak memory: no GPU", "")
    batch = planned_batch((work / "plan.log").read_text(), args.memory)
    return (f"one compiled step of the depth-24 at device batch {batch} under torchrun (DDP's buckets), its "
            "workers killed after it", f"step 1: loss {first['loss']:.3f}; peak {first['peak_memory'] / 1e9:.1f} GB",
            "")


def torchrun_title(args):
    backend = "NCCL" if CUDA else "gloo"
    return f"torchrun --nproc_per_node={args.gpus} train.py ({backend}, {'tiny' if args.tiny else 'depth 6'})"


def resumed_at(work):
    """The step the resuming command continued from, from its log line."""
    found = re.search(r"resumed gpu_check_ddp at step (\d+)", (work / "ddp_resume.log").read_text())
    if found is None:
        raise Failed("the second torchrun command did not resume")
    return int(found[1])


def train_run(work, runs_dir, args):
    stage(work, "ddp")
    stage(work, "ddp_resume")
    records = step_records(runs_dir, "ddp")
    accum = re.search(r"x (\d+) micro-batch", (work / "ddp.log").read_text())
    first = statistics.mean(r["loss"] for r in records[:5])
    last = statistics.mean(r["loss"] for r in records[-5:])
    n = records[-1]["step"]
    return (f"{torchrun_title(args)}, bf16 and compiled, {accum[1] if accum else '?'} micro-batches per step, "
            f"{n} steps on the stdlib corpus: the loss falls",
            f"loss {first:.3f} -> {last:.3f} (means of steps 1-5 and {n - 4}-{n})",
            f"falls: {verdict(last < first and accum is not None and int(accum[1]) >= 2)}")


def limit_warnings(work, names):
    """dynamo's "hit config.<limit> (<value>)" warnings in these stages' logs -> ["<limit> (<value>)", ...]."""
    logs = [work / f"{name}.log" for name in names]
    return [f"{limit} ({value})" for log in logs if log.exists()
            for limit, value in LIMIT_WARNING.findall(log.read_text())]


def recompilation(work, runs_dir, args):
    stage(work, "ddp")
    stage(work, "ddp_resume")
    start = resumed_at(work)
    records = run_records(runs_dir, "ddp")
    steps = [r for r in records if "loss" in r and r["step"] > start]
    if not steps or "graphs" not in steps[-1]:
        raise Failed("train.py logged no graph count (not compiled?)")
    graphs = {r["step"]: r["graphs"] for r in steps}
    warm, n = start + WARMUP_STEPS, steps[-1]["step"]
    if warm >= n:
        raise Failed(f"the run resumed at step {start}: no step after its warm-up to compare")
    evals = [f"{r['graphs']} after the eval" for r in records
             if "loss" not in r and "graphs" in r and r["step"] > start]
    # past a recompile limit dynamo runs the frame eagerly and the graph count stops growing: both processes'
    # counters and their logs say so
    hits = max(r.get("recompile_limits", 0) for r in records)
    warnings = limit_warnings(work, ["ddp", "ddp_resume"])
    said = f"dynamo hit config.{', config.'.join(dict.fromkeys(warnings))}" if warnings else "no warning"
    settled = graphs[n] == graphs[warm] and not hits and not warnings
    return (f"{torchrun_title(args)} after the resume, through training and the eval: the graphs torch.compile "
            "built (dynamo's unique_graphs) and the times it hit a recompile limit (its counters and its warning)",
            f"graphs {graphs[start + 1]} after step {start + 1}, {graphs[warm]} after step {warm}, {graphs[n]} after "
            f"step {n}{''.join(', ' + each for each in evals)}; recompile limit hit {hits} time(s), {said}",
            f"no graph after step {warm}, no limit hit: {verdict(settled)}")


def tokens_per_second(work, runs_dir, args):
    stage(work, "ddp_resume")
    last = step_records(runs_dir, "ddp")[-1]
    if last["tokens_per_s"] is None:
        raise Failed("too few steps for a rate")
    mfu_text = f", MFU {last['mfu']:.1%} of the listed bf16 peak (matmul FLOPs executed)" if last.get("mfu") else ""
    return (f"{torchrun_title(args)}: tokens/s over all processes (moving average at the last step)",
            f"{last['tokens_per_s']:,.0f} tok/s{mfu_text}", "")


def relative_gap(ours, theirs):
    """The largest relative difference between two lists of numbers or tensors (|a - b| / |b|, norms for tensors)."""
    gaps = [float(torch.linalg.vector_norm((a - b).double()) / max(torch.linalg.vector_norm(b.double()), 1e-30))
            if torch.is_tensor(a) else abs(a - b) / max(abs(b), 1e-30) for a, b in zip(ours, theirs)]
    return max(gaps, default=0.0)


def resume_gaps(runs_dir, n):
    """Compare the resumed run with the unbroken one -> two largest relative differences.
    The first is of their losses, step by step; the second of their weights at step n, tensor by tensor.
    It raises Failed where the two cannot be put side by side."""
    ours, theirs = ({r["step"]: r["loss"] for r in step_records(runs_dir, name)} for name in ("ddp", "unbroken"))
    if sorted(ours) != sorted(theirs):
        raise Failed(f"the resumed run logged steps {min(ours)}-{max(ours)}, the unbroken one {min(theirs)}-"
                     f"{max(theirs)}")
    paths = [runs_dir / f"gpu_check_{name}" / f"ckpt_{n:06d}.pt" for name in ("ddp", "unbroken")]
    if not all(path.exists() for path in paths):
        raise Failed(f"no {paths[0].name} to compare in gpu_check_ddp and gpu_check_unbroken")
    weights = [torch.load(path, map_location="cpu", weights_only=True)["model"] for path in paths]
    if weights[0].keys() != weights[1].keys():
        raise Failed("the resumed and the unbroken checkpoints hold different weights")
    names = sorted(weights[1])
    return (relative_gap([ours[s] for s in sorted(theirs)], [theirs[s] for s in sorted(theirs)]),
            relative_gap([weights[0][k] for k in names], [weights[1][k] for k in names]))


def kill_and_resume(work, runs_dir, args):
    stage(work, "ddp")
    stage(work, "ddp_resume")
    stage(work, "unbroken")
    killed = re.search(r"killed the workers at step (\d+)", (work / "ddp.log").read_text())
    start = resumed_at(work)
    steps = [r["step"] for r in step_records(runs_dir, "ddp")]
    n = steps[-1]
    once = steps == list(range(1, n + 1))
    losses, weights = resume_gaps(runs_dir, n)
    # on a CPU the same command repeats every operation in the same order: nothing short of equal is a resume
    tolerance = TARGETS["resume"] if CUDA else 0.0
    same = ", ".join(f"{what} {'equal' if gap == 0 else f'{gap:.1e} apart (relative)'}"
                     for what, gap in (("losses", losses), (f"weights at step {n}", weights)))
    return (f"{torchrun_title(args)}: its workers killed mid-run (SIGKILL), then the same command, against the same "
            "run trained unbroken",
            f"killed at step {killed[1] if killed else '?'}; resumed at step {start}, ended at step {n}; steps 1-{n} "
            f"logged {'once each' if once else 'out of order or twice'}; against the unbroken run: {same}",
            f"resumes, each step once, {'equal' if tolerance == 0 else f'within {tolerance:g}'}: "
            f"{verdict(killed is not None and once and max(losses, weights) <= tolerance)}")


def world_sizes(work, runs_dir, args):
    """The same short run on every process and on one with as many micro-batches: a rank that reads another
    order, which DDP never sees, moves the losses apart."""
    what = (f"{torchrun_title(args)} eager, against one process with {args.gpus} micro-batches of the same size: "
            "the losses of the same global batch")
    if args.gpus < 2:
        return what, "one GPU: no other world size to compare", ""
    chunks = len(list_chunks("stdlib", "train"))
    if chunks < 2:
        raise Failed("the stdlib corpus is one chunk here: no rank could read another order")
    stage(work, "world")
    stage(work, "world_one")
    every, one = ({r["step"]: r["loss"] for r in step_records(runs_dir, name)} for name in ("world", "world_one"))
    if sorted(every) != sorted(one):
        raise Failed(f"the runs logged steps {sorted(every)} and {sorted(one)}")
    steps = sorted(one)
    gap = relative_gap([every[s] for s in steps], [one[s] for s in steps])
    tolerance = TARGETS["world"] if CUDA else WORLD_CPU
    return (f"{what} (the stdlib corpus, {chunks} chunks, so a rank could read another order)",
            f"{args.gpus} processes {', '.join(f'{every[s]:.4f}' for s in steps)}; one process "
            f"{', '.join(f'{one[s]:.4f}' for s in steps)}; largest relative difference {gap:.1e}",
            f"within {tolerance:g} (relative, each step): {verdict(gap <= tolerance)}")


def evals(work, runs_dir, args):
    stage(work, "ddp_resume")
    stage(work, "core")
    val = next((r for r in run_records(runs_dir, "ddp") if any(key.startswith("val_loss_T") for key in r)), None)
    if val is None:
        raise Failed("the run logged no eval")
    kept = sorted((runs_dir / "gpu_check_ddp").glob("ckpt_*_core_T*.json"))
    core = ((read_json(kept[-1]) or {}).get("runs") or [{}])[0] if kept else {}
    if core.get("core") is None:
        raise Failed("eval_core.py kept no CORE result beside the run's checkpoint")
    losses = ", ".join(f"T={key[10:]} {value:.3f}" for key, value in val.items() if key.startswith("val_loss_T"))
    return (f"{torchrun_title(args)}: an eval, then eval_core.py's CORE subset of the checkpoint (a made-up bundle of "
            "3 tasks, 8 items each)",
            f"step {val['step']}: val loss {losses}; CORE {core['core']:.3f} at T={core['T']}",
            "")


def precision(work, runs_dir, args):
    stage(work, "fp32")
    stage(work, "bf16")
    fp32, bf16 = ({r["step"]: r["loss"] for r in step_records(runs_dir, name)} for name in ("fp32", "bf16"))
    if fp32.keys() != bf16.keys():
        raise Failed(f"the runs logged different steps: {sorted(fp32)} and {sorted(bf16)}")
    differences = [abs(bf16[s] / fp32[s] - 1) for s in sorted(fp32)]
    tf32 = " (TF32 matmuls, as train.py sets on CUDA)" if CUDA else ""
    return (f"bf16 against float32{tf32}: training losses of {len(fp32)} identical eager steps",
            f"bf16 {', '.join(f'{bf16[s]:.4f}' for s in sorted(bf16))}; float32 "
            f"{', '.join(f'{fp32[s]:.4f}' for s in sorted(fp32))}; relative difference step 1 "
            f"{differences[0]:.3%}, largest {max(differences):.3%}",
            judged(f"<= {TARGETS['bf16']:.0%}", max(differences) <= TARGETS['bf16'], args))


ROWS = [  # number, what a failed row says it was, how it is built
    ("1", "versions and the matmul rate", versions),
    ("2a", "bench.py row 9: executed FLOP/s of the step, Parcae vs the Transformer", throughput),
    ("2b", "bench.py row 9: MFU against the measured matmul rate", mfu),
    ("2c", "bench.py row 3: per-sequence sampling's overhead at 32 and at the depth-24 plan's batch", sampling),
    ("2d", "bench.py row 4: memory flat in T", quoted("4", gpu_figure=False)),  # saved bytes, counted exactly
    ("2e", "bench.py row 5a: decoding depth", quoted("5a", gpu_figure=True)),  # times
    ("2f", "bench.py row 5b: KV-cache decoding", quoted("5b", gpu_figure=True)),
    ("2g", "bench.py row 7: torch.compile's speed-up and recompilations", quoted("7", gpu_figure=False)),
    ("3a", "train.py --depth=24 --mu_rec=8 --dry_run: the device batch, its plan against the peak", plan),
    ("3b", "one compiled depth-24 step", step24),
    ("4a", "torchrun: the loss falls, with gradient accumulation", train_run),
    ("4b", "torchrun: no recompilation after warm-up", recompilation),
    ("4c", "torchrun: tokens/s", tokens_per_second),
    ("4d", "torchrun: killed, then resumed, against an unbroken run", kill_and_resume),
    ("4e", "torchrun: an eval and a CORE subset", evals),
    ("4f", "torchrun: all processes against one, the same global batch", world_sizes),
    ("5", "bf16 against float32", precision),
]

# -----------------------------------------------------------------------------
# The faults runs/gpu_check.sh can inject, each of which a row must catch


def lower_recompile_limits(limit=2):
    """Dynamo's recompile limits at `limit` once model.compile_regions has run (it raises them for its regions, so
    setting them earlier does nothing)."""
    import model
    compile_regions = model.Parcae.compile_regions

    def lowered(self, *args, **kwargs):
        compile_regions(self, *args, **kwargs)
        torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = limit

    model.Parcae.compile_regions = lowered


def reverse_chunk_order(rank=1):
    """In the process of this rank alone, each epoch's chunks are read in reverse order: the others' data,
    one rank's order changed, which DDP never sees."""
    import data
    if int(os.environ.get("RANK", 0)) == rank:
        order = data.DocumentStream.order
        data.DocumentStream.order = lambda self, epoch: order(self, epoch)[::-1]


FAULTS = {"recompile_limit": lower_recompile_limits, "rank_order": reverse_chunk_order}


def fake_gpu(memory):
    """torch.cuda reporting one GPU of `memory` bytes: train.py's plan for it, on a CPU."""
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.mem_get_info = lambda device=None: (memory, memory)
    torch.cuda.get_device_name = lambda device=None: f"a GPU faked to report {memory / 1e9:.0f} GB"
    torch.cuda.get_device_properties = lambda device=None: SimpleNamespace(
        name=torch.cuda.get_device_name(), total_memory=memory)


def run_script(script, args, fault=None, memory=None):
    """`python SCRIPT ARGS...`, in this process, with a fault (FAULTS) or a faked GPU of `memory` bytes."""
    if fault:
        FAULTS[fault]()
    if memory:
        fake_gpu(memory)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


def perturb_checkpoint(path, factor=1.01):
    """Scale the first weight matrix of a checkpoint by `factor`, in place: a resume that restored it wrong."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    name = next(name for name, tensor in ckpt["model"].items() if tensor.is_floating_point() and tensor.dim() == 2)
    ckpt["model"][name] *= factor
    torch.save(ckpt, path)
    return name

def make_bundle(root):
    """A CORE bundle in the real layout (nanoparcae/core_tasks.py) at root: three made-up tasks, one of each kind."""
    root, tasks = Path(root), {task.label: task for task in CORE_TASKS}
    items = {"copa": [{"query": f"Item {i}: the loop", "choices": ["runs", "stops"], "gold": i % 2}
                      for i in range(16)],
             "winograd": [{"context_options": [f"The state {i}", f"The depth {i}"], "continuation": "grows.",
                           "gold": i % 2} for i in range(16)],
             "lambada_openai": [{"context": f"def f{i}(x):\n    return", "continuation": " x"} for i in range(16)]}
    for label, records in items.items():
        path = root / "eval_data" / tasks[label].path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
    with open(root / "eval_meta_data.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Eval Task", "Random baseline"])
        writer.writerows([["copa", 50], ["winograd", 50], ["lambada_openai", 0]])

# -----------------------------------------------------------------------------
# The table, and the commands runs/gpu_check.sh calls


def table(args):
    size = "--tiny: a tiny model, figures that test the script, not the claims" if args.tiny else \
        "the 140M (depth 6) and the 1.3B (depth 24)"
    where = torch.cuda.get_device_name(0) if CUDA else "a CPU"
    print(f"| # | runs/gpu_check.sh, {size}, on {where} | result | target |")
    print("|---|---|---|---|")
    failed = False
    for number, label, build in ROWS:
        try:
            cells = build(args.work, args.runs_dir, args)
        except Exception as err:  # the row says why, the others still print
            cells = (label, f"failed: {err if isinstance(err, Failed) else first_sentence(err)}", "")
        failed = failed or cells[1].startswith("failed: ") or cells[2].endswith(": not met")
        print("| " + " | ".join(cell.replace("|", "/") for cell in (number, *cells)) + " |")
    return 1 if failed else 0


def main(argv=None):
    parser = command_parser(__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("table", help="the check's table, from its stages' outputs")
    p.add_argument("work", type=Path, help="the folder of the stages' logs, exit statuses and bench.json")
    p.add_argument("runs_dir", type=Path, help="the runs folder holding gpu_check_* (base dir / runs)")
    p.add_argument("--gpus", type=positive(int), required=True, help="the processes torchrun started")
    p.add_argument("--memory", type=int, required=True, help="the GPU's memory in bytes (--tiny: the faked one)")
    p.add_argument("--tiny", action="store_true", help="the runs were runs/gpu_check.sh --tiny's")
    commands.add_parser("gpus", help="the GPUs torch sees")
    commands.add_parser("free_memory", help="the first GPU's free bytes (0 without one)")
    p = commands.add_parser("bundle", help="a CORE bundle of three made-up tasks")
    p.add_argument("dir", type=Path)
    p = commands.add_parser("planned_batch", help="the device batch a --dry_run's log plans for a GPU's bytes")
    p.add_argument("log", type=Path)
    p.add_argument("memory", type=int)
    p = commands.add_parser("perturb", help="scale a checkpoint's first weight matrix by 1.01, in place")
    p.add_argument("ckpt", type=Path)
    p = commands.add_parser("run", help="python SCRIPT ARGS..., with a fault or a faked GPU")
    p.add_argument("--fault", choices=sorted(FAULTS))
    p.add_argument("--fake_gpu", type=positive(int), metavar="BYTES", help="torch.cuda reports one GPU this big")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    for command in commands.choices.values():  # each a CommandParser, as its parent
        command.allow_abbrev = False
    args = parser.parse_args(argv)
    if args.command == "table":
        return table(args)
    if args.command == "gpus":
        print(torch.cuda.device_count())
    elif args.command == "free_memory":
        print(torch.cuda.mem_get_info()[0] if CUDA else 0)
    elif args.command == "bundle":
        make_bundle(args.dir)
    elif args.command == "planned_batch":
        print(planned_batch(args.log.read_text(), args.memory) or "")
    elif args.command == "perturb":
        print(f"== fault: {perturb_checkpoint(args.ckpt)} scaled by 1.01 in {args.ckpt}", file=sys.stderr)
    else:
        run_script(args.script, args.args, args.fault, args.fake_gpu)
    return 0


if __name__ == "__main__":
    run_command(main)
