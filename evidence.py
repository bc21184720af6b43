"""
evidence.py: the paper's claims about Parcae as paired experiments on a laptop CPU, each with a 90% interval and
a verdict. runs/evidence_cpu.sh runs it end to end (about an hour on a quiet 2-core machine).

    python evidence.py plan                  # the runs, their cost, and what each claim can detect
    python evidence.py run --jobs=2          # train (and evaluate) every run, two at a time, with an ETA
    python evidence.py report                # judge the claims: figures/evidence_cpu/{*.png, verdicts.json, .md}

The setup, the claims, the paired design (the two arms of a pair share the seed: data order, depth draws, h0,
initial weights), the verdict rules and the results: docs/evidence.md.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import matplotlib
import numpy as np

from common import find_checkpoint, get_base_dir, load_checkpoint, write_atomically
from data import get_tokenizer, val_batches
from eval_core import evaluate_bpb, fit_test_time_scaling
from plot import read_run
from scaling_fit import interval_verdict, mean_relative_error, paired_interval, t_quantile

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "figures" / "evidence_cpu"
TABLE = ROOT / "figures/evidence_cpu/verdicts.md"  # README's evidence table
DETAILS = ROOT / "figures/evidence_cpu/details.md"  # the numbers behind it, linked from docs/evidence.md

# -----------------------------------------------------------------------------
# The setup and the experiments

VOCAB, STEPS, BATCH = 259, 300, 2048
UNIFORM_LOSS = math.log(VOCAB)  # a diverged run counts as a uniform guess
MAIN = ["--depth=3", "--d_model=128", "--head_dim=64", f"--vocab_size={VOCAB}", "--seq_len=128",
        "--device_batch_size=16", f"--total_batch_size={BATCH}", "--data=stdlib", "--compile=0", "--dtype=float32",
        "--core_every=-1", "--log_every=1", "--save_every=1000000", "--eval_tokens=8192"]
# claim 6 needs >= 10 tokens per parameter: a narrower model (217,856 parameters) for 1,064 steps (10.0 per param)
SMALL = [flag for flag in MAIN if not flag.startswith(("--d_model", "--head_dim"))] + ["--d_model=64", "--head_dim=32"]
SMALL_STEPS, SMALL_PARAMS = 1064, 217_856
RATES = [2e-3, 8e-3, 3.2e-2, 1.28e-1]  # the sweep: 64x, the recipe's 8e-3 among them
SHARED_RATE = 8e-3  # claims 2-4, 6, 7: the recipe's rate, fixed before running
TOP_RATE = RATES[-1]  # claim 1's paired seeds
SMALL_RATES = [8e-3, 3.2e-2]  # claim 6 at two rates: does the order depend on the rate?
CURVE_T = [1, 2, 3, 4, 6, 8, 12, 16, 32]  # test-time depths of the final evaluation (claims 2, 4, 7)
INJECTIONS = ["concat", "add", "diagonal"]  # concat = the RDM baseline (Geiping et al.), diagonal = Parcae


def make_run(injection="diagonal", rate=SHARED_RATE, seed=0, mu_rec=8, sampling="per_sequence", prelude_norm=1,
             small=False):
    """One train.py run: its name, flags and cost (training FLOPs, for the ETA)."""
    name = f"ev_{'small_' if small else ''}{injection}{'' if prelude_norm else '_nonorm'}" \
           f"{'' if sampling == 'per_sequence' else '_' + sampling}_mu{mu_rec}_lr{rate:g}_s{seed}"
    steps = SMALL_STEPS if small else STEPS
    flags = (SMALL if small else MAIN) + [
        f"--injection={injection}", f"--mu_rec={mu_rec}", f"--sampling={sampling}", f"--prelude_norm={prelude_norm}",
        f"--adamw_lr={rate:g}", f"--muon_lr={rate:g}", f"--seed={seed}", f"--max_tokens={steps * BATCH}",
        f"--eval_every={steps // 10 if small else steps // 5}", f"--run={name}"]
    executed = 1 if injection == "none" else mu_rec * (1.5 if sampling == "per_batch" else 1)  # loop steps
    cost = steps * BATCH * (64 if small else 128) ** 2 * (2 + executed)  # proportional to FLOPs
    with_curve = not small and injection != "none" and prelude_norm and rate == SHARED_RATE  # claims 2, 4 and 7
    return dict(name=name, flags=flags, cost=cost, injection=injection, rate=rate, seed=seed, mu_rec=mu_rec,
                sampling=sampling, prelude_norm=prelude_norm, small=small, steps=steps, with_curve=with_curve)


def sweep_runs():
    """Claim 1 (and 5's choice of rate): every model at every rate, seed 0."""
    runs = [make_run(injection, rate) for rate in RATES for injection in INJECTIONS + ["none"]]
    return runs + [make_run("diagonal", rate, prelude_norm=0) for rate in RATES]


def norm_rate(results):
    """Claim 5's rate: the highest of the sweep at which Parcae both with and without the prelude norm trained
    (seed 0); None until both sweeps have finished."""
    pairs = {rate: [results.get(make_run("diagonal", rate, prelude_norm=p)["name"]) for p in (1, 0)] for rate in RATES}
    if any(None in pair for pair in pairs.values()):
        return None
    return max((rate for rate, pair in pairs.items() if not any(r["diverged"] for r in pair)), default=RATES[0])


def claim_arms(results):
    """Each claim's two arms, as run builders of a seed: {claim: (arm A, arm B)}; A - B is the measured difference.
    Claim 5 appears once the sweep has chosen its rate."""
    arms = {
        "1": (lambda s: make_run("concat", TOP_RATE, s), lambda s: make_run("diagonal", TOP_RATE, s)),
        "2": (lambda s: make_run("add", SHARED_RATE, s), lambda s: make_run("diagonal", SHARED_RATE, s)),
        "3b": (lambda s: make_run("concat", SHARED_RATE, s), lambda s: make_run("diagonal", SHARED_RATE, s)),
        "4": (lambda s: make_run(sampling="per_batch", seed=s), lambda s: make_run(seed=s)),
        "6": (lambda s: make_run("diagonal", SHARED_RATE, s, small=True),
              lambda s: make_run("none", SHARED_RATE, s, small=True)),
        "7": (lambda s: make_run(mu_rec=8, seed=s), lambda s: make_run(mu_rec=2, seed=s)),
    }
    arms["3a"] = arms["2"]  # the same pairs: claim 2 reads their states, 3a their losses
    rate = norm_rate(results)
    if rate is not None:
        arms["5"] = (lambda s: make_run("diagonal", rate, s, prelude_norm=0), lambda s: make_run("diagonal", rate, s))
    return arms


def planned_runs(results, seeds, max_seeds):
    """Every run the suite needs now: the sweep, each claim's arms at `seeds` seeds (more where seeds_wanted asks
    for them), the rest of claim 2's injections, claim 6's second rate, claim 7's mu_rec 4."""
    runs = sweep_runs()
    for claim, arms in claim_arms(results).items():
        for seed in range(seeds_wanted(claim, results, seeds, max_seeds)):
            runs += [arm(seed) for arm in arms]
    for seed in range(seeds):
        runs += [make_run("concat", SHARED_RATE, seed), make_run("add", TOP_RATE, seed), make_run(mu_rec=4, seed=seed)]
        runs += [make_run(injection, SMALL_RATES[1], seed, small=True) for injection in ("diagonal", "none")]
    return list({run["name"]: run for run in runs}.values())  # claims share runs


def seeds_wanted(claim, results, seeds, max_seeds):
    """`seeds`, plus one for each finished round whose interval held 0 while wider than the paper's effect."""
    n = seeds
    while n < max_seeds:
        ci = (judge(claim, results, n) or {}).get("ci90")
        if ci is None or not ci[0] <= 0 <= ci[1]:
            break
        if PAPER[claim]["effect"] is not None and (ci[1] - ci[0]) / 2 <= abs(PAPER[claim]["effect"]):
            break
        n += 1
    return n


# -----------------------------------------------------------------------------
# Training and the final evaluation of one run (a subprocess each, so that --jobs of them run at once)

def run_dir(name):
    return get_base_dir() / "runs" / name


def train_and_evaluate(run, log_path, threads):
    """train.py from scratch (a run cut short is restarted: it takes minutes), then `evaluate` -> ok."""
    directory = run_dir(run["name"])
    for stale in list(directory.glob("ckpt_*.pt")) + list(directory.glob("metrics.jsonl")):
        stale.unlink()
    directory.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        evaluate_cmd = ["evaluate", run["name"], str(run["mu_rec"]), str(int(run["with_curve"]))]
        for cmd in ([sys.executable, "train.py"] + run["flags"], [sys.executable, "evidence.py"] + evaluate_cmd):
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                  env=dict(os.environ, OMP_NUM_THREADS=str(threads))).returncode
            if code not in (0, 3):  # 3: train.py declared the run diverged, a result
                return False
    return (directory / "evidence.json").exists()


