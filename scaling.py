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

from common import PEAK_BF16_FLOPS, get_base_dir
from model import Parcae, ParcaeConfig

ROOT = Path(__file__).resolve().parent
H100_BF16, MFU = PEAK_BF16_FLOPS["H100"], 0.4  # GPU-hour estimates: 40% MFU, as in README's size table

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
        sweep = dict(depth=args.depth or 6, flops=None, mu_rec=None, T=[1, 2, 3, 4, 6, 8, 12, 16, 20, 24],
                     model=dict(PAPER_MODEL), batch=PAPER_BATCH, train_args=[], eval_args=[],
                     name=f"d{args.depth or 6}")
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
# Run: one point after another (finished ones skipped, a killed one resumed by train.py --resume), then the
# looped runs' losses at every T

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
        else:
            print(f"{where}: done, skipped", flush=True)
    for p in rows:  # then the losses at every T, which only the unified law needs
        if p["mu_rec"] > 1 and final_eval(p) is not None and ensure_bpb(sweep, p) is None:
            print(f"{p['name']}: eval_core.py failed, see {run_dir(p) / 'eval.log'}", flush=True)


# -----------------------------------------------------------------------------
# The fitters: parabolas, power laws and the unified law, in numpy and torch

HUBER_DELTA = 1e-3  # on log-loss residuals, as in Chinchilla's fits (Hoffmann et al. 2022, §3.3)


def parabola_optimum(mu_rec, losses, tokens):
    """Paper §5.2, Fig. 4: final loss ~ a (ln mu)^2 + b ln mu + c in one budget; its vertex is mu_rec*, L* the loss
    there and D* the tokens there (ln D is linear in ln mu inside a budget, interpolated the same way)."""
    x, L = np.log(np.asarray(mu_rec, float)), np.asarray(losses, float)
    a, b, c = np.polyfit(x, L, 2)
    slope, intercept = np.polyfit(x, np.log(np.asarray(tokens, float)), 1)
    inside = bool(a > 0 and x.min() <= -b / (2 * a) <= x.max())
    x_star = -b / (2 * a) if a > 0 else x[np.argmin(L)]  # no minimum: the best sampled point
    return dict(mu_star=math.exp(x_star), D_star=math.exp(intercept + slope * x_star),
                L_star=float(np.polyval([a, b, c], x_star)), parabola=[a, b, c], vertex_inside=inside)


def power_law(C, y):
    """y = k C^g, least squares in log-log -> (k, g)."""
    g, log_k = np.polyfit(np.log(np.asarray(C, float)), np.log(np.asarray(y, float)), 1)
    return math.exp(log_k), g


def unified_log_terms(theta, mu, D, T):
    """Paper §5.3, App. L: L(T | mu, D) = E + X mu^-x + Y D^-y + Z exp(-z T / mu), every term positive, so
    ln L = logsumexp of four log-terms (Chinchilla's parametrisation: theta = ln E, ln X, x, ln Y, y, ln Z, z)."""
    e, lx, x, ly, y, lz, z = theta
    return torch.stack([e.expand_as(mu), lx - x * mu.log(), ly - y * D.log(), lz - z * T / mu])


def unified_predict(p, mu, D, T):
    """The unified law at (mu, D, T) for fitted parameters p (a dict)."""
    mu, D, T = (np.asarray(v, float) for v in (mu, D, T))
    return p["E"] + p["X"] * mu ** -p["x"] + p["Y"] * D ** -p["y"] + p["Z"] * np.exp(-p["z"] * T / mu)


