"""
plot.py: draw what train.py logs (metrics.jsonl) against the step, for any runs, into one PNG; or the test-time
scaling law L(T) that `eval_core.py --eval bpb` fitted, beside its JSON.

    python -m experiments.plot d3_diagonal d3_concat           # every metric, to plot.png
    python -m experiments.plot d3_concat ~/runs/lr3e-2 --metrics loss,h_norm,rho -o stability.png
    python -m experiments.plot d3_diagonal d3_concat --table   # and print each run's summary row
    python -m experiments.plot --test_time                     # L(T) of the newest eval_core.py --eval bpb
    python -m experiments.plot --test_time d3_diagonal         # ... of that run (or a path to the JSON)

A RUN is a folder holding metrics.jsonl (a path), else a run name under $NANOPARCAE_BASE_DIR/runs, where
train.py --run=NAME writes. One panel per metric; a metric whose values span more than two decades (an
exploding ||h_T||) gets a log axis. A run that train.py declared diverged gets an x and a dotted line at the
step where its streak of bad steps began. A run that stopped early, even mid-line, draws as far as it got.
"""

import math
from pathlib import Path

from nanoparcae.checkpoint import run_dir as named_run
from nanoparcae.command import comma_list, command_parser, run_command
from nanoparcae.files import check_writable, read_json, write_atomically
from nanoparcae.metrics import read_metrics

# -----------------------------------------------------------------------------
# The metrics: the key in metrics.jsonl and the axis label. "loss" draws the training loss as a line and
# the validation loss at the run's largest eval depth T as dots; "lr" draws AdamW's rate solid, Muon's dashed.

METRICS = {
    "loss": "loss (line: train,\ndots: val at largest T)",
    "rho": "rho(Abar)",
    "h_norm": "||h_T||",
    "update_ratio": "dh/h = ||h_T - h_{T-1}|| / ||h_T||",
    "lr": "learning rate (solid: AdamW, dashed: Muon)",
    "grad_norm": "gradient norm (before clipping)",
}
LOG_SPAN = 100  # a panel whose positive values span more than this factor gets a log axis


# -----------------------------------------------------------------------------
# Reading runs

def run_dir(run):
    """RUN -> its folder: the path itself if it holds metrics.jsonl, else base dir / runs / RUN.
    A metrics.jsonl that is no file counts, so that reading it names it."""
    if (Path(run) / "metrics.jsonl").exists():
        return Path(run)
    named = named_run(run)
    if not (named / "metrics.jsonl").exists():
        raise FileNotFoundError(f"no metrics for run {run!r}: neither {Path(run) / 'metrics.jsonl'} nor "
                                f"{named / 'metrics.jsonl'} exists; pass a run folder or a train.py --run name "
                                f"(NANOPARCAE_BASE_DIR={named.parent.parent})")
    return named


def read_test_time(run=None):
    """Find eval_core.py --eval bpb's JSON -> (its path, its results).
    RUN itself is taken when it is a .json file.
    Otherwise it is the newest in RUN's folder, a path or a run name under the base dir.
    Without RUN it is the newest of every run."""
    if run and run.endswith(".json"):
        where, found = Path(run), [Path(run)] if Path(run).is_file() else []
    else:
        where = (Path(run) if Path(run).is_dir() else named_run(run)) if run else named_run()
        found = sorted(where.glob("*_bpb_T*.json" if run else "*/*_bpb_T*.json"),
                       key=lambda p: (p.stat().st_mtime, p.name))
    if not found:
        raise FileNotFoundError(f"no results of `python eval_core.py --eval bpb` for {run or 'any run'} ({where}); "
                                f"run it first, e.g. with --T 1,2,4,8")
    results = read_json(found[-1])
    if "fit" not in results:
        raise ValueError(f"{found[-1]} holds no fit of L(T): evaluate at 3 or more depths, e.g. --T 1,2,4,8")
    return found[-1], results


def read_run(path):
    """metrics.jsonl -> {"steps": training records, "evals": eval records, "diverged_at": step or None}.
    A line cut short (a run killed while writing it) is skipped."""
    run = {"steps": [], "evals": [], "diverged_at": None}
    for record in read_metrics(Path(path) / "metrics.jsonl"):
        if "diverged_at" in record:
            run["diverged_at"] = record["diverged_at"]
        elif "loss" in record:
            run["steps"].append(record)
        elif any(key.startswith("val_loss_T") for key in record):
            run["evals"].append(record)
    return run


