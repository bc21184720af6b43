"""
scaling.py: the paper's scaling laws for looping (paper §5.2-5.3, Appendices L and O), planned, run, fitted, drawn.

    python -m experiments.scaling plan --depth=6 --flops=1e18,3e18,1e19 --mu_rec=1,2,4,6,8,12  # tokens, GPU-hours
    python -m experiments.scaling run --preset=cpu       # the CPU study, ~1 h
    python -m experiments.scaling fit --preset=cpu       # its fits and figures
    python -m experiments.scaling run --depth=6 --flops=1e18,3e18 --mu_rec=1,2,4,8 --seeds=3  # on a GPU node (torchrun)
    python -m experiments.scaling fit --refit figures/scaling_cpu/fit.json                   # recorded runs, refitted

An isoFLOP sweep trains one model size at a few training-FLOP budgets C.
Inside a budget it trades recurrence for data, D = C / FLOPs-per-token(mu_rec), as train.py's --target_flops does.
The middle budget is trained with --seeds seeds, which measures the noise.
A seed changes the init, the data order, the depths and h0.
The fit (scaling_fit.py) reports these:

- per budget, a parabola of final loss in ln mu_rec, giving mu_rec*(C), D*(C) and L*(C) (paper §5.2, Fig. 4).
- the power laws mu_rec* = a C^g_mu and D* = b C^g_D (paper: 0.40 and 0.78), with bootstrap 90% intervals.
- the same laws fitted on all budgets but the largest, and their error predicting its mu_rec*, D* and L*.
- the unified law L(T | mu_rec, D) = E + X mu_rec^-x + Y D^-y + Z exp(-z T / mu_rec) (paper §5.3, App. L).
- its error on the largest budget's runs at every T, fitted on the other budgets at ten T.
- the frontier, the best looped loss against the fixed-depth loss at each budget (Fig. 6).
- the frontier's paired 90% t-interval over seeds; looping wins only where it excludes 0.

Runs live under <base dir>/runs/<sweep>_C<budget>_mu<mu_rec>[_s<seed>].
The JSON and figures go under <base dir>/scaling/<sweep>.
"""

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from nanoparcae.checkpoint import latest, run_dir
from nanoparcae.command import comma_list, command_parser, run_command
from nanoparcae.files import get_base_dir, read_json, write_atomically, write_json
from nanoparcae.ranks import PEAK_BF16_FLOPS
from nanoparcae.metrics import read_metrics
from experiments.scaling_fit import (bootstrap_exponents, fit_unified, interval_verdict, mean_relative_error,
                                     paired_interval, parabola_optimum, pooled_spread, power_law, t_interval,
                                     unified_predict)
from experiments.plot import pyplot, save_png
from experiments.timing import markdown_table
from model import Parcae, ParcaeConfig

ROOT = Path(__file__).resolve().parent.parent  # the repository: train.py runs from there
H100_BF16, MFU = PEAK_BF16_FLOPS["H100"], 0.4  # GPU-hour estimates: 40% MFU of the executed FLOPs, as README's table

# -----------------------------------------------------------------------------
# Sweeps. A sweep is a model (train.py flags), budgets C, mu_rec values and the test-time depths T of the fit.

PAPER_MODEL = dict(head_dim=128, vocab_size=32768, seq_len=2048)  # train.py's defaults, the paper's, fill the rest
PAPER_BATCH = 524_288
# The CPU study (docs/scaling.md): the paper's regime, up to 20+ tokens per parameter (its 140M sees 5-25),
# reached by a 254,720-parameter model: depth 3, d_model 64, a 512-token vocabulary, 128-token rows. Five budgets
# spanning 16x, mu_rec 1-8, three seeds at the middle budget: 28 runs, 8.8e13 training FLOPs of C, which one core
# trains through at about 4e10 of C a second; 57.6 minutes end to end on one core.
# Learning rates 4x the paper's 8e-3, from a short sweep (docs/scaling.md).
PRESETS = {
    "cpu": dict(depth=3, flops=[5.625e11, 1.125e12, 2.25e12, 4.5e12, 9e12], mu_rec=[1, 2, 4, 8], seeds=3,
                T=[1, 2, 3, 4, 5, 6, 8, 10, 12, 16],
                model=dict(d_model=64, head_dim=32, vocab_size=512, seq_len=128), batch=2048,
                train_args=["--device_batch_size=16", "--eval_every=1000000", "--eval_tokens=32768",
                            "--save_every=500", "--log_every=100", "--compile=0", "--dtype=float32",
                            "--data=stdlib", "--adamw_lr=3.2e-2", "--muon_lr=3.2e-2"],
                eval_args=["--val_tokens=32768"]),
}


