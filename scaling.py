"""
scaling.py: the paper's scaling laws for looping (paper §5.2-5.3, Appendices L and O), planned, run, fitted, drawn.

    python scaling.py plan --depth=6 --flops=1e18,3e18,1e19 --mu_rec=1,2,4,6,8,12   # tokens, steps, GPU-hours
    python scaling.py run --preset=cpu && python scaling.py fit --preset=cpu          # the CPU micro study
    python scaling.py run --depth=6 --flops=1e18,3e18 --mu_rec=1,2,4,8                # on a GPU node (torchrun)

An isoFLOP sweep trains one model size at a few training-FLOP budgets C; inside a budget it trades recurrence
for data: tokens D = C / FLOPs-per-token(mu_rec), the arithmetic of train.py's --target_flops. The fit reports:
- per budget, a parabola of final loss in ln mu_rec: mu_rec*(C), D*(C), L*(C) (paper §5.2, Fig. 4);
- the power laws mu_rec* = a C^g_mu and D* = b C^g_D (paper: 0.40 and 0.78), and, fitted on all budgets but the
  largest, their error predicting it (the paper's extrapolation test);
- the unified law L(T | mu_rec, D) = E + X mu_rec^-x + Y D^-y + Z exp(-z T / mu_rec) (paper §5.3, App. L),
  fitted jointly with a Huber loss and L-BFGS from several starts, on the looped models evaluated at ten T;
- the frontier: the best looped loss against the fixed-depth (mu_rec = 1) loss at each budget (Fig. 6).
Runs live under <base dir>/runs/<sweep>_C<budget>_mu<mu_rec>; the JSON and figures under <base dir>/scaling/<sweep>.
"""

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from data import get_base_dir
from model import Parcae, ParcaeConfig

ROOT = Path(__file__).resolve().parent
H100_BF16, MFU = 989e12, 0.4  # GPU-hour estimates: dense bf16 peak at 40% MFU, as in README's size table

# -----------------------------------------------------------------------------
# Sweeps. A sweep is a model (train.py flags), budgets C, mu_rec values and the test-time depths T of the fit.

PAPER_MODEL = dict(head_dim=128, vocab_size=32768, seq_len=2048)  # train.py's paper preset fills the rest
PAPER_BATCH = 524_288
# The CPU micro study: the small CPU model on the stdlib corpus (no download), 3 budgets spanning 4x, 4 values of
# mu_rec, 12 runs. Sized from measured throughput (about 90 GFLOP/s of model FLOPs on 2 quiet cores, README's
# bench row 1): 28 x 4e12 FLOPs of training is about 21 minutes, plus evaluation.
PRESETS = {
    "cpu": dict(depth=3, flops=[4e12, 8e12, 1.6e13], mu_rec=[1, 2, 4, 8], T=[1, 2, 3, 4, 5, 6, 8, 10, 12, 16],
                model=dict(d_model=128, head_dim=64, vocab_size=4096, seq_len=128), batch=2048,
                train_args=["--device_batch_size=16", "--eval_every=1000000", "--eval_tokens=16384",
                            "--core_every=-1", "--save_every=50", "--log_every=25", "--compile=0", "--data=stdlib"],
                eval_args=["--val_tokens=16384"]),
}


def make_sweep(args):
    """The sweep of --preset, or one built from --depth/--flops/--mu_rec with the paper's model and batch."""
    if args.preset:
        sweep = dict(PRESETS[args.preset], name=args.preset)
    else:
        sweep = dict(depth=args.depth, flops=None, mu_rec=None, T=list(range(1, 11)), model=dict(PAPER_MODEL),
                     batch=PAPER_BATCH, train_args=[], eval_args=[], name=f"d{args.depth}")
    for key in ("flops", "mu_rec", "T", "depth"):
        if getattr(args, key, None) is not None:
            sweep[key] = getattr(args, key)
    sweep["name"] = args.sweep or sweep["name"]
    if not sweep["flops"] or not sweep["mu_rec"]:
        fail("give --flops and --mu_rec (e.g. --flops=1e18,3e18 --mu_rec=1,2,4,8) or a --preset")
    return sweep