def evaluate(name, mu_rec, with_curve):
    """The run's record (evidence.json): its logged curves and divergence, and, if it trained and with_curve, the
    val loss and ||h_T|| at every CURVE_T (eval_core.evaluate_bpb, as train.py's evals: 8,192 tokens, one seeded h0;
    about 30 s a run on one core)."""
    directory = run_dir(name)
    logged = read_run(directory)
    evals = [e for e in logged["evals"] if f"val_loss_T{mu_rec}" in e or "val_loss_T1" in e]
    record = dict(name=name, diverged_at=logged["diverged_at"],
                  max_rho=max((s["rho"] for s in logged["steps"] if s.get("rho") is not None), default=None),
                  max_h_norm=max((s["h_norm"] for s in logged["steps"] if s.get("h_norm") is not None), default=None),
                  val=[dict(step=e["step"], loss=e.get(f"val_loss_T{mu_rec}", e.get("val_loss_T1"))) for e in evals],
                  curve=None)
    if logged["diverged_at"] is None and with_curve:
        model, _ = load_checkpoint(find_checkpoint(directory.parent, name))
        tokenizer = get_tokenizer("stdlib", VOCAB)
        batches = list(val_batches(tokenizer, "stdlib", 16, model.config.seq_len, 8192))
        rows = [evaluate_bpb(model, tokenizer, batches, T, state_norm=True) for T in CURVE_T]
        record["curve"] = dict(T=CURVE_T, loss=[r[0] for r in rows], h_norm=[r[2] for r in rows])
    write_atomically(directory / "evidence.json", lambda path: path.write_text(json.dumps(record)))