def fit_unified(mu, D, T, losses, max_iter=100):
    """Huber loss (delta 1e-3) on ln L residuals, minimised by L-BFGS from a grid of starts; the best is kept."""
    mu, D, T, L = (torch.tensor(np.asarray(v, float), dtype=torch.float64) for v in (mu, D, T, losses))
    log_L, L_min, lnD = L.log(), float(L.min()), float(D.log().mean())
    best = (math.inf, None)
    for x0 in (0.2, 0.6, 1.2):
        for y0 in (0.1, 0.3, 0.6):
            for z0 in (0.5, 2.0):
                start = [math.log(0.8 * L_min), math.log(0.1 * L_min), x0, math.log(0.1 * L_min) + y0 * lnD, y0,
                         math.log(0.1 * L_min), z0]
                theta = torch.tensor(start, dtype=torch.float64, requires_grad=True)
                opt = torch.optim.LBFGS([theta], lr=1, max_iter=max_iter, line_search_fn="strong_wolfe")

                def objective():
                    opt.zero_grad()
                    residual = torch.logsumexp(unified_log_terms(theta, mu, D, T), 0) - log_L
                    # Huber(r, delta) / delta^2: the same minimiser, at a scale L-BFGS's stopping tolerances suit
                    loss = torch.nn.functional.huber_loss(residual / HUBER_DELTA, torch.zeros_like(residual),
                                                          delta=1.0, reduction="sum")
                    loss.backward()
                    return loss

                opt.step(objective)
                value = objective().item()  # step() returns the loss at the start, not at the end
                if math.isfinite(value) and value < best[0]:
                    best = (value, theta.detach().clone())
    e, lx, x, ly, y, lz, z = best[1].tolist()
    return dict(E=math.exp(e), X=math.exp(lx), x=x, Y=math.exp(ly), y=y, Z=math.exp(lz), z=z, huber=best[0])


def mean_relative_error(predicted, observed):
    predicted, observed = np.asarray(predicted, float), np.asarray(observed, float)
    return float(np.mean(np.abs(predicted - observed) / observed))


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
                         f"{run_dir(p) / 'metrics.jsonl'}); `python scaling.py run` trains or resumes it")
            continue
        loss = record[f"val_loss_T{p['mu_rec']}"]
        if not math.isfinite(loss):
            notes.append(f"run {p['name']} diverged (val loss {loss} at T={p['mu_rec']}); left out of the fits")
            continue
        bpb = ensure_bpb(sweep, p) if p["mu_rec"] > 1 else None  # fixed-depth runs are not in the unified law
        if bpb is None and p["mu_rec"] > 1:
            notes.append(f"run {p['name']} has no loss at T={sweep['T']} ({run_dir(p) / 'eval.log'}); "
                         f"left out of the unified law")
        done.append(dict(p, loss=loss, curve=None if bpb is None else dict(T=bpb["T"], loss=bpb["loss"])))
    return done


def fit_budgets(runs, notes):
    budgets = {}
    for C in sorted({r["C"] for r in runs}):
        inside = [r for r in runs if r["C"] == C]
        if len({r["mu_rec"] for r in inside}) < 3:
            notes.append(f"budget C={C:.3g} has {len(inside)} finished runs; its parabola needs 3 values of mu_rec")
            continue
        opt = parabola_optimum([r["mu_rec"] for r in inside], [r["loss"] for r in inside],
                               [r["trained_tokens"] for r in inside])
        fixed = [r["loss"] for r in inside if r["mu_rec"] == 1]
        looped = min((r for r in inside if r["mu_rec"] > 1), key=lambda r: r["loss"], default=None)
        opt["fixed_depth_loss"] = fixed[0] if fixed else None
        opt["best_looped"] = None if looped is None else dict(mu_rec=looped["mu_rec"], loss=looped["loss"])
        budgets[C] = opt
    return budgets


def fit_power_laws(budgets, notes):
    """g_mu and g_D on every budget; then, on all but the largest, the error predicting the largest (paper §5.2)."""
    C = sorted(budgets)
    if len(C) < 2:
        notes.append(f"{len(C)} budget(s) with a parabola; the power laws need 2 (the extrapolation test 3)")
        return None
    out = {}
    for key, label in (("mu_star", "mu_rec"), ("D_star", "D")):
        k, g = power_law(C, [budgets[c][key] for c in C])
        out[label] = dict(k=k, exponent=g)
        if len(C) >= 3:
            k, g = power_law(C[:-1], [budgets[c][key] for c in C[:-1]])
            predicted, observed = k * C[-1] ** g, budgets[C[-1]][key]
            out[label]["held_out"] = dict(C=C[-1], k=k, exponent=g, predicted=predicted, observed=observed,
                                          relative_error=abs(predicted - observed) / observed)
    return out