# -----------------------------------------------------------------------------
# Drawing

def eval_depths(evals):
    """The depths T that eval records hold a validation loss at, ascending."""
    return sorted({int(key[len("val_loss_T"):]) for record in evals for key in record if key.startswith("val_loss_T")})


def points(records, key):
    """-> (steps, values) of the records' key; non-finite and missing values are left out."""
    pairs = [(r["step"], r[key]) for r in records if r.get(key) is not None and math.isfinite(r[key])]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def series(run, metric):
    """-> [(steps, values, style)] of one run's metric."""
    if metric == "loss":
        depths = eval_depths(run["evals"])
        val = [points(run["evals"], f"val_loss_T{depths[-1]}") + ("o",)] if depths else []
        return [points(run["steps"], "loss") + ("-",)] + val
    if metric == "lr":
        return [points(run["steps"], "adamw_lr") + ("-",), points(run["steps"], "muon_lr") + ("--",)]
    return [points(run["steps"], metric) + ("-",)]


def pyplot():
    """matplotlib's pyplot on Agg, which needs no display; imported only when a figure is drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def draw(runs, metrics):
    """runs: {label: read_run(...)} -> a matplotlib figure, one panel per metric."""
    plt = pyplot()
    fig, axes = plt.subplots(len(metrics), 1, figsize=(7, 2.4 * len(metrics)), sharex=True, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, metric in zip(axes[:, 0], metrics):
        positive = []
        for i, (label, run) in enumerate(runs.items()):
            color = colors[i % len(colors)]
            for steps, values, style in series(run, metric):
                ax.plot(steps, values, style, color=color, linewidth=1, markersize=3,
                        label=label if style == "-" else None)
                positive += [v for v in values if v > 0]
                before = [v for s, v in zip(steps, values) if s <= (run["diverged_at"] or -1)]
                if before and style == "-":  # the x: the value at the step the streak began (or the last before)
                    ax.plot(run["diverged_at"], before[-1], "x", color=color, markersize=8)
            if run["diverged_at"] is not None:
                ax.axvline(run["diverged_at"], color=color, linestyle=":", linewidth=1)
        if positive and max(positive) / min(positive) > LOG_SPAN:
            ax.set_yscale("log")
        ax.set_ylabel(METRICS[metric], fontsize=8)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7, ncol=2, title="x: diverged" if any(r["diverged_at"] for r in runs.values()) else None,
                      title_fontsize=7)
    axes[-1, 0].set_xlabel("step")
    return fig


def summary_row(label, run):
    """A markdown row: the final training loss, the final validation loss at each eval depth T, max rho,
    max ||h_T||, and the step the run diverged at."""
    def largest(key):
        values = points(run["steps"], key)[1]
        return f"{max(values):.3g}" if values else "-"

    final = run["steps"][-1]["loss"] if run["steps"] else float("nan")
    last_eval = run["evals"][-1:]
    depths = eval_depths(last_eval)
    val = " / ".join(f"{last_eval[0][f'val_loss_T{T}']:.3f}" for T in depths) + \
        f" (T = {' / '.join(map(str, depths))})" if depths else "-"
    return f"| {label} | {final:.3f} | {val} | {largest('rho')} | {largest('h_norm')} | {run['diverged_at'] or '-'} |"


def draw_test_time(results, title):
    """eval_core.py --eval bpb's results -> a figure: the measured losses, the fitted L(T) = L_inf + Z exp(-z T)
    (METHOD.md §3) and the loss at T = mu_rec."""
    import numpy as np
    plt = pyplot()
    fit, Ts = results["fit"], np.array(results["T"], dtype=np.float64)
    grid = np.geomspace(Ts.min(), Ts.max(), 200)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(Ts, results["loss"], "o", color="black", label="val loss")
    ax.plot(grid, fit["L_inf"] + fit["Z"] * np.exp(-fit["z"] * grid), "-",
            label=f"L_inf + Z exp(-z T): L_inf {fit['L_inf']:.4f}, z {fit['z']:.2f}, RMS error {fit['rms']:.1e}"
            + ("\n(z at the edge of its search: L_inf is no limit)" if fit.get("at_edge") else ""))
    ax.axhline(fit["loss_at_mu_rec"], color="gray", linestyle="--", label=f"loss at T = mu_rec = {fit['mu_rec']}")
    ax.set(xscale="log", xlabel="test-time recurrence T", ylabel="val loss (nats)", title=title)
    ax.set_xticks(Ts, [str(int(T)) for T in Ts])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    return fig


def save_png(fig, path):
    """Lay fig out and write it as a PNG at path, atomically, then close it."""
    fig.tight_layout()
    write_atomically(path, lambda partial: fig.savefig(partial, dpi=110, format="png"))
    pyplot().close(fig)


# -----------------------------------------------------------------------------
# The evidence suite's figures (evidence.py report prepares the data: figure_data)

def draw_evidence(out, data):
    """out/{lr_sweep, depth, sampling, transformer, test_time, drift}.png from evidence.figure_data's dict."""
    import numpy as np
    plt = pyplot()

    def save(fig, axes, name, xscale="log", **labels):
        for ax in np.ravel(axes):
            ax.set(xscale=xscale, **labels)
        np.ravel(axes)[0].legend(fontsize=8)
        save_png(fig, out / f"{name}.png")

    def seed_lines(ax, groups, x, y):
        """One line per run of each group {label: [run]}, one colour per group."""
        for i, (label, runs) in enumerate(groups.items()):
            for r in runs:
                ax.plot(x(r), y(r), "o-", color=f"C{i}", alpha=0.6, label=label if r is runs[0] else None)

    rates = data["rates"]
    labels = list(dict.fromkeys(label for sweep in data["sweep"].values() for label in sweep))  # one colour each
    fig, axes = plt.subplots(len(data["sweep"]), 3, figsize=(15, 4 * len(data["sweep"])), squeeze=False)
    for row_axes, (optimizer, sweep) in zip(axes, data["sweep"].items()):  # claims 1 and 5: one row per optimiser
        for label, row in sweep.items():
            i = labels.index(label)
            row_axes[0].plot(rates, row["loss"], "o-", color=f"C{i}", label=label)
            row_axes[0].plot([r for r, bad in zip(rates, row["diverged"]) if bad],
                             [data["uniform"]] * sum(row["diverged"]), "x", color=f"C{i}", markersize=12, mew=2)
            for ax, key in zip(row_axes[1:], ("max_h_norm", "max_rho")):
                if row[key][0] is not None:
                    ax.plot(rates, row[key], "o-", color=f"C{i}", label=label)
        for ax, title in zip(row_axes, (f"final val loss (x: diverged, at {data['uniform']:.2f})",
                                        "max ||h_T|| in training (dotted: bf16's limit)", "max rho(Abar) in training")):
            ax.set_title(f"{optimizer}: {title}", fontsize=10)
        row_axes[1].axhline(data["bf16_limit"], color="grey", ls=":")  # a warning in float32, not a divergence
        row_axes[1].set_yscale("log")
        row_axes[0].legend(fontsize=8)
    save(fig, axes, "lr_sweep", xlabel="learning rate, whole model (AdamW = Muon)")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))  # claim 2: the state and the loss against test-time depth
    seed_lines(axes[0], data["depth"], lambda c: c["T"], lambda c: c["h_norm"])
    seed_lines(axes[1], data["depth"], lambda c: c["T"], lambda c: c["loss"])
    axes[0].set(yscale="log", title="||h_T|| (one line per seed)")
    axes[1].set_title(f"val loss, trained at mu_rec 8, lr {data['shared_rate']:g}")
    save(fig, axes, "depth", xlabel="test-time recurrence T")

    fig, axes = plt.subplots(1, len(data["sampling"]), figsize=(11, 4), squeeze=False)  # claim 4, per optimiser
    for ax, (optimizer, groups) in zip(axes[0], data["sampling"].items()):
        seed_lines(ax, groups, lambda c: c["T"], lambda c: c["loss"])
        ax.set_title(f"depth sampling under {optimizer} (one line per seed)", fontsize=10)
    save(fig, axes, "sampling", xlabel="test-time recurrence T", ylabel="val loss")

    fig, axes = plt.subplots(1, len(data["transformer"]), figsize=(11, 4), sharey=True, squeeze=False)  # claim 6
    for ax, (rate, groups) in zip(axes[0], data["transformer"].items()):
        seed_lines(ax, groups, lambda r: r["x"], lambda r: r["y"])
        ax.set(title=f"same parameters, lr {rate:g}", yscale="log")
    save(fig, axes, "transformer", xlabel="tokens per parameter", ylabel="val loss")

    fig, ax = plt.subplots(figsize=(6, 4))  # claim 7: the points, the fit, and where the gains stop (dotted)
    T = np.linspace(1, data["max_T"], 200)
    for i, (mu, curves) in enumerate(data["test_time"].items()):
        for c in curves:
            ax.plot(c["T"], c["loss"], "o", color=f"C{i}", label=f"mu_rec {mu}" if c is curves[0] else None)
            L_inf, Z, z = c["fit"]
            ax.plot(T, L_inf + Z * np.exp(-z * T), "-", color=f"C{i}", alpha=0.6)
            ax.axvline(c["stop"], color=f"C{i}", ls=":", alpha=0.6)
    save(fig, ax, "test_time", xlabel="test-time recurrence T", ylabel="val loss",
         title="L(T) and its fit L_inf + Z exp(-zT) (dotted: gains stop)")

    fig, axes = plt.subplots(1, len(data["drift"]), figsize=(2.2 * len(data["drift"]), 3.2), squeeze=False)
    for ax, d in zip(axes[0], data["drift"]):  # the drift rule: blue long enough, red not
        ax.plot(d["x"], d["y"], "o-", color="C0" if d["ok"] else "C3", label="A - B, seed mean")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_title(d["label"], fontsize=9)
    save(fig, axes, "drift", xscale="linear", xlabel="fraction of training")