def load_results(runs):
    """{name: record} of the finished runs, each with `loss` (final val loss at T = mu_rec, a uniform guess's if
    it diverged) and `diverged`."""
    results = {}
    for run in runs:
        path = run_dir(run["name"]) / "evidence.json"
        if not path.exists():
            continue
        record = dict(run, **json.loads(path.read_text()))  # what the run recorded, beside how it was planned
        final = record["val"][-1]["loss"] if record["val"] and record["val"][-1]["step"] == run["steps"] else None
        record["diverged"] = record["diverged_at"] is not None or final is None or not final < UNIFORM_LOSS
        record["loss"] = UNIFORM_LOSS if record["diverged"] else final
        results[run["name"]] = record
    return results


def all_results(seeds, max_seeds):
    """The finished runs of everything planned, planning again until the plan stops growing (claim 5's rate and
    extra seeds depend on finished runs)."""
    results = {}
    while True:
        runs = planned_runs(results, seeds, max_seeds)
        found = load_results(runs)
        if found.keys() == results.keys():
            return runs, results
        results = found


def run(args):
    """Every planned run not yet finished, --jobs at a time: the sweep's Parcae runs first (claim 5's rate waits
    for them), then the longest first. The plan is redrawn after each run, as finished runs unlock claim 5 and extra
    seeds. A line per run with the time so far and an ETA."""
    start, done_cost, failed, count = time.time(), 0.0, set(), None
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    sweep_parcae = {r["name"] for r in sweep_runs() if r["injection"] == "diagonal"}
    (OUT / "logs").mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        running = {}
        while True:
            runs, results = all_results(args.seeds, args.max_seeds)
            count = len(results) if count is None else count
            todo = sorted((r for r in runs if r["name"] not in results and r["name"] not in failed
                           and r["name"] not in {x["name"] for x in running.values()}),
                          key=lambda r: (r["name"] not in sweep_parcae, -r["cost"]))
            while todo and len(running) < args.jobs:
                r = todo.pop(0)
                running[pool.submit(train_and_evaluate, r, OUT / "logs" / f"{r['name']}.log", threads)] = r
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                r = running.pop(future)
                ok = future.result()
                failed |= set() if ok else {r["name"]}
                done_cost += r["cost"]
                left = sum(x["cost"] for x in todo) + sum(x["cost"] for x in running.values())
                elapsed = time.time() - start
                count += 1
                status = "done" if ok else f"FAILED, see its log in {OUT / 'logs'}"
                print(f"[{count}/{len(runs)}] {r['name']}: {status}"
                      f" | elapsed {elapsed / 60:.1f} min | ETA {elapsed / done_cost * left / 60:.1f} min", flush=True)
    print(f"run: {(time.time() - start) / 60:.1f} min" + (f"; failed: {', '.join(sorted(failed))}" if failed else ""))
    return 1 if failed else 0