def fit_unified_law(runs, notes):
    """Fitted on the looped runs (the law's exp(-z T / mu) describes depth-sampled training) of every budget but the
    largest, at every T; the largest budget's runs are the held-out models. With one budget there is nothing to
    hold out, and D moves with mu_rec alone, so the fit describes the curves but does not separate x from y."""
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


def fit(sweep):
    notes = []
    runs = collect(sweep, notes)
    budgets = fit_budgets(runs, notes)
    laws = fit_power_laws(budgets, notes)
    unified = fit_unified_law(runs, notes)
    out_dir = get_base_dir() / "scaling" / sweep["name"]
    out_dir.mkdir(parents=True, exist_ok=True)
    result = dict(sweep=sweep, runs=runs, budgets={f"{C:.3g}": b for C, b in budgets.items()}, power_laws=laws,
                  unified=unified, notes=notes)
    write_text(out_dir / "fit.json", json.dumps(result, indent=1))
    print_report(runs, budgets, laws, unified, notes)
    figures = draw(runs, budgets, laws, unified, out_dir)
    print(f"\nwrote {out_dir / 'fit.json'} and {', '.join(str(f) for f in figures)}")
    return result


def print_report(runs, budgets, laws, unified, notes):
    print("| budget C (FLOPs) | mu_rec | tokens | final val loss at T = mu_rec |")
    print("|---|---|---|---|")
    for r in runs:
        print(f"| {r['C']:.3g} | {r['mu_rec']} | {r['trained_tokens']:,} | {r['loss']:.4f} |")
    if budgets:
        print("\n| budget C | mu_rec* | D* | L* | vertex inside sampled mu_rec | loss at mu_rec = 1 | best looped |")
        print("|---|---|---|---|---|---|---|")
    for C, b in budgets.items():
        looped = b["best_looped"]
        fixed = "-" if b["fixed_depth_loss"] is None else f"{b['fixed_depth_loss']:.4f}"
        best = "-" if looped is None else f"{looped['loss']:.4f} (mu_rec {looped['mu_rec']})"
        print(f"| {C:.3g} | {b['mu_star']:.2f} | {b['D_star']:,.0f} | {b['L_star']:.4f} | "
              f"{'yes' if b['vertex_inside'] else 'no'} | {fixed} | {best} |")
    if laws:
        print()
        for label, law in laws.items():
            line = f"{label}* = {law['k']:.3g} C^{law['exponent']:.3f} (paper: {0.40 if label == 'mu_rec' else 0.78})"
            if "held_out" in law:
                h = law["held_out"]
                line += (f"; fitted without C={h['C']:.3g} (exponent {h['exponent']:.3f}) it predicts "
                         f"{h['predicted']:,.3g} there against {h['observed']:,.3g}: error {h['relative_error']:.1%}")
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

