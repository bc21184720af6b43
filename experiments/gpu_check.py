"""
gpu_check.py: the table of runs/gpu_check.sh, built from what its stages left; it runs nothing itself.

    python -m experiments.gpu_check WORK RUNS_DIR --gpus N [--tiny]      # as runs/gpu_check.sh calls it

WORK holds each stage's output (NAME.log) and "exit status, time limit" (NAME.rc), and bench.py's --json
(bench.json); RUNS_DIR holds the train.py runs gpu_check_NAME. Python rather than shell because the rows
read JSON and apply targets. Every row is built on its own: one that cannot be built says "failed: " and why
in one line, the others still print, and the exit status is 1.
"""

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import torch

from common import first_sentence
from experiments.bench import device_name, si

WARMUP_STEPS = 10  # train.py's compiled blocks may still compile graphs (the batch dimension going dynamic) until here
# FLOP/s against the Transformer, per-sequence sampling's overhead (paper: +1.8%), MFU, memory against the plan, bf16
TARGETS = {"flops_ratio": 1.0, "sampling_overhead": 0.02, "mfu": 0.40, "memory": 0.15, "bf16": 0.01}
CUDA = torch.cuda.is_available()


class Failed(Exception):
    """A row that could not be measured; its message is the one line the table shows."""


def verdict(ok):
    return "met" if ok else "not met"


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


def step_records(runs_dir, name):
    """The training records of run gpu_check_NAME (metrics.jsonl), or Failed."""
    path = runs_dir / f"gpu_check_{name}" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    records = [r for r in records if "loss" in r]
    if not records:
        raise Failed(f"run gpu_check_{name} logged no step")
    return records


def bench_row(work, number):
    """bench.py's row `number` as (what, result, ratio, target); Failed with bench's reason if it has none."""
    path = work / "bench.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    found = [row for row in rows if row[0] == number]
    if not found:
        stage(work, "bench")
        raise Failed(f"bench.py wrote no row {number}")
    return found[0][1:]


def bench_figure(work, key):
    path = work / "bench.json"
    figures = json.loads(path.read_text())["figures"] if path.exists() else {}
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
        rate = si(bench_figure(work, "matmul_rate"), "FLOP/s")
    except Failed as err:
        rate = f"failed: {err}"
    sizes = json.loads((work / "bench.json").read_text())["sizes"] if (work / "bench.json").exists() else "?"
    return (f"versions; the {'bf16' if CUDA else 'float32'} matmul rate at bench.py's shapes ({sizes})",
            f"torch {torch.__version__}, {where}; matmul {rate}", "")


def throughput(work, runs_dir, args):
    what, result, ratio, _ = bench_row(work, "1")
    flops_ratio = bench_figure(work, "flops_ratio")
    return (f"bench.py row 1: {what}", f"{result}; {ratio}",
            f"FLOP/s >= {TARGETS['flops_ratio']:.1f}x: {verdict(flops_ratio >= TARGETS['flops_ratio'])}")


def mfu(work, runs_dir, args):
    what, result, ratio, _ = bench_row(work, "2")
    value = bench_figure(work, "mfu")
    return (f"bench.py row 2: {what}", f"{result}; {ratio}",
            f"Parcae >= {TARGETS['mfu']:.0%}: {verdict(value >= TARGETS['mfu'])}")


def sampling(work, runs_dir, args):
    what, result, ratio, _ = bench_row(work, "3b")
    overhead = bench_figure(work, "sampling_overhead")
    return (f"bench.py row 3b: {what}", f"{result}; {ratio}",
            f"<= {TARGETS['sampling_overhead']:.0%}: {verdict(overhead <= TARGETS['sampling_overhead'])}")


def quoted(number):
    """bench.py's row `number` as it stands, its own target included."""
    def build(work, runs_dir, args):
        what, result, ratio, target = bench_row(work, number)
        return f"bench.py row {number}: {what}", f"{result}; {ratio}", target
    return build


def train_run(work, runs_dir, args):
    stage(work, "train")
    records = step_records(runs_dir, "train")
    first = statistics.mean(r["loss"] for r in records[:5])
    last = statistics.mean(r["loss"] for r in records[-5:])
    n = records[-1]["step"]
    return (f"train.py, bf16 and compiled, {n} steps on the stdlib corpus: the loss falls",
            f"loss {first:.3f} -> {last:.3f} (means of steps 1-5 and {n - 4}-{n})", f"falls: {verdict(last < first)}")


def recompilation(work, runs_dir, args):
    stage(work, "train")
    records = step_records(runs_dir, "train")
    if "graphs" not in records[-1]:
        raise Failed("train.py logged no graph count (not compiled?)")
    graphs = {r["step"]: r["graphs"] for r in records}
    n = records[-1]["step"]
    settled = graphs[n] == graphs[WARMUP_STEPS]
    return ("train.py, compiled: the graphs torch.compile built (dynamo's unique_graphs)",
            f"{graphs[1]} after step 1, {graphs[WARMUP_STEPS]} after step {WARMUP_STEPS}, {graphs[n]} after step {n}",
            f"none after step {WARMUP_STEPS}: {verdict(settled)}")