# -----------------------------------------------------------------------------
# The claims: what each pair measures, the paper's side and effect, and the verdict

PAPER = {  # expected sign of A - B, and the paper's effect in the same units where it gives one (None: no number)
    "1": dict(claim="learning-rate robustness: at the sweep's top rate, RDM (concat) minus Parcae, final val loss",
              paper="RDM converges only at the lowest of 2e-4..1e-3, Parcae at every rate", sign=+1, effect=None),
    "2": dict(claim="addition is marginally stable: ln(‖h_32‖ / ‖h_8‖), addition minus Parcae",
              paper="addition's rho = 1: its state grows with depth; Parcae's rho < 1", sign=+1, effect=None),
    "3a": dict(claim="loss ordering at a shared rate: addition minus Parcae, final val loss",
               paper="Parcae below addition and RDM (Table 4)", sign=+1, effect=None),
    "3b": dict(claim="loss ordering at a shared rate: RDM (concat) minus Parcae, final val loss",
               paper="the RDM baseline diverges at 140M (Table 4)", sign=+1, effect=None),
    "4": dict(claim="per-batch minus per-sequence depth sampling, val loss at T = 1",
              paper="100M: PPL 300.3 vs 70.5 at T = 1 (1.45 nats), 13.8 vs 13.6 at T = 16", sign=+1,
              effect=math.log(300.3 / 70.5)),
    "5": dict(claim="without minus with the prelude norm, final val loss, at the highest rate both train",
              paper="140M: 2.98 vs 2.95 at T = 8 (0.03 nats); the 1.3B without it spiked", sign=+1, effect=0.03),
    "6": dict(claim="Parcae minus the Transformer with the same parameters, equal tokens (10 per parameter)",
              paper="140M: val PPL 19.06 vs 21.48 (-0.12 nats)", sign=-1, effect=math.log(19.06 / 21.48)),
    "7": dict(claim="test-time scaling: the T from which L(T) is within 1e-3 nats of its lowest, mu_rec 8 minus 2",
              paper="gains saturate near T = mu_rec (so +6 here); L_inf within 0.2% of L(mu_rec)", sign=+1,
              effect=6.0),
}
LOSS_CLAIMS = {"1", "3a", "3b", "4", "5", "6"}  # the rule "the loss fell by less than the effect" applies to these


def depth_loss(record, T):
    return record["curve"]["loss"][record["curve"]["T"].index(T)] if record["curve"] else UNIFORM_LOSS


def log_growth(record):
    """ln(||h_32|| / ||h_8||) of a trained looped run."""
    h = dict(zip(record["curve"]["T"], record["curve"]["h_norm"]))
    return math.log(h[32] / h[8])


def fit_test_time(T, loss):
    """eval_core's fit of L(T) = L_inf + Z exp(-zT), with its mean relative error."""
    fit = fit_test_time_scaling(T, loss)
    predicted = fit["L_inf"] + fit["Z"] * np.exp(-fit["z"] * np.asarray(T, float))
    return dict(fit, error=mean_relative_error(predicted, loss))


def gains_stop(record, tolerance=1e-3):
    """The smallest T whose val loss is within `tolerance` nats of the lowest over every T: measured, not fitted
    (a curve that turns up after its minimum has no decay constant to read it from)."""
    T, loss = record["curve"]["T"], record["curve"]["loss"]
    return next(t for t, L in zip(T, loss) if L - min(loss) <= tolerance)


def pair_value(claim, a, b):
    """A - B for one seed, or None when the claim's quantity does not exist for that pair (a diverged run has no
    state to measure, nor a curve to fit)."""
    if claim in ("1", "3a", "3b", "5", "6"):
        return a["loss"] - b["loss"]
    if claim == "4":
        return depth_loss(a, 1) - depth_loss(b, 1)
    if a["diverged"] or b["diverged"]:
        return None
    if claim == "2":
        return log_growth(a) - log_growth(b)
    return gains_stop(a) - gains_stop(b)


def late_fall(record):
    """How much the val loss (T = mu_rec) fell over the last 20% of the steps: the eval nearest 80% minus the last."""
    val = [v for v in record["val"] if v["loss"] is not None]
    at_80 = min(val, key=lambda v: abs(v["step"] - 0.8 * record["steps"]), default=None)
    return 0.0 if record["diverged"] or len(val) < 2 else at_80["loss"] - val[-1]["loss"]