def draw(runs, budgets, laws, unified, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    paths = []

    def save(fig, name):
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path.with_name(name + ".tmp.png"), dpi=110)
        os.replace(path.with_name(name + ".tmp.png"), path)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, C in enumerate(sorted({r["C"] for r in runs})):
        inside = sorted((r for r in runs if r["C"] == C), key=lambda r: r["mu_rec"])
        ax.plot([r["mu_rec"] for r in inside], [r["loss"] for r in inside], "o", color=colors[i % 10],
                label=f"C = {C:.3g}")
        if C in budgets:
            grid = np.linspace(math.log(inside[0]["mu_rec"]), math.log(inside[-1]["mu_rec"]), 100)
            ax.plot(np.exp(grid), np.polyval(budgets[C]["parabola"], grid), "-", color=colors[i % 10])
            ax.plot(budgets[C]["mu_star"], budgets[C]["L_star"], "*", color=colors[i % 10], markersize=12)
    mus = sorted({r["mu_rec"] for r in runs})
    ax.set(xscale="log", xlabel="mu_rec", ylabel="final val loss at T = mu_rec (nats)", title="isoFLOP curves")
    ax.set_xticks(mus, [str(m) for m in mus])
    ax.minorticks_off()
    ax.legend()
    save(fig, "isoflop.png")

    if laws:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
        C = np.array(sorted(budgets))
        for ax, (label, key) in zip(axes, (("mu_rec", "mu_star"), ("D", "D_star"))):
            ax.plot(C, [budgets[c][key] for c in C], "o", color="black")
            ax.plot(C, laws[label]["k"] * C ** laws[label]["exponent"], "-",
                    label=f"all budgets: C^{laws[label]['exponent']:.2f}")
            if "held_out" in laws[label]:
                h = laws[label]["held_out"]
                ax.plot(C, h["k"] * C ** h["exponent"], "--", label=f"without the largest: C^{h['exponent']:.2f}")
            ax.set(xscale="log", yscale="log", xlabel="training FLOPs C", ylabel=f"{label}*")
            ax.legend(fontsize=8)
        save(fig, "optimal.png")

    if unified:
        looped = [r for r in runs if r["mu_rec"] > 1 and r["curve"]]
        fig, axes = plt.subplots(1, len({r["C"] for r in looped}), figsize=(4 * len({r["C"] for r in looped}), 3.6),
                                 squeeze=False)
        for ax, C in zip(axes[0], sorted({r["C"] for r in looped})):
            for i, r in enumerate(r for r in looped if r["C"] == C):
                T = np.array(r["curve"]["T"], float)
                ax.plot(T, r["curve"]["loss"], "o", color=colors[i % 10], markersize=4, label=f"mu_rec {r['mu_rec']}")
                grid = np.linspace(T.min(), T.max(), 100)
                ax.plot(grid, unified_predict(unified["params"], r["mu_rec"], r["trained_tokens"], grid), "-",
                        color=colors[i % 10])
            held = " (held out)" if C == unified["held_out_C"] else ""
            ax.set(xlabel="test-time recurrence T", ylabel="val loss (nats)", title=f"C = {C:.3g}{held}")
            ax.legend(fontsize=8)
        save(fig, "test_time.png")

    if budgets:
        fig, ax = plt.subplots(figsize=(6, 4))
        C = sorted(c for c in budgets if budgets[c]["fixed_depth_loss"] is not None and budgets[c]["best_looped"])
        ax.plot(C, [budgets[c]["fixed_depth_loss"] for c in C], "o-", label="fixed depth (mu_rec = 1)")
        ax.plot(C, [budgets[c]["best_looped"]["loss"] for c in C], "s-", label="best looped (mu_rec > 1)")
        ax.set(xscale="log", xlabel="training FLOPs C", ylabel="final val loss (nats)", title="looped frontier")
        ax.legend()
        save(fig, "frontier.png")
    return paths


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
    parser.add_argument("--depth", type=int, help="model size (train.py --depth; default 6, the 140M)")
    parser.add_argument("--flops", type=lambda s: parse_list(s, float, "--flops"), help="budgets C, e.g. 1e18,3e18")
    parser.add_argument("--mu_rec", type=lambda s: parse_list(s, int, "--mu_rec"), help="e.g. 1,2,4,8")
    parser.add_argument("--T", type=lambda s: parse_list(s, int, "--T"), help="test-time depths of the unified fit")
    parser.add_argument("--sweep", help="sweep name (default: the preset's, or d<depth>)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="processes per point (default: every GPU here for run, 8 for plan's commands)")
    args = parser.parse_args(argv)
    sweep = make_sweep(args)
    if args.command == "plan":
        plan(sweep, 8 if args.gpus is None else args.gpus)
    elif args.command == "run":
        gpus = torch.cuda.device_count() if args.gpus is None else args.gpus
        run(sweep, gpus if torch.cuda.is_available() else 0)
    else:
        if not any(final_eval(p) for p in points(sweep)):  # nothing to fit: one line, nothing written
            flags = [a for a in (sys.argv[1:] if argv is None else argv) if a != "fit"]
            fail(f"no finished run of sweep '{sweep['name']}' under {get_base_dir() / 'runs'}; train them first: "
                 f"python scaling.py run {' '.join(flags)}")
        fit(sweep)


if __name__ == "__main__":
    main()