def tokens_per_second(work, runs_dir, args):
    stage(work, "train")
    last = step_records(runs_dir, "train")[-1]
    if last["tokens_per_s"] is None:
        raise Failed("too few steps for a rate")
    mfu_text = f", MFU {last['mfu']:.1%} of the listed bf16 peak (matmul FLOPs executed)" if last.get("mfu") else ""
    return ("train.py: tokens/s (moving average at the last step, the first step left out)",
            f"{last['tokens_per_s']:,.0f} tok/s{mfu_text}", "")


def torchrun(work, runs_dir, args):
    stage(work, "ddp")
    n = step_records(runs_dir, "ddp")[-1]["step"]
    checkpoint = runs_dir / "gpu_check_ddp" / f"ckpt_{n:06d}.pt"
    backend = "NCCL" if CUDA else "gloo (no GPU: NCCL not exercised)"
    return (f"torchrun --nproc_per_node={args.gpus} train.py, the same flags: the process group starts, steps "
            "and saves", f"{args.gpus} process(es), {backend}: {n} steps, "
            f"{checkpoint.name} {'saved' if checkpoint.exists() else 'missing'}",
            f"starts, steps, saves: {verdict(checkpoint.exists())}")


def memory(work, runs_dir, args):
    check = "peak torch.cuda.max_memory_allocated of the torchrun run against train.py --dry_run's plan per GPU"
    if not CUDA:
        return (check, "not run: no GPU", "")
    stage(work, "ddp")
    peak = step_records(runs_dir, "ddp")[-1]["peak_memory"] / 1e9
    stage(work, "dry_run")
    plan = re.search(r"= ([\d.]+) \| largest device batch", (work / "dry_run.log").read_text())
    if plan is None:
        raise Failed("train.py --dry_run printed no memory plan")
    plan = float(plan[1])
    return (check, f"peak {peak:.1f} GB, plan {plan:.1f} GB ({peak / plan - 1:+.0%})",
            f"within {TARGETS['memory']:.0%}: {verdict(abs(peak / plan - 1) <= TARGETS['memory'])}")


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
            f"<= {TARGETS['bf16']:.0%}: {verdict(max(differences) <= TARGETS['bf16'])}")


ROWS = [  # number, what a failed row says it was, how it is built
    ("1", "versions and the matmul rate", versions),
    ("2a", "bench.py row 1: executed FLOP/s, Parcae vs the Transformer", throughput),
    ("2b", "bench.py row 2: MFU against the measured matmul rate", mfu),
    ("2c", "bench.py row 3b: per-sequence sampling's overhead at the paper's 32 sequences per device", sampling),
    ("2d", "bench.py row 4: memory flat in T", quoted("4")),
    ("2e", "bench.py row 5a: decoding depth", quoted("5a")),
    ("2f", "bench.py row 5b: KV-cache decoding", quoted("5b")),
    ("2g", "bench.py row 7: torch.compile's speed-up and recompilations", quoted("7")),
    ("3a", "train.py: the loss falls", train_run),
    ("3b", "train.py: no recompilation after warm-up", recompilation),
    ("3c", "train.py: tokens/s", tokens_per_second),
    ("3d", "torchrun: starts, steps, saves", torchrun),
    ("4", "peak memory against the plan", memory),
    ("5", "bf16 against float32", precision),
]

# -----------------------------------------------------------------------------
# The table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("work", type=Path, help="the folder of the stages' logs, exit statuses and bench.json")
    parser.add_argument("runs_dir", type=Path, help="the runs folder holding gpu_check_* (base dir / runs)")
    parser.add_argument("--gpus", type=int, required=True, help="the processes torchrun started")
    parser.add_argument("--tiny", action="store_true", help="the runs were runs/gpu_check.sh --tiny's")
    args = parser.parse_args(argv)
    if args.gpus < 1:
        parser.error(f"--gpus must be at least 1, got {args.gpus}")
    size = "--tiny: a tiny model, figures that test the script, not the claims" if args.tiny else \
        "the 140M (depth 6)"
    where = torch.cuda.get_device_name(0) if CUDA else "a CPU"
    print(f"| # | runs/gpu_check.sh, {size}, on {where} | result | target |")
    print("|---|---|---|---|")
    failed = False
    for number, label, build in ROWS:
        try:
            cells = build(args.work, args.runs_dir, args)
        except Exception as err:  # the row says why, the others still print
            failed = True
            cells = (label, f"failed: {err if isinstance(err, Failed) else first_sentence(err)}", "")
        print("| " + " | ".join(cell.replace("|", "/") for cell in (number, *cells)) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