def judge(claim, results, seeds):
    """The claim over seeds 0..seeds-1 -> dict(measured, ci90, n, sd, verdict, late_fall, reason), or None while
    one of those runs is unfinished."""
    arms = claim_arms(results).get(claim)
    pairs = [[results.get(arm(seed)["name"]) for arm in arms] for seed in range(seeds)] if arms else [[None]]
    if any(r is None for pair in pairs for r in pair):
        return None
    values = [v for v in (pair_value(claim, a, b) for a, b in pairs) if v is not None]
    out = dict(paired_interval(values), late_fall=None, reason=None)
    out["verdict"] = interval_verdict(out["ci90"], PAPER[claim]["sign"])
    if len(values) < 2:
        out["reason"] = f"{len(values)} of {seeds} pairs have the quantity (diverged runs lack it)"
    if claim in LOSS_CLAIMS:
        out["late_fall"] = max(float(np.mean([late_fall(r) for r in arm])) for arm in zip(*pairs))
        if out["verdict"] != "not shown" and out["late_fall"] >= abs(out["measured"]):
            out["reason"] = f"still falling: the loss fell {out['late_fall']:.3f} over the last 20% of steps, more " \
                            f"than the effect; the interval alone would say {out['verdict']}"
            out["verdict"] = "not shown"
    return out


# -----------------------------------------------------------------------------
# Details behind each verdict: the sweep's table, claim 2's ratios, claim 6's crossing, claim 7's fits

def sweep_details(results):
    """Claim 1: per model, the highest rate that trained (seed 0) and each rate's loss, max rho and max ||h_T||."""
    models = {f"{injection}{'' if norm else '_nonorm'}": (injection, norm)
              for injection, norm in [(i, 1) for i in INJECTIONS + ["none"]] + [("diagonal", 0)]}
    table = {}
    for label, (injection, norm) in models.items():
        rows = [results[make_run(injection, rate, prelude_norm=norm)["name"]] for rate in RATES]
        table[label] = dict(rates=RATES, loss=[r["loss"] for r in rows], diverged=[r["diverged"] for r in rows],
                            max_rho=[r["max_rho"] for r in rows], max_h_norm=[r["max_h_norm"] for r in rows],
                            highest_trained=max((rate for rate, r in zip(RATES, rows) if not r["diverged"]),
                                                default=None))
    return table


def depth_details(results, seeds):
    """Claim 2: per injection at the shared rate, ||h_32|| / ||h_8|| and L(32) - L(8) (mean and 90% interval)."""
    out = {}
    for injection in INJECTIONS:
        runs = [results[make_run(injection, SHARED_RATE, s)["name"]] for s in range(seeds)]
        trained = [r for r in runs if not r["diverged"]]
        out[injection] = dict(diverged=len(runs) - len(trained),
                              h_ratio_32_8=paired_interval([math.exp(log_growth(r)) for r in trained]),
                              loss_32_minus_8=paired_interval([depth_loss(r, 32) - depth_loss(r, 8) for r in trained]))
    return out


def crossing(parcae_runs, transformer_runs):
    """The first eval step from which the seeds' mean val loss of Parcae stays below the Transformer's (None: never)."""
    steps = [v["step"] for v in parcae_runs[0]["val"]]
    mean = [[np.mean([r["val"][i]["loss"] for r in runs]) for i in range(len(steps))]
            for runs in (parcae_runs, transformer_runs)]
    return next((steps[i] for i in range(len(steps)) if all(p < t for p, t in zip(mean[0][i:], mean[1][i:]))), None)


def transformer_details(results, seeds):
    """Claim 6 at both rates: the paired difference and where Parcae's val curve crosses below."""
    out = {}
    for rate in SMALL_RATES:
        runs = {injection: [results[make_run(injection, rate, s, small=True)["name"]] for s in range(seeds)]
                for injection in ("diagonal", "none")}
        step = crossing(runs["diagonal"], runs["none"])
        differences = [a["loss"] - b["loss"] for a, b in zip(runs["diagonal"], runs["none"])]
        out[f"{rate:g}"] = dict(paired_interval(differences),
                                crosses_below_at_step=step,
                                tokens_per_param=None if step is None else step * BATCH / SMALL_PARAMS)
    return out