def make_sweep(args):
    """The sweep of --preset, or one built from --depth/--flops/--mu_rec with the paper's model and batch."""
    if args.preset:
        sweep = dict(PRESETS[args.preset], name=args.preset)
    else:
        sweep = dict(depth=args.depth or 6, flops=None, mu_rec=None, seeds=1, T=[1, 2, 3, 4, 6, 8, 12, 16, 20, 24],
                     model=dict(PAPER_MODEL), batch=PAPER_BATCH, train_args=[], eval_args=[],
                     name=f"d{args.depth or 6}")
    for key in ("flops", "mu_rec", "T", "depth", "seeds"):
        if getattr(args, key, None) is not None:
            sweep[key] = getattr(args, key)
    sweep["name"] = args.sweep or sweep["name"]
    if not sweep["flops"] or not sweep["mu_rec"]:
        raise ValueError("give --flops and --mu_rec (e.g. --flops=1e18,3e18 --mu_rec=1,2,4,8) or a --preset")
    if sweep["seeds"] < 1:
        raise ValueError(f"--seeds={sweep['seeds']} must be at least 1")
    return sweep


def seed_budget(sweep):
    """The budget trained with every seed: the middle one (of the sorted budgets)."""
    return sorted(sweep["flops"])[len(sweep["flops"]) // 2]


def model_size(sweep, mu_rec):
    """Size one point from model.py -> (parameters, the paper's C per token, executed matmul FLOPs per token).
    train.py's --target_flops divides C; the GPU-hour estimate's MFU applies to the executed count.
    It samples depths as train_flags runs the point, so mu_rec = 1 is at fixed depth."""
    config = ParcaeConfig.from_depth(sweep["depth"], mu_rec=mu_rec, **sweep["model"],
                                     sampling="fixed" if mu_rec == 1 else "per_sequence")
    with torch.device("meta"):
        model = Parcae(config)
    return model.num_params(), model.paper_flops_per_token(), model.matmul_flops_per_token()


def points(sweep):
    """One dict per (C, mu_rec, seed): the run's name, tokens D = C / FLOPs per token, the steps train.py takes.
    Seed 0 of every budget first, then the middle budget's other seeds."""
    out = []
    grid = [(C, mu, 0) for C in sweep["flops"] for mu in sweep["mu_rec"]]
    grid += [(seed_budget(sweep), mu, seed) for seed in range(1, sweep["seeds"]) for mu in sweep["mu_rec"]]
    for C, mu, seed in grid:
        params, fpt, executed = model_size(sweep, mu)
        tokens = C / fpt
        steps = max(1, int(tokens // sweep["batch"]))  # train.py: int(max_tokens // total_batch_size)
        out.append(dict(name=f"{sweep['name']}_C{C:.3g}_mu{mu}" + (f"_s{seed}" if seed else ""), C=C, mu_rec=mu,
                        seed=seed, params=params, flops_per_token=fpt, tokens=tokens, steps=steps,
                        trained_tokens=steps * sweep["batch"], executed_flops=tokens * executed))
    return out


def train_flags(sweep, point):
    """train.py's flags for one point; mu_rec = 1 is the paper's fixed-depth Parcae (App. O), so depth is fixed.
    train.py's --seed draws the initial weights, the data order, the sampled depths and h0."""
    flags = [f"--depth={sweep['depth']}", f"--mu_rec={point['mu_rec']}", f"--target_flops={point['C']:g}",
             f"--total_batch_size={sweep['batch']}", f"--run={point['name']}", f"--seed={point['seed']}"]
    flags += [f"--{key}={value}" for key, value in sweep["model"].items()] + sweep["train_args"]
    return flags + (["--depth_sampling=fixed"] if point["mu_rec"] == 1 else [])


def launcher(gpus):
    """torchrun on a GPU node (flags after `--`, so --run is not read as torchrun's own), plain python on a CPU."""
    if gpus:
        return ["torchrun", "--standalone", f"--nproc_per_node={gpus}", "--"]
    return [sys.executable]


# -----------------------------------------------------------------------------
# Plan

def plan(sweep, gpus):
    rows = points(sweep)
    print(f"isoFLOP plan '{sweep['name']}': depth {sweep['depth']}, {rows[0]['params']:,} parameters, "
          f"{sweep['batch']:,} tokens per step")
    print(markdown_table(
        ["C (FLOPs)", "mu_rec", "seed", "FLOPs/token", "tokens D = C / FLOPs per token", "steps", "tokens/param",
         "GPU-hours"],
        [(f"{p['C']:.3g}", p["mu_rec"], p["seed"], f"{p['flops_per_token']:.4e}", f"{p['tokens']:,.0f}",
          f"{p['steps']:,}", f"{p['tokens'] / p['params']:.1f}",
          f"{p['executed_flops'] / (H100_BF16 * MFU) / 3600:.2f}") for p in rows]), end="")
    per_param = [p["tokens"] / p["params"] for p in rows]
    print(f"\n{len(rows)} runs, {sum(p['C'] for p in rows):.3g} training FLOPs in all; {len(sweep['flops'])} budgets "
          f"spanning {max(sweep['flops']) / min(sweep['flops']):.3g}x; {min(per_param):.1f}-{max(per_param):.1f} "
          f"tokens per parameter; seeds at C = {seed_budget(sweep):.3g}: {sweep['seeds']}")
    commands = [" ".join(launcher(gpus) + ["train.py"] + train_flags(sweep, p)) for p in rows]
    out_dir = get_base_dir() / "scaling" / sweep["name"]
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(out_dir / "commands.sh", lambda partial: partial.write_text("\n".join(commands) + "\n"))
    print(f"\nGPU-hours: the matmul FLOPs the D tokens execute at {MFU:.0%} MFU of an H100's {H100_BF16 / 1e12:.0f} "
          f"TFLOP/s. One command per point "
          f"(also in {out_dir / 'commands.sh'}, one per line, for a scheduler such as a SLURM array):")
    print("\n".join(commands))
    return rows


# -----------------------------------------------------------------------------
# Run: one point after another (finished ones skipped, a killed one resumed by train.py --resume), then the
# looped runs' losses at every T

def final_eval(point):
    """The eval record train.py wrote at the last step, or None."""
    records = read_metrics(run_dir(point["name"]) / "metrics.jsonl")
    return next((r for r in reversed(records) if r.get("step") == point["steps"] and
                 f"val_loss_T{point['mu_rec']}" in r), None)


def bpb_result(point, Ts):
    """eval_core.py's `--eval bpb` JSON of this run covering every T, or None."""
    for path in sorted(run_dir(point["name"]).glob("ckpt_*_bpb_T*.json")):
        result = read_json(path)
        if set(Ts) <= set(result["T"]) and result.get("step") == point["steps"]:
            return result
    return None


def run_logged(cmd, log_path, env=None):
    """Run cmd with its output appended to log_path; -> its return code."""
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env).returncode


def ensure_bpb(sweep, point):
    """Loss at every T of the sweep for a finished run, through eval_core.py when the JSON is missing."""
    if bpb_result(point, sweep["T"]) is None:
        cmd = [sys.executable, "eval_core.py", "--eval=bpb", f"--run={point['name']}",
               f"--T={','.join(map(str, sweep['T']))}"] + sweep["eval_args"]
        run_logged(cmd, run_dir(point["name"]) / "eval.log")
    return bpb_result(point, sweep["T"])


def minutes(seconds):
    return f"{seconds / 60:.1f} min"


def run(sweep, gpus):
    """Train (or resume) each point, then evaluate a looped one at every T.
    Each point prints a line with the time so far and an ETA.
    The ETA is this invocation's time per training FLOP times the FLOPs still to train."""
    rows = points(sweep)
    start, done_flops, fresh_s, fresh_tokens = time.time(), 0.0, 0.0, 0
    left_flops = sum(p["C"] for p in rows if final_eval(p) is None)
    for i, p in enumerate(rows):
        where = f"[{i + 1}/{len(rows)}] {p['name']} (C {p['C']:.3g}, mu_rec {p['mu_rec']}, seed {p['seed']}, " \
                f"{p['steps']} steps)"
        if final_eval(p) is None:
            folder = run_dir(p["name"])
            resume = latest(folder) is not None
            folder.mkdir(parents=True, exist_ok=True)
            log_path = folder / "train.log"
            print(f"{where}: {'resuming' if resume else 'training'}, log {log_path}", flush=True)
            cmd = launcher(gpus) + ["train.py"] + train_flags(sweep, p) + (["--resume"] if resume else [])
            t0 = time.time()
            failed = run_logged(cmd, log_path) != 0 or final_eval(p) is None
            if not resume and not failed:  # throughput from whole runs only
                fresh_s, fresh_tokens = fresh_s + time.time() - t0, fresh_tokens + p["trained_tokens"]
            done_flops, left_flops = done_flops + p["C"], left_flops - p["C"]
            status = f"train.py failed, see {log_path}; going on" if failed else "trained"
        else:
            status = "done, skipped"
        if p["mu_rec"] > 1 and final_eval(p) is not None and ensure_bpb(sweep, p) is None:
            status += f"; eval_core.py failed, see {run_dir(p['name']) / 'eval.log'}"
        elapsed = time.time() - start
        eta = minutes(elapsed / done_flops * left_flops) if done_flops else "-"
        print(f"{where}: {status} | elapsed {minutes(elapsed)} | ETA {eta}", flush=True)
    print(f"run: {minutes(time.time() - start)} in all" + (f"; {fresh_tokens:,} tokens trained from scratch in "
          f"{minutes(fresh_s)}, {fresh_tokens / fresh_s / 1e3:.1f} ktok/s (train.py's start and final eval included)"
          if fresh_s else ""), flush=True)


# -----------------------------------------------------------------------------
# Fit: read the runs, fit, print a table, write one JSON and the figures

def collect(sweep, notes):
    """-> finished runs (each point with its final loss at T = mu_rec and its losses at every T); a missing or
    diverged run becomes one note naming it."""
    done = []
    for p in points(sweep):
        record = final_eval(p)
        if record is None:
            notes.append(f"run {p['name']} is missing (no final eval at step {p['steps']} in "
                         f"{run_dir(p['name']) / 'metrics.jsonl'}); `python -m experiments.scaling run` trains or "
                         f"resumes it")
            continue
        loss = record[f"val_loss_T{p['mu_rec']}"]
        if not math.isfinite(loss):
            notes.append(f"run {p['name']} diverged (val loss {loss} at T={p['mu_rec']}); left out of the fits")
            continue
        bpb = ensure_bpb(sweep, p) if p["mu_rec"] > 1 else None  # fixed-depth runs are not in the unified law
        if bpb is None and p["mu_rec"] > 1:
            notes.append(f"run {p['name']} has no loss at T={sweep['T']} ({run_dir(p['name']) / 'eval.log'}); "
                         f"left out of the unified law")
        done.append(dict(p, loss=loss, curve=None if bpb is None else dict(T=bpb["T"], loss=bpb["loss"])))
    return done


def fit_budgets(runs, notes):
    """Per budget: the mean loss over seeds at each mu_rec (and its seed spread), the parabola through the means,
    the fixed-depth loss and the best looped one."""
    budgets = {}
    for C in sorted({r["C"] for r in runs}):
        mus = sorted({r["mu_rec"] for r in runs if r["C"] == C})
        if len(mus) < 3:
            notes.append(f"budget C={C:.3g} has {len(mus)} finished values of mu_rec; its parabola needs 3")
            continue
        seeds = [[r["loss"] for r in runs if r["C"] == C and r["mu_rec"] == mu] for mu in mus]
        loss = [float(np.mean(s)) for s in seeds]
        tokens = [next(r["trained_tokens"] for r in runs if r["C"] == C and r["mu_rec"] == mu) for mu in mus]
        b = dict(parabola_optimum(mus, loss, tokens), C=C, mu_rec=mus, loss=loss, tokens=tokens,
                 seeds=[len(s) for s in seeds], seed_losses=seeds,
                 spread=[float(np.std(s, ddof=1)) if len(s) > 1 else None for s in seeds])
        looped = [(mu, L) for mu, L in zip(mus, loss) if mu > 1]
        b["fixed_depth_loss"] = loss[0] if mus[0] == 1 else None
        b["best_looped"] = dict(zip(("mu_rec", "loss"), min(looped, key=lambda m: m[1]))) if looped else None
        budgets[C] = b
    return budgets


def paired_spread(runs):
    """Measure the seed spread of looped minus fixed-depth loss, pooled over the looped mu_rec.
    A seed's data order moves every mu_rec of it together.
    So the difference can vary less than the losses do."""
    loss = {(r["C"], r["mu_rec"], r["seed"]): r["loss"] for r in runs}
    groups = {}
    for (C, mu, seed), L in loss.items():
        if mu > 1 and (C, 1, seed) in loss:
            groups.setdefault((C, mu), []).append(L - loss[C, 1, seed])
    return pooled_spread(list(groups.values()))


def judge_frontier(budgets, runs, paired_sigma=None, paired_dof=0):
    """Judge each budget's margin, fixed minus best looped, with a paired 90% t-interval.
    The interval (scaling_fit.paired_interval) uses the budget's own seeds where it has two or more.
    Otherwise it uses one pair with the pooled paired spread of the seeded budget.
    The verdict is 'looped' or 'fixed' when the interval excludes 0 on that side, 'within noise' when it holds 0."""
    loss = {(r["C"], r["mu_rec"], r["seed"]): r["loss"] for r in runs}
    for C, b in budgets.items():
        if b["fixed_depth_loss"] is None or b["best_looped"] is None:
            continue
        b["margin"] = b["fixed_depth_loss"] - b["best_looped"]["loss"]
        mu = b["best_looped"]["mu_rec"]
        pairs = [L - loss[C, mu, s] for (c, m, s), L in loss.items() if c == C and m == 1 and (C, mu, s) in loss]
        if len(pairs) >= 2:
            b["ci90"], b["interval_from"] = paired_interval(pairs)["ci90"], f"{len(pairs)} paired seeds"
        elif paired_sigma is not None:
            b["ci90"] = t_interval(b["margin"], paired_sigma, paired_dof)
            b["interval_from"] = f"the pooled paired spread ({paired_dof} degrees of freedom)"
        else:
            b["ci90"], b["interval_from"] = None, "no seeds"
        b["verdict"] = {"shown": "looped", "opposite": "fixed"}.get(interval_verdict(b["ci90"], +1), "within noise")


def fit_power_laws(budgets, sigma, notes):
    """Fit g_mu and g_D on every budget, with bootstrap 90% intervals over the seed spread.
    Then fit on all but the largest budget and measure the error predicting its mu_rec*, D* and L*.
    That is paper §5.2's extrapolation test."""
    C = sorted(budgets)
    if len(C) < 2:
        notes.append(f"{len(C)} budget(s) with a parabola; the power laws need 2 (the extrapolation test 3)")
        return None
    intervals = bootstrap_exponents([budgets[c] for c in C], sigma) if sigma else {}
    out = {}
    for key, label in (("mu_star", "mu_rec"), ("D_star", "D"), ("L_star", "L")):
        k, g = power_law(C, [budgets[c][key] for c in C])
        out[label] = dict(k=k, exponent=g)
        if label in intervals:
            out[label]["interval90"] = intervals[label]
        if len(C) >= 3:
            k, g = power_law(C[:-1], [budgets[c][key] for c in C[:-1]])
            predicted, observed = k * C[-1] ** g, budgets[C[-1]][key]
            out[label]["held_out"] = dict(C=C[-1], k=k, exponent=g, predicted=predicted, observed=observed,
                                          relative_error=abs(predicted - observed) / observed)
    if not sigma:
        notes.append("no point was run with several seeds: the exponents have no interval (give --seeds=3)")
    return out


def fit_unified_law(runs, notes):
    """Fit the unified law on the looped runs of every budget but the largest, at every T.
    The law's exp(-z T / mu) describes depth-sampled training, so fixed-depth runs stay out.
    The largest budget's runs are the held-out models.
    With one budget there is nothing to hold out, and D moves with mu_rec alone.
    Then the fit describes the curves but does not separate x from y."""
    looped = [r for r in runs if r["mu_rec"] > 1 and r["curve"]]
    budgets = sorted({r["C"] for r in looped})
    if len(looped) < 2:
        notes.append("the unified law needs 2 looped runs or more with losses at every T")
        return None
    if len(budgets) == 1:
        notes.append(f"looped runs in one budget only (C={budgets[0]:.3g}): the unified law is fitted in sample, "
                     f"nothing is held out, and its x and y are not identifiable")
    rows = [(r["C"], r["mu_rec"], r["trained_tokens"], T, L) for r in looped for T, L in zip(*r["curve"].values())]
    held_C = budgets[-1] if len(budgets) > 1 else None
    train, held = [row for row in rows if row[0] != held_C], [row for row in rows if row[0] == held_C]
    params = fit_unified(*zip(*[row[1:] for row in train]))

    def error(part):
        return mean_relative_error(unified_predict(params, *zip(*[r[1:4] for r in part])), [r[4] for r in part])

    return dict(params=params, in_sample_error=error(train), held_out_error=error(held) if held else None,
                held_out_C=held_C, points_in_sample=len(train), points_held_out=len(held))


def fit(sweep, runs=None, out_dir=None):
    """Fit the sweep's finished runs (or `runs`, a fit.json's recorded ones) -> fit.json and figures in out_dir."""
    notes = []
    runs = collect(sweep, notes) if runs is None else runs
    budgets = fit_budgets(runs, notes)
    sigma, dof = pooled_spread([s for b in budgets.values() for s in b["seed_losses"]])
    paired_sigma, paired_dof = paired_spread(runs)
    judge_frontier(budgets, runs, paired_sigma, paired_dof)
    laws = fit_power_laws(budgets, sigma, notes)
    unified = fit_unified_law(runs, notes)
    out_dir = out_dir or get_base_dir() / "scaling" / sweep["name"]
    out_dir.mkdir(parents=True, exist_ok=True)
    noise = dict(sigma=sigma, degrees_of_freedom=dof, paired_sigma=paired_sigma, paired_degrees_of_freedom=paired_dof,
                 seeds=sweep["seeds"], budget=seed_budget(sweep),
                 bootstrap="parametric: every budget's mean losses redrawn with N(0, sigma^2 / seeds), parabolas and "
                           "power laws refitted, 2000 draws, 5th-95th percentiles")
    result = dict(sweep=sweep, runs=runs, budgets={f"{C:.3g}": b for C, b in budgets.items()}, noise=noise,
                  power_laws=laws, unified=unified, notes=notes)
    write_json(out_dir / "fit.json", result)
    print_report(runs, budgets, noise, laws, unified, notes)
    figures = draw(runs, budgets, sigma, laws, unified, out_dir)
    print(f"\nwrote {out_dir / 'fit.json'} and {', '.join(str(f) for f in figures)}")
    return result


PAPER_EXPONENTS = {"mu_rec": 0.40, "D": 0.78}


def print_report(runs, budgets, noise, laws, unified, notes):
    sigma, paired = noise["sigma"], noise["paired_sigma"]
    mus = sorted({r["mu_rec"] for r in runs})
    print("final val loss at T = mu_rec (nats); mean +- seed standard deviation where several seeds ran\n")
    rows = []
    for C, b in budgets.items():
        cells = {mu: f"{L:.4f}" + (f" +- {s:.4f}" if s is not None else "")
                 for mu, L, s in zip(b["mu_rec"], b["loss"], b["spread"])}
        best = min(cells, key=lambda mu: b["loss"][b["mu_rec"].index(mu)])
        cells[best] = f"**{cells[best]}**"
        per_param = f"{b['tokens'][-1] / runs[0]['params']:.1f}-{b['tokens'][0] / runs[0]['params']:.1f}"
        ci = "" if b.get("ci90") is None else f" [{b['ci90'][0]:+.4f}, {b['ci90'][1]:+.4f}]"
        verdict = f"{b['margin']:+.4f}{ci}: {b['verdict']}" if "margin" in b else "-"
        rows.append([f"{C:.3g}", per_param, *(cells.get(m, "-") for m in mus),
                     f"{b['mu_star']:.2f}{'' if b['vertex_inside'] else ' (outside)'}", verdict])
    print(markdown_table(["budget C", "tokens/param", *(f"mu_rec {m}" for m in mus), "mu_rec*", "looped vs fixed"],
                         rows), end="")
    if sigma is not None:
        print(f"\nseed spread: {sigma:.4f} nats (pooled standard deviation, {noise['degrees_of_freedom']} degrees of "
              f"freedom)")
    if paired is not None:
        print(f"paired seed spread of looped - fixed depth within a seed: {paired:.4f} nats "
              f"({noise['paired_degrees_of_freedom']} degrees of freedom); looped vs fixed: the margin fixed - best "
              f"looped with its paired 90% t-interval, a win only where the interval excludes 0")
    if laws:
        print()
        for label, law in laws.items():
            line = f"{label}* = {law['k']:.3g} C^{law['exponent']:.3f}"
            if "interval90" in law:
                low, high = law["interval90"]
                line += f", 90% interval [{low:.3f}, {high:.3f}]"
            if label in PAPER_EXPONENTS:
                paper = PAPER_EXPONENTS[label]
                inside = "interval90" in law and law["interval90"][0] <= paper <= law["interval90"][1]
                line += f" (paper: {paper:.2f}, {'inside' if inside else 'outside'})"
            if "held_out" in law:
                h = law["held_out"]
                line += (f"; fitted without C={h['C']:.3g} (exponent {h['exponent']:.3f}) it predicts "
                         f"{h['predicted']:,.4g} there against {h['observed']:,.4g}: error {h['relative_error']:.1%}")
            print(line)
    if unified:
        p = unified["params"]
        print(f"\nunified law: L = {p['E']:.3f} + {p['X']:.3g} mu^({-p['x']:.3f}) + {p['Y']:.3g} D^({-p['y']:.3f}) + "
              f"{p['Z']:.3g} exp(-{p['z']:.3f} T/mu); mean relative error {unified['in_sample_error']:.2%} in sample "
              f"({unified['points_in_sample']} points)" + ("" if unified["held_out_C"] is None else
              f", {unified['held_out_error']:.2%} on the held-out budget C={unified['held_out_C']:.3g} "
              f"({unified['points_held_out']} points; paper: 0.85-1.31%)"))
    for note in notes:
        print(f"note: {note}")


# -----------------------------------------------------------------------------
# Figures (matplotlib, Agg: no display needed)

def draw(runs, budgets, sigma, laws, unified, out_dir):
    """Draw the sweep's figures into out_dir -> their paths."""
    plt = pyplot()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    paths = []

    def save(fig, name):
        save_png(fig, out_dir / name)
        paths.append(out_dir / name)

    fig, ax = plt.subplots(figsize=(6.5, 4.3))
    for i, (C, b) in enumerate(budgets.items()):
        bars = [s if s is not None else sigma or 0 for s in b["spread"]]
        ax.errorbar(b["mu_rec"], b["loss"], yerr=bars, fmt="o", capsize=3, color=colors[i % 10],
                    label=f"C = {C:.3g}" + (f" ({max(b['seeds'])} seeds)" if max(b["seeds"]) > 1 else ""))
        for mu, seeds in zip(b["mu_rec"], b["seed_losses"]):
            if len(seeds) > 1:
                ax.plot([mu] * len(seeds), seeds, ".", color=colors[i % 10], alpha=0.4)
        grid = np.linspace(math.log(b["mu_rec"][0]), math.log(b["mu_rec"][-1]), 100)
        ax.plot(np.exp(grid), np.polyval(b["parabola"], grid), "-", color=colors[i % 10])
        ax.plot(b["mu_star"], b["L_star"], "*", color=colors[i % 10], markersize=12)
    mus = sorted({r["mu_rec"] for r in runs})
    ax.set(xscale="log", xlabel="mu_rec", ylabel="final val loss at T = mu_rec (nats)",
           title="isoFLOP curves (bars: seed standard deviation)")
    ax.set_xticks(mus, [str(m) for m in mus])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    save(fig, "isoflop.png")

    if laws:
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        C = np.array(sorted(budgets))
        for ax, (label, key) in zip(axes, (("mu_rec", "mu_star"), ("D", "D_star"), ("L", "L_star"))):
            law = laws[label]
            ax.plot(C, [budgets[c][key] for c in C], "o", color="black")
            interval = " [{:.2f}, {:.2f}]".format(*law["interval90"]) if "interval90" in law else ""
            ax.plot(C, law["k"] * C ** law["exponent"], "-", label=f"all budgets: C^{law['exponent']:.2f}{interval}")
            if "held_out" in law:
                h = law["held_out"]
                ax.plot(C, h["k"] * C ** h["exponent"], "--",
                        label=f"without the largest: C^{h['exponent']:.2f}, error {h['relative_error']:.1%}")
            ax.set(xscale="log", yscale="log", xlabel="training FLOPs C", ylabel=f"{label}*")
            ax.legend(fontsize=7)
        save(fig, "optimal.png")

    if unified:
        looped = [r for r in runs if r["mu_rec"] > 1 and r["curve"]]
        Cs, mus = sorted({r["C"] for r in looped}), sorted({r["mu_rec"] for r in looped})
        fig, axes = plt.subplots(1, len(Cs), figsize=(3.6 * len(Cs), 3.6), squeeze=False, sharey=True)
        for ax, C in zip(axes[0], Cs):
            for r in (r for r in looped if r["C"] == C):
                color, T = colors[mus.index(r["mu_rec"]) % 10], np.array(r["curve"]["T"], float)
                ax.plot(T, r["curve"]["loss"], "o", color=color, markersize=3,
                        label=None if r["seed"] else f"mu_rec {r['mu_rec']}")
                grid = np.linspace(T.min(), T.max(), 100)
                ax.plot(grid, unified_predict(unified["params"], r["mu_rec"], r["trained_tokens"], grid), "-",
                        color=color, linewidth=1)
            held = " (held out)" if C == unified["held_out_C"] else ""
            ax.set(xlabel="test-time recurrence T", title=f"C = {C:.3g}{held}")
            ax.legend(fontsize=7)
        axes[0][0].set_ylabel("val loss (nats)")
        save(fig, "test_time.png")

    judged = [C for C, b in budgets.items() if "margin" in b]
    if judged:
        fig, ax = plt.subplots(figsize=(6.5, 4.3))
        fixed = np.array([budgets[c]["fixed_depth_loss"] for c in judged])
        ax.plot(judged, fixed, "o-", label="fixed depth (mu_rec = 1)")
        if sigma:
            ax.fill_between(judged, fixed - 2 * sigma, fixed + 2 * sigma, alpha=0.2,
                            label=f"fixed depth +- 2 x seed spread ({2 * sigma:.3f})")
        ax.plot(judged, [budgets[c]["best_looped"]["loss"] for c in judged], "s-", label="best looped (mu_rec > 1)")
        for c in judged:
            ax.annotate(f"mu {budgets[c]['best_looped']['mu_rec']}: {budgets[c]['verdict']}",
                        (c, budgets[c]["best_looped"]["loss"]), fontsize=7, xytext=(4, -12), textcoords="offset points")
        ax.set(xscale="log", xlabel="training FLOPs C", ylabel="final val loss (nats)",
               title="looped frontier: a win counts only below the band")
        ax.legend(fontsize=8)
        save(fig, "frontier.png")
    return paths


# -----------------------------------------------------------------------------
# Command line

def numbers(kind):
    """An argparse type: numbers separated by commas (common.comma_list), each read by kind."""
    def parse(text):
        try:
            return comma_list(text, kind)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} must be numbers separated by commas, e.g. 1,2,4") from None
    return parse


def main(argv=None):
    parser = command_parser(__doc__)
    parser.add_argument("command", choices=["plan", "run", "fit"])
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a ready sweep: cpu = the CPU study")
    parser.add_argument("--depth", type=int, help="model size (train.py --depth; default 6, the 140M)")
    parser.add_argument("--flops", type=numbers(float), help="budgets C, e.g. 1e18,3e18")
    parser.add_argument("--mu_rec", type=numbers(int), help="e.g. 1,2,4,8")
    parser.add_argument("--T", type=numbers(int), help="test-time depths of the unified fit")
    parser.add_argument("--seeds", type=int, help="seeds at the middle budget, which measure the noise (default 1)")
    parser.add_argument("--sweep", help="sweep name (default: the preset's, or d<depth>)")
    parser.add_argument("--refit", type=Path, metavar="FIT_JSON",
                        help="fit: refit the runs a fit.json recorded, e.g. figures/scaling_cpu/fit.json")
    parser.add_argument("--gpus", type=int, default=None,
                        help="processes per point (default: every GPU here for run, 8 for plan's commands)")
    args = parser.parse_args(argv)
    if args.command == "fit" and args.refit:
        recorded = read_json(args.refit)
        if recorded is None:
            raise FileNotFoundError(f"no {args.refit}: give a fit.json that `python -m experiments.scaling fit` wrote")
        fit(recorded["sweep"], recorded["runs"], args.refit.parent)
        return
    sweep = make_sweep(args)
    if args.command == "plan":
        plan(sweep, 8 if args.gpus is None else args.gpus)
    elif args.command == "run":
        gpus = torch.cuda.device_count() if args.gpus is None else args.gpus
        run(sweep, gpus if torch.cuda.is_available() else 0)
    else:
        if not any(final_eval(p) for p in points(sweep)):  # nothing to fit: one line, nothing written
            flags = [a for a in (sys.argv[1:] if argv is None else argv) if a != "fit"]
            raise ValueError(f"no finished run of sweep '{sweep['name']}' under {run_dir()}; train them first: "
                             f"python -m experiments.scaling run {' '.join(flags)}")
        fit(sweep)


if __name__ == "__main__":
    run_command(main)