def model_size(sweep, mu_rec):
    """-> (parameters, training FLOPs per token) from model.py, the numbers train.py's --target_flops uses."""
    try:
        config = ParcaeConfig.from_depth(sweep["depth"], mu_rec=mu_rec, **sweep["model"])
    except ValueError as err:
        fail(err)
    with torch.device("meta"):
        model = Parcae(config)
    return model.num_params(), model.flops_per_token()


def points(sweep):
    """One dict per (C, mu_rec): the run's name, tokens D = C / FLOPs per token, and the steps train.py takes."""
    out = []
    for C in sweep["flops"]:
        for mu in sweep["mu_rec"]:
            params, fpt = model_size(sweep, mu)
            tokens = C / fpt
            steps = max(1, int(tokens // sweep["batch"]))  # train.py: int(max_tokens // total_batch_size)
            out.append(dict(name=f"{sweep['name']}_C{C:.3g}_mu{mu}", C=C, mu_rec=mu, params=params,
                            flops_per_token=fpt, tokens=tokens, steps=steps, trained_tokens=steps * sweep["batch"]))
    return out


def train_flags(sweep, point):
    """train.py's flags for one point; mu_rec = 1 is the paper's fixed-depth Parcae (App. O), so depth is fixed."""
    flags = [f"--depth={sweep['depth']}", f"--mu_rec={point['mu_rec']}", f"--target_flops={point['C']:g}",
             f"--total_batch_size={sweep['batch']}", f"--run={point['name']}"]
    flags += [f"--{key}={value}" for key, value in sweep["model"].items()] + sweep["train_args"]
    return flags + (["--sampling=fixed"] if point["mu_rec"] == 1 else [])


def launcher(gpus):
    """torchrun on a GPU node (flags after `--`, so --run is not read as torchrun's own), plain python on a CPU."""
    if gpus:
        return ["torchrun", "--standalone", f"--nproc_per_node={gpus}", "--"]
    return [sys.executable]


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


# -----------------------------------------------------------------------------
# Plan

def plan(sweep, gpus):
    rows = points(sweep)
    print(f"isoFLOP plan '{sweep['name']}': depth {sweep['depth']}, {rows[0]['params']:,} parameters, "
          f"{sweep['batch']:,} tokens per step")
    print("| C (FLOPs) | mu_rec | FLOPs/token | tokens D = C / FLOPs per token | steps | tokens/param | GPU-hours |")
    print("|---|---|---|---|---|---|---|")
    for p in rows:
        hours = p["C"] / (H100_BF16 * MFU) / 3600
        print(f"| {p['C']:.3g} | {p['mu_rec']} | {p['flops_per_token']:.4e} | {p['tokens']:,.0f} | {p['steps']:,} "
              f"| {p['tokens'] / p['params']:.1f} | {hours:.2f} |")
    commands = [" ".join(launcher(gpus) + ["train.py"] + train_flags(sweep, p)) for p in rows]
    out_dir = get_base_dir() / "scaling" / sweep["name"]
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text(out_dir / "commands.sh", "\n".join(commands) + "\n")
    print(f"\nGPU-hours: C at {MFU:.0%} MFU of an H100's {H100_BF16 / 1e12:.0f} TFLOP/s. One command per point "
          f"(also in {out_dir / 'commands.sh'}, one per line, for a scheduler such as a SLURM array):")
    print("\n".join(commands))
    return rows


def write_text(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# -----------------------------------------------------------------------------
# Run: one point after another; finished points are skipped, a killed one resumes through train.py --resume

def run_dir(point):
    return get_base_dir() / "runs" / point["name"]


def final_eval(point):
    """The eval record train.py wrote at the last step, or None."""
    path = run_dir(point) / "metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return next((r for r in reversed(records) if r.get("step") == point["steps"] and
                 f"val_loss_T{point['mu_rec']}" in r), None)


def bpb_result(point, Ts):
    """eval_core.py's `--eval bpb` JSON of this run covering every T, or None."""
    for path in sorted(run_dir(point).glob("ckpt_*_bpb_T*.json")):
        result = json.loads(path.read_text())
        if set(Ts) <= set(result["T"]) and result.get("step") == point["steps"]:
            return result
    return None


def run_logged(cmd, log_path):
    """Run cmd with its output appended to log_path; -> its return code."""
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode


def ensure_bpb(sweep, point):
    """Loss at every T of the sweep for a finished run, through eval_core.py when the JSON is missing."""
    if bpb_result(point, sweep["T"]) is None:
        cmd = [sys.executable, "eval_core.py", "--eval=bpb", f"--run={point['name']}",
               f"--T={','.join(map(str, sweep['T']))}"] + sweep["eval_args"]
        run_logged(cmd, run_dir(point) / "eval.log")
    return bpb_result(point, sweep["T"])


def run(sweep, gpus):
    rows = points(sweep)
    for i, p in enumerate(rows):
        where = f"[{i + 1}/{len(rows)}] {p['name']} (C {p['C']:.3g}, mu_rec {p['mu_rec']}, {p['steps']} steps)"
        if final_eval(p) is None:
            resume = any(run_dir(p).glob("ckpt_*.pt"))
            run_dir(p).mkdir(parents=True, exist_ok=True)
            print(f"{where}: {'resuming' if resume else 'training'}, log {run_dir(p) / 'train.log'}", flush=True)
            cmd = launcher(gpus) + ["train.py"] + train_flags(sweep, p) + (["--resume"] if resume else [])
            if run_logged(cmd, run_dir(p) / "train.log") != 0 or final_eval(p) is None:
                print(f"{where}: train.py failed, see {run_dir(p) / 'train.log'}; going on", flush=True)
                continue
        else:
            print(f"{where}: done, skipped", flush=True)
        if ensure_bpb(sweep, p) is None:
            print(f"{where}: eval_core.py failed, see {run_dir(p) / 'eval.log'}", flush=True)


# -----------------------------------------------------------------------------
# Fit

def fit(sweep):
    raise NotImplementedError


# -----------------------------------------------------------------------------
# Command line

def parse_list(text, kind, flag):
    try:
        values = [kind(float(v)) if kind is int and "e" in v else kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        fail(f"{flag}={text!r} must be numbers separated by commas, e.g. {flag}=1,2,4")
    return values


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["plan", "run", "fit"])
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a ready sweep: cpu = the CPU micro study")
    parser.add_argument("--depth", type=int, default=6, help="model size (train.py --depth)")
    parser.add_argument("--flops", type=lambda s: parse_list(s, float, "--flops"), help="budgets C, e.g. 1e18,3e18")
    parser.add_argument("--mu_rec", type=lambda s: parse_list(s, int, "--mu_rec"), help="e.g. 1,2,4,8")
    parser.add_argument("--T", type=lambda s: parse_list(s, int, "--T"), help="test-time depths of the unified fit")
    parser.add_argument("--sweep", help="sweep name (default: the preset's, or d<depth>)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="processes per point (default: every GPU here for run, 8 for plan's commands)")
    args = parser.parse_args(argv)
    if args.preset and args.depth != 6 and args.depth != PRESETS[args.preset]["depth"]:
        fail(f"--preset={args.preset} fixes the model; drop --depth or the preset")
    if args.preset:
        args.depth = None
    sweep = make_sweep(args)
    if args.command == "plan":
        plan(sweep, 8 if args.gpus is None else args.gpus)
    elif args.command == "run":
        gpus = torch.cuda.device_count() if args.gpus is None else args.gpus
        run(sweep, gpus if torch.cuda.is_available() else 0)
    else:
        fit(sweep)


if __name__ == "__main__":
    main()