def test_time_details(results, seeds):
    """Claim 7 per mu_rec: the fit's error and sign of Z, where the gains stop (at two tolerances), L_inf against
    L(mu_rec)."""
    out = {}
    for mu in (2, 4, 8):
        trained = [r for r in (results[make_run(mu_rec=mu, seed=s)["name"]] for s in range(seeds))
                   if not r["diverged"]]
        fits = [(fit_test_time(r["curve"]["T"], r["curve"]["loss"]), depth_loss(r, mu)) for r in trained]
        out[str(mu)] = dict(fit_error=paired_interval([f["error"] for f, _ in fits]),
                            Z_positive=sum(f["Z"] > 0 for f, _ in fits), runs=len(fits),
                            gains_stop=paired_interval([gains_stop(r) for r in trained]),
                            gains_stop_1e4=paired_interval([gains_stop(r, 1e-4) for r in trained]),
                            L_inf_vs_L_mu=paired_interval([(f["L_inf"] - L) / L for f, L in fits]))
    return out


# -----------------------------------------------------------------------------
# Report: verdicts.json, README's table and the figures

def fmt_interval(j, digits=3):
    ci = "" if j["ci90"] is None else f" [{j['ci90'][0]:+.{digits}f}, {j['ci90'][1]:+.{digits}f}]"
    return "-" if j["measured"] is None else f"{j['measured']:+.{digits}f}{ci}, n = {j['n']}"


def markdown_table(header, rows):
    return "\n".join([f"| {' | '.join(header)} |", "|---" * len(header) + "|"]
                     + [f"| {' | '.join(map(str, row))} |" for row in rows]) + "\n"


def table_markdown(verdicts):
    return markdown_table(["#", "claim", "the paper", "this run: A - B, 90% interval", "verdict"],
                          [(v["id"], v["claim"], v["paper"], fmt_interval(v),
                            f"**{v['verdict']}" + (f" ({v['reason']})" if v["reason"] else "") + "**")
                           for v in verdicts])


def details_markdown(verdicts, details):
    """The numbers behind the verdicts, as markdown tables (docs/evidence.md links them)."""
    def cell(x, form="{:.3g}"):  # a one-sample interval (paired_interval of the values)
        return "-" if x["ci90"] is None else \
            f"{form.format(x['measured'])} [{form.format(x['ci90'][0])}, {form.format(x['ci90'][1])}]"

    out = "## Each claim's pairs\n\n" + markdown_table(
        ["claim", "seeds", "sd of the differences", "loss fall over the last 20% of steps (larger arm)"],
        [(v["id"], v["n"], "-" if v["sd"] is None else f"{v['sd']:.4f}",
          "-" if v["late_fall"] is None else f"{v['late_fall']:.4f}") for v in verdicts])
    out += "\n## Claim 1: the sweep, seed 0 (final val loss / max rho / max ||h_T||; x: diverged)\n\n" + markdown_table(
        ["model"] + [f"lr {r:g}" for r in RATES] + ["highest rate that trained"],
        [[label] + [("x " if bad else "") + f"{loss:.3f} / {rho or 0:.2f} / {h or 0:.3g}" for loss, rho, h, bad in
                    zip(row["loss"], row["max_rho"], row["max_h_norm"], row["diverged"])] + [row["highest_trained"]]
         for label, row in details["sweep"].items()])
    out += f"\n## Claim 2: ‖h_T‖ and the loss from T = 8 to 32, lr {SHARED_RATE:g} (mean [90%])\n\n" + markdown_table(
        ["injection", "diverged", "‖h_32‖ / ‖h_8‖", "L(32) - L(8)"],
        [(i, d["diverged"], cell(d["h_ratio_32_8"]), cell(d["loss_32_minus_8"], "{:+.4f}"))
         for i, d in details["depth"].items()])
    out += "\n## Claim 6: Parcae minus the Transformer at two rates\n\n" + markdown_table(
        ["lr", "final val loss difference [90%]", "Parcae below from step (tokens per parameter)"],
        [(rate, fmt_interval(d), "never" if d["crosses_below_at_step"] is None else
          f"{d['crosses_below_at_step']} ({d['tokens_per_param']:.1f})") for rate, d in details["transformer"].items()])
    out += "\n## Claim 7: L(T) = L_inf + Z exp(-zT) per run (mean [90% interval])\n\n" + markdown_table(
        ["mu_rec", "fit error (mean relative)", "runs with Z > 0 (a decaying fit)", "gains stop at T (1e-3 nats)",
         "(1e-4 nats)", "(L_inf - L(mu_rec)) / L(mu_rec)"],
        [(mu, cell(d["fit_error"], "{:.2%}"), f"{d['Z_positive']} of {d['runs']}", cell(d["gains_stop"], "{:.2f}"),
          cell(d["gains_stop_1e4"], "{:.2f}"), cell(d["L_inf_vs_L_mu"], "{:+.2%}"))
         for mu, d in details["test_time"].items()])
    return out + "\n"