def main(argv=None):
    parser = command_parser(__doc__)
    parser.add_argument("runs", nargs="*", metavar="RUN", help="a run folder, or a run name under the base dir")
    parser.add_argument("--metrics", default=",".join(METRICS), help=f"comma-separated, of: {', '.join(METRICS)}")
    parser.add_argument("--test_time", nargs="?", const="", metavar="RUN",
                        help="draw L(T) from eval_core.py --eval bpb's JSON instead: a .json file, a run (its newest) "
                             "or, with no RUN, the newest of every run; the PNG goes beside it unless -o")
    parser.add_argument("-o", "--out", help="the PNG to write (default plot.png)")
    parser.add_argument("--title", help="a title above the panels")
    parser.add_argument("--table", action="store_true", help="also print a markdown row per run")
    args = parser.parse_args(argv)
    if args.test_time is not None:
        if args.runs:
            raise ValueError(f"--test_time draws one evaluation; pass its run as --test_time={args.runs[0]}")
        path, results = read_test_time(args.test_time)
        out = Path(args.out or path.with_suffix(".png"))
        check_writable(out.parent, out.name)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig = draw_test_time(results, args.title or f"L(T) of {Path(results['ckpt']).parent.name}/"
                                                    f"{Path(results['ckpt']).name} on {results['data']}")
        save_png(fig, out)
        print(f"wrote {out}: L(T) of {path}")
        return
    if not args.runs:
        raise ValueError("name a RUN to plot, or pass --test_time")
    metrics = comma_list(args.metrics, str)
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric(s) {', '.join(unknown)}; choose from {', '.join(METRICS)}")
    out = Path(args.out or "plot.png")
    check_writable(out.parent, out.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = {}
    for run in args.runs:
        path = run_dir(run)
        runs[path.name if path.name not in runs else str(path)] = read_run(path)
    fig = draw(runs, metrics)
    if args.title:
        fig.suptitle(args.title, fontsize=9)
    save_png(fig, out)
    print(f"wrote {out}: {', '.join(runs)}")
    if args.table:
        print("| run | final train loss | final val loss | max rho | max h_T norm | diverged at step |")
        print("|---|---|---|---|---|---|")
        for label, run in runs.items():
            print(summary_row(label, run))


if __name__ == "__main__":
    run_command(main)