def report(args):
    runs, results = all_results(args.seeds, args.max_seeds)
    missing = [r["name"] for r in runs if r["name"] not in results]
    if missing:
        print(f"error: {len(missing)} of {len(runs)} runs are unfinished ({missing[0]}, ...); run `python evidence.py "
              f"run` first", file=sys.stderr)
        return 2
    verdicts = []
    for claim, paper in PAPER.items():
        n = seeds_wanted(claim, results, args.seeds, args.max_seeds)
        verdicts.append(dict(id=claim, claim=paper["claim"], paper=paper["paper"], paper_effect=paper["effect"],
                             expected_sign=paper["sign"], seeds=n, **judge(claim, results, n)))
    seeds = args.seeds  # the details: at the base seeds
    details = dict(setup=dict(train_flags=MAIN, steps=STEPS, small_flags=SMALL, small_steps=SMALL_STEPS, rates=RATES,
                              claim5_rate=norm_rate(results)), sweep=sweep_details(results),
                   depth=depth_details(results, seeds), transformer=transformer_details(results, seeds),
                   test_time=test_time_details(results, seeds))
    OUT.mkdir(parents=True, exist_ok=True)
    write_atomically(OUT / "verdicts.json", lambda p: p.write_text(json.dumps(dict(verdicts=verdicts, details=details),
                                                                             indent=1)))
    table = table_markdown(verdicts)
    write_atomically(TABLE, lambda p: p.write_text(table))
    write_atomically(DETAILS, lambda p: p.write_text("# The laptop evidence suite: the numbers behind its verdicts\n\n"
                                                     "`python evidence.py report` writes this page.\n\n"
                                                     + details_markdown(verdicts, details)))
    draw(results, seeds, details)
    print(table)
    print(f"wrote {OUT / 'verdicts.json'}, {TABLE}, {DETAILS} and the figures in {OUT}")
    return 0


def draw(results, seeds, details):
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    def save(fig, axes, name, **labels):
        for ax in np.ravel(axes):
            ax.set(xscale="log", **labels)
        np.ravel(axes)[0].legend(fontsize=8)
        fig.tight_layout()
        write_atomically(OUT / name, lambda p: fig.savefig(p, dpi=110, format="png"))
        plt.close(fig)

    def seed_lines(ax, groups, x, y):
        """One line per seed of each group {label: run builder of a seed}, one colour per group."""
        for i, (label, arm) in enumerate(groups.items()):
            runs = [r for r in (results[arm(s)["name"]] for s in range(seeds)) if not r["diverged"]]
            for r in runs:
                ax.plot(x(r), y(r), "o-", color=f"C{i}", alpha=0.6, label=label if r is runs[0] else None)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))  # claim 1 (and 5's rate): the sweep, seed 0
    for i, (label, row) in enumerate(details["sweep"].items()):
        axes[0].plot(RATES, row["loss"], "o-", color=f"C{i}", label=label)
        axes[0].plot([r for r, bad in zip(RATES, row["diverged"]) if bad], [UNIFORM_LOSS] * sum(row["diverged"]), "x",
                     color=f"C{i}", markersize=12, mew=2)
        for ax, key in zip(axes[1:], ("max_h_norm", "max_rho")):
            if row[key][0] is not None:
                ax.plot(RATES, row[key], "o-", color=f"C{i}", label=label)
    for ax, title in zip(axes, ("final val loss (x: diverged, at ln 259)", "max ||h_T|| in training",
                                "max rho(Abar) in training")):
        ax.set_title(title)
    axes[1].set_yscale("log")
    save(fig, axes, "lr_sweep.png", xlabel="learning rate, whole model (AdamW = Muon)")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))  # claim 2: the state and the loss against test-time depth
    groups = {injection: (lambda s, i=injection: make_run(i, SHARED_RATE, s)) for injection in INJECTIONS}
    seed_lines(axes[0], groups, lambda r: r["curve"]["T"], lambda r: r["curve"]["h_norm"])
    seed_lines(axes[1], groups, lambda r: r["curve"]["T"], lambda r: r["curve"]["loss"])
    axes[0].set(yscale="log", title="||h_T|| (one line per seed)")
    axes[1].set_title(f"val loss, trained at mu_rec 8, lr {SHARED_RATE:g}")
    save(fig, axes, "depth.png", xlabel="test-time recurrence T")

    fig, ax = plt.subplots(figsize=(6, 4))  # claim 4
    seed_lines(ax, {sampling: (lambda s, m=sampling: make_run(sampling=m, seed=s))
                    for sampling in ("per_batch", "per_sequence")},
               lambda r: r["curve"]["T"], lambda r: r["curve"]["loss"])
    save(fig, ax, "sampling.png", xlabel="test-time recurrence T", ylabel="val loss",
         title="depth sampling (one line per seed)")

    fig, axes = plt.subplots(1, len(SMALL_RATES), figsize=(11, 4), sharey=True)  # claim 6
    for ax, rate in zip(axes, SMALL_RATES):
        seed_lines(ax, {label: (lambda s, i=injection: make_run(i, rate, s, small=True))
                        for label, injection in (("Parcae (T = 8)", "diagonal"), ("Transformer", "none"))},
                   lambda r: [v["step"] * BATCH / SMALL_PARAMS for v in r["val"]],
                   lambda r: [v["loss"] for v in r["val"]])
        ax.set(title=f"same parameters, lr {rate:g}", yscale="log")
    save(fig, axes, "transformer.png", xlabel="tokens per parameter", ylabel="val loss")

    fig, ax = plt.subplots(figsize=(6, 4))  # claim 7: the points, the fit, and where the gains stop (dotted)
    T = np.linspace(1, max(CURVE_T), 200)
    for i, mu in enumerate((2, 4, 8)):
        runs = [r for r in (results[make_run(mu_rec=mu, seed=s)["name"]] for s in range(seeds)) if not r["diverged"]]
        for r in runs:
            fit = fit_test_time(r["curve"]["T"], r["curve"]["loss"])
            label = f"mu_rec {mu}" if r is runs[0] else None
            ax.plot(r["curve"]["T"], r["curve"]["loss"], "o", color=f"C{i}", label=label)
            ax.plot(T, fit["L_inf"] + fit["Z"] * np.exp(-fit["z"] * T), "-", color=f"C{i}", alpha=0.6)
            ax.axvline(gains_stop(r), color=f"C{i}", ls=":", alpha=0.6)
    save(fig, ax, "test_time.png", xlabel="test-time recurrence T", ylabel="val loss",
         title="L(T) and its fit L_inf + Z exp(-zT) (dotted: gains stop)")


def write_readme_table(readme):
    """README's evidence table, between its two markers, replaced by TABLE."""
    text, table = readme.read_text(), TABLE.read_text()
    start, end = "<!-- evidence-table -->\n", "<!-- /evidence-table -->"
    if start not in text or end not in text:
        raise SystemExit(f"error: {readme} has no {start.strip()} ... {end} block to fill")
    head, rest = text.split(start, 1)
    readme.write_text(head + start + table + end + rest.split(end, 1)[1])


# -----------------------------------------------------------------------------
# Command line

def plan(args):
    runs, results = all_results(args.seeds, args.max_seeds)
    for r in sorted(runs, key=lambda r: r["name"]):
        print(f"{r['name']:48s} {r['steps']:5d} steps  {'done' if r['name'] in results else ''}")
    detectable = [f"{t_quantile(0.95, n - 1) / math.sqrt(n):.2f} x at {n}" for n in (args.seeds, args.max_seeds)]
    print(f"\n{len(runs)} runs ({len(results)} done; claim 5 and extra seeds come as results do). An interval excludes "
          f"0 when |mean difference| > t sd / sqrt(n), the pairs' sd times {' seeds, '.join(detectable)} seeds.")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["plan", "run", "report", "evaluate"])
    parser.add_argument("names", nargs="*", help="evaluate: a run name, its mu_rec and 1 for the T curve (internal)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    parser.add_argument("--seeds", type=int, default=3, help="paired seeds of each claim")
    parser.add_argument("--max_seeds", type=int, default=5, help="at most this many where an interval needs more")
    parser.add_argument("--readme", help="report: also fill this README's evidence table")
    args = parser.parse_args(argv)
    if args.seeds < 2 or args.max_seeds < args.seeds or args.jobs < 1:
        parser.error("--seeds must be >= 2 (an interval needs two pairs), --max_seeds >= --seeds, --jobs >= 1")
    if args.command == "evaluate":
        return evaluate(args.names[0], int(args.names[1]), args.names[2] == "1")
    code = {"plan": plan, "run": run, "report": report}[args.command](args)
    if args.command == "report" and code == 0 and args.readme:
        write_readme_table(Path(args.readme))
    return code


if __name__ == "__main__":
    sys.exit(main())
