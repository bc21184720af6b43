"""
evidence.py: the paper's claims about Parcae as paired experiments on a laptop CPU, each with a 90% interval and
a verdict. runs/evidence_cpu.sh runs it end to end (76 runs, about 75 minutes on a 2-core machine).

    python -m experiments.evidence plan          # the runs, their cost, and what each claim can detect
    python -m experiments.evidence run --jobs=2  # train (and evaluate) every run, two at a time, with an ETA
    python -m experiments.evidence report        # judge the claims: figures/evidence_cpu/{*.png, verdicts.json, .md}

The setup, the claims, the paired design (the two arms of a pair share the seed: data order, depth draws, h0,
initial weights), the verdict rules and the results: docs/evidence.md.
"""

import math
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from nanoparcae.checkpoint import checkpoints, load_run, run_dir
from nanoparcae.command import command_parser, run_command
from nanoparcae.files import check_writable, read_json, write_atomically, write_json
from nanoparcae.divergence import STATE_NORM_LIMIT
from data import evaluate_bpb, val_batches
from eval_core import fit_test_time_scaling
from experiments.plot import draw_evidence, read_run
from experiments.scaling import run_logged
from experiments.timing import markdown_table
from model import from_weights
from experiments.scaling_fit import (drift_check, interval_verdict, mean_relative_error, paired_interval,
                                     seeds_needed, t_quantile)

ROOT = Path(__file__).resolve().parent.parent  # the repository: train.py runs from there
OUT = ROOT / "figures" / "evidence_cpu"
TABLE = ROOT / "figures/evidence_cpu/verdicts.md"  # the evidence table of docs/evidence.md
DETAILS = ROOT / "figures/evidence_cpu/details.md"  # the numbers behind it, linked from docs/evidence.md

# -----------------------------------------------------------------------------
# The setup and the experiments

VOCAB, STEPS, BATCH = 259, 300, 2048
UNIFORM_LOSS = math.log(VOCAB)  # a diverged run, or one that ends no better, counts as a uniform guess
MAIN = ["--depth=3", "--d_model=128", "--head_dim=64", f"--vocab_size={VOCAB}", "--seq_len=128",
        "--device_batch_size=16", f"--total_batch_size={BATCH}", "--data=stdlib", "--compile=0", "--dtype=float32",
        "--log_every=1", "--rho_every=1", "--save_every=1000000", "--eval_tokens=8192"]
# claim 6 needs >= 10 tokens per parameter: a narrower model (217,856 parameters) for 1,064 steps (10.0 per param)
SMALL = [flag for flag in MAIN if not flag.startswith(("--d_model", "--head_dim"))] + ["--d_model=64", "--head_dim=32"]
SMALL_STEPS, SMALL_PARAMS = 1064, 217_856
RATES = [2e-3, 8e-3, 3.2e-2, 1.28e-1]  # the sweep: 64x, the recipe's 8e-3 among them
SHARED_RATE = 8e-3  # claims 2-4, 6, 7: the recipe's rate, fixed before running
SMALL_RATES = [8e-3, 3.2e-2]  # claim 6 at two rates: does the order depend on the rate?
CURVE_T = [1, 2, 3, 4, 6, 8, 12, 16, 32]  # test-time depths of the final evaluation (claims 2, 4, 7)
INJECTIONS = ["concat", "add", "diagonal"]  # concat = the RDM baseline (Geiping et al.), diagonal = Parcae
# muon: the recipe, Muon on the blocks' matrices and AdamW on the rest; adamw: AdamW on every parameter at one rate
# (train.py --optimizer), the setup of the paper's RDM comparison. Claims 1, 4 and 5 run under both.
OPTIMIZERS = ["muon", "adamw"]
FRACTIONS = [0.6, 0.7, 0.8, 0.9, 1.0]  # the evals of the drift rule (scaling_fit.drift_check)


def make_run(injection="diagonal", rate=SHARED_RATE, seed=0, mu_rec=8, sampling="per_sequence", prelude_norm=1,
             small=False, optimizer="muon"):
    """One train.py run: its name, flags and cost (training FLOPs, for the ETA)."""
    name = f"ev_{'small_' if small else ''}{injection}{'' if prelude_norm else '_nonorm'}" \
           f"{'' if sampling == 'per_sequence' else '_' + sampling}{'' if optimizer == 'muon' else '_' + optimizer}" \
           f"_mu{mu_rec}_lr{rate:g}_s{seed}"
    steps = SMALL_STEPS if small else STEPS
    flags = (SMALL if small else MAIN) + [
        f"--injection={injection}", f"--mu_rec={mu_rec}", f"--depth_sampling={sampling}",
        f"--prelude_norm={prelude_norm}",
        f"--optimizer={optimizer}", f"--adamw_lr={rate:g}", f"--muon_lr={rate:g}", f"--seed={seed}",
        f"--max_tokens={steps * BATCH}", f"--eval_every={steps // 10}", f"--run={name}"]
    executed = 1 if injection == "none" else mu_rec * (1.5 if sampling == "per_batch" else 1)  # loop steps
    cost = steps * BATCH * (64 if small else 128) ** 2 * (2 + executed)  # proportional to FLOPs
    with_curve = not small and injection != "none" and prelude_norm and rate == SHARED_RATE  # claims 2, 4 and 7
    return dict(name=name, flags=flags, cost=cost, injection=injection, rate=rate, seed=seed, mu_rec=mu_rec,
                sampling=sampling, prelude_norm=prelude_norm, small=small, steps=steps, with_curve=with_curve,
                optimizer=optimizer)


def sweep_models(optimizer):
    """The sweep's models (injection, prelude_norm): all under Muon; under AdamW, those of claims 1 and 5."""
    injections = INJECTIONS + ["none"] if optimizer == "muon" else ["concat", "diagonal"]
    return [(injection, 1) for injection in injections] + [("diagonal", 0)]


def sweep_runs():
    """Claims 1 and 5 choose their rates here: every sweep model at every rate, seed 0."""
    return [make_run(injection, rate, prelude_norm=norm, optimizer=optimizer) for optimizer in OPTIMIZERS
            for rate in RATES for injection, norm in sweep_models(optimizer)]


def chosen_rate(results, optimizer, norms):
    """The highest rate of the sweep (seed 0) at which Parcae trained with every prelude norm in `norms`; None
    until those runs have finished. Claim 1 runs at Parcae's (norms (1,)), claim 5 where both arms train (1, 0)."""
    rows = {rate: [results.get(make_run("diagonal", rate, prelude_norm=p, optimizer=optimizer)["name"])
                   for p in norms] for rate in RATES}
    if any(None in row for row in rows.values()):
        return None
    return max((rate for rate, row in rows.items() if not any(r["diverged"] for r in row)), default=RATES[0])


def optimizer_arms(results, optimizer):
    """Claims 1, 4 and 5 under one optimiser: {(claim, optimizer): (arm A, arm B)}, as run builders of a seed."""
    def run(*args, **kwargs):
        return make_run(*args, **kwargs, optimizer=optimizer)
    arms = {("4", optimizer): (lambda s: run(sampling="per_batch", seed=s), lambda s: run(seed=s))}
    top, both = chosen_rate(results, optimizer, (1,)), chosen_rate(results, optimizer, (1, 0))
    if top is not None:
        arms[("1", optimizer)] = (lambda s: run("concat", top, s), lambda s: run("diagonal", top, s))
    if both is not None:
        arms[("5", optimizer)] = (lambda s: run(rate=both, seed=s, prelude_norm=0), lambda s: run(rate=both, seed=s))
    return arms


def claim_arms(results):
    """Each claim's two arms per optimiser, as run builders of a seed: {(claim, optimizer): (arm A, arm B)}; A - B
    is the measured difference. Claims 1 and 5 appear once the sweep has chosen their rates."""
    arms = {
        ("2", "muon"): (lambda s: make_run("add", SHARED_RATE, s), lambda s: make_run("diagonal", SHARED_RATE, s)),
        ("3b", "muon"): (lambda s: make_run("concat", SHARED_RATE, s), lambda s: make_run("diagonal", SHARED_RATE, s)),
        ("6", "muon"): (lambda s: make_run("diagonal", SHARED_RATE, s, small=True),
                        lambda s: make_run("none", SHARED_RATE, s, small=True)),
        ("7", "muon"): (lambda s: make_run(mu_rec=8, seed=s), lambda s: make_run(mu_rec=2, seed=s)),
    }
    arms[("3a", "muon")] = arms[("2", "muon")]  # the same pairs: claim 2 reads their states, 3a their losses
    for optimizer in OPTIMIZERS:
        arms.update(optimizer_arms(results, optimizer))
    return {key: arms[key] for key in CLAIMS if key in arms}


# Each claim's seeds, fixed from a pilot before the main runs and never added after looking (so the 90% interval
# needs no correction for repeated looks): the pilot is this suite's first full run (Muon only, the init before
# modules were seeded by name), its sd of 3 paired differences and its mean difference per claim. A claim gets the
# fewest seeds (3 to 5) that resolve half the paper's effect, or half the pilot's where the paper gives no number;
# the AdamW rows, which the pilot did not run, take the Muon row's.
PILOT = {"1": (0.0628, 3.647), "2": (0.0040, 1.389), "3a": (0.0059, 0.021), "3b": (0.0014, 0.043),
         "4": (0.0024, 0.016), "5": (0.0084, -0.044), "6": (0.0101, 0.014), "7": (1.1547, 3.3)}


def seeds_for(claim, floor, cap):
    sd, pilot_mean = PILOT[claim]
    effect = PAPER[claim]["effect"]
    return seeds_needed(sd, pilot_mean if effect is None else effect, floor, cap)


def planned_runs(results, seeds, max_seeds):
    """Every run needed now: the sweep, each claim's arms at its seeds; claim 2's concat, 6's second rate, 7's mu 4."""
    runs = sweep_runs()
    for (claim, _), arms in claim_arms(results).items():
        runs += [arm(seed) for seed in range(seeds_for(claim, seeds, max_seeds)) for arm in arms]
    for seed in range(seeds):
        runs += [make_run("concat", SHARED_RATE, seed), make_run(mu_rec=4, seed=seed)]
        runs += [make_run(injection, SMALL_RATES[1], seed, small=True) for injection in ("diagonal", "none")]
    return list({run["name"]: run for run in runs}.values())  # claims share runs


# -----------------------------------------------------------------------------
# Training and the final evaluation of one run (a subprocess each, so that --jobs of them run at once)

def train_and_evaluate(run, log_path, threads):
    """train.py from scratch (a run cut short is restarted: it takes minutes), then `evaluate` -> ok."""
    directory = run_dir(run["name"])
    for stale in checkpoints(directory) + list(directory.glob("metrics.jsonl")):
        stale.unlink()
    directory.mkdir(parents=True, exist_ok=True)
    Path(log_path).write_text("")
    evaluate_cmd = ["evaluate", run["name"], str(run["mu_rec"]), str(int(run["with_curve"]))]
    for cmd in ([sys.executable, "train.py"] + run["flags"],
                [sys.executable, "-m", "experiments.evidence"] + evaluate_cmd):
        code = run_logged(cmd, log_path, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
        if code not in (0, 3):  # 3: train.py declared the run diverged, a result
            return False
    return (directory / "evidence.json").exists()


def largest(steps, key):
    """The largest value of key logged over the steps; None when it was never logged."""
    return max((step[key] for step in steps if step.get(key) is not None), default=None)


def evaluate(name, mu_rec, with_curve):
    """Write the run's record, evidence.json: its logged curves and divergence.
    If it trained and with_curve, add the val loss and ||h_T|| at every CURVE_T.
    They come from data.evaluate_bpb, as in train.py's evals: 8,192 tokens, one seeded h0.
    That takes about 30 s a run on one core."""
    directory = run_dir(name)
    logged = read_run(directory)
    evals = [e for e in logged["evals"] if f"val_loss_T{mu_rec}" in e or "val_loss_T1" in e]
    val = [dict(step=e["step"], loss=e.get(f"val_loss_T{mu_rec}", e.get("val_loss_T1")), loss_T1=e.get("val_loss_T1"))
           for e in evals]
    record = dict(name=name, diverged_at=logged["diverged_at"], max_rho=largest(logged["steps"], "rho"),
                  max_h_norm=largest(logged["steps"], "h_norm"), val=val, curve=None)
    if logged["diverged_at"] is None and with_curve:
        ckpt, tokenizer, _ = load_run(name)
        model = from_weights(ckpt["config"], ckpt["model"])
        batches = list(val_batches(tokenizer, "stdlib", 16, model.config.seq_len, 8192))
        rows = [evaluate_bpb(model, tokenizer, batches, T, state_norm=True) for T in CURVE_T]
        record["curve"] = dict(T=CURVE_T, loss=[r[0] for r in rows], h_norm=[r[2] for r in rows])
    write_json(directory / "evidence.json", record)


def load_results(runs):
    """Read the finished runs -> {name: record}, each with `loss` and `diverged`.
    The loss is the final val loss at T = mu_rec, or a uniform guess's if the run diverged.
    The suite counts a run as diverged when train.py stopped it (divergence.Divergence).
    It also counts a run that ends no better than a uniform guess, which train.py lets finish.
    Such a run never learned, or lost it between evals, so it has nothing to compare."""
    results = {}
    for run in runs:
        recorded = read_json(run_dir(run["name"]) / "evidence.json")
        if recorded is None:
            continue
        record = dict(run, **recorded)  # what the run recorded, beside how it was planned
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
    """Every planned run not yet finished, --jobs at a time: the sweep's Parcae runs first (claims 1 and 5's rates
    wait for them), then the longest first. The plan is redrawn after each run, as finished runs unlock claims 1
    and 5. A line per run with the time so far and an ETA."""
    start, done_cost, failed, count = time.time(), 0.0, set(), None
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    sweep_parcae = {r["name"] for r in sweep_runs() if r["injection"] == "diagonal"}
    check_writable(OUT / "logs", "the runs' logs")
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
                if not ok:
                    failed.add(r["name"])
                done_cost += r["cost"]
                left = sum(x["cost"] for x in todo) + sum(x["cost"] for x in running.values())
                elapsed = time.time() - start
                count += 1
                status = "done" if ok else f"FAILED, see its log in {OUT / 'logs'}"
                print(f"[{count}/{len(runs)}] {r['name']}: {status}"
                      f" | elapsed {elapsed / 60:.1f} min | ETA {elapsed / done_cost * left / 60:.1f} min", flush=True)
    failures = f"; failed: {', '.join(sorted(failed))}" if failed else ""
    print(f"run: {(time.time() - start) / 60:.1f} min{failures}")
    return 1 if failed else 0


# -----------------------------------------------------------------------------
# The claims: what each pair measures, the paper's side and effect, and the verdict

PAPER = {  # expected sign of A - B, and the paper's effect in the same units where it gives one (None: no number)
    "1": dict(claim="learning-rate robustness: RDM (concat) minus Parcae, final val loss, at Parcae's top rate",
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
CLAIMS = [("1", "muon"), ("1", "adamw"), ("2", "muon"), ("3a", "muon"), ("3b", "muon"), ("4", "muon"),
          ("4", "adamw"), ("5", "muon"), ("5", "adamw"), ("6", "muon"), ("7", "muon")]  # the table's rows, in order
LOSS_CLAIMS = {"1", "3a", "3b", "4", "5", "6"}  # val-loss differences, judged with the drift rule


def depth_loss(record, T):
    return record["curve"]["loss"][record["curve"]["T"].index(T)] if record["curve"] else UNIFORM_LOSS


def loss_at(record, fraction, T1=False):
    """Read the val loss at the eval nearest `fraction` of the run's steps.
    It is at T = 1 if T1, else at T = mu_rec, as train.py's evals give it.
    A diverged run counts as a uniform guess at every eval."""
    if record["diverged"]:
        return UNIFORM_LOSS
    nearest = min(record["val"], key=lambda v: abs(v["step"] - fraction * record["steps"]))
    return nearest["loss_T1" if T1 else "loss"]


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
    """Find the smallest T whose val loss is within `tolerance` nats of the lowest over every T.
    It is measured, not fitted, since a curve that turns up after its minimum has no decay constant."""
    T, loss = record["curve"]["T"], record["curve"]["loss"]
    return next(t for t, L in zip(T, loss) if L - min(loss) <= tolerance)


def pair_value(claim, a, b):
    """Compute A - B for one seed of claims 2 and 7 -> the difference, or None.
    None means the quantity does not exist for that pair.
    A diverged run has no state to measure, nor a curve to fit."""
    if a["diverged"] or b["diverged"]:
        return None
    return log_growth(a) - log_growth(b) if claim == "2" else gains_stop(a) - gains_stop(b)


def judge(claim, optimizer, results, seeds):
    """The claim over seeds 0..seeds-1 -> dict(measured, ci90, n, sd, verdict, reason, drift), or None while one of
    those runs is unfinished. A loss claim's verdict also needs the drift rule (scaling_fit.drift_check) on its
    paired differences at FRACTIONS of training; claim 4's are at T = 1."""
    arms = claim_arms(results).get((claim, optimizer))
    pairs = [[results.get(arm(seed)["name"]) for arm in arms] for seed in range(seeds)] if arms else [[None]]
    if any(r is None for pair in pairs for r in pair):
        return None
    if claim in LOSS_CLAIMS:
        by_fraction = [[loss_at(a, f, claim == "4") - loss_at(b, f, claim == "4") for a, b in pairs]
                       for f in FRACTIONS]
        values = by_fraction[-1]
    else:
        values = [v for v in (pair_value(claim, a, b) for a, b in pairs) if v is not None]
    out = dict(paired_interval(values), reason=None, drift=None)
    out["verdict"] = interval_verdict(out["ci90"], PAPER[claim]["sign"])
    if len(values) < 2:
        out["reason"] = f"{len(values)} of {seeds} pairs have the quantity (diverged runs lack it)"
    elif out["verdict"] == "not shown":
        out["reason"] = "the 90% interval holds 0"
    if claim in LOSS_CLAIMS:
        out["drift"] = drift_check(FRACTIONS, by_fraction)
        if out["verdict"] != "not shown" and not out["drift"]["long_enough"]:
            out["reason"] = f"{out['drift']['reason']}; the interval alone would say {out['verdict']}"
            out["verdict"] = "not shown"
    return out


# -----------------------------------------------------------------------------
# Details behind each verdict: the sweep's table, claim 2's ratios, claim 6's crossing, claim 7's fits

def sweep_details(results, optimizer):
    """Sum up claims 1 and 5 for one optimiser, per model.
    It gives the highest rate that trained (seed 0), and each rate's loss, max rho and max ||h_T||.
    It marks where ||h_T|| passed bf16's limit, a warning in these float32 runs, not a divergence."""
    table = {}
    for injection, norm in sweep_models(optimizer):
        rows = [results[make_run(injection, rate, prelude_norm=norm, optimizer=optimizer)["name"]] for rate in RATES]
        table[f"{injection}{'' if norm else '_nonorm'}"] = dict(
            rates=RATES, loss=[r["loss"] for r in rows], diverged=[r["diverged"] for r in rows],
            max_rho=[r["max_rho"] for r in rows], max_h_norm=[r["max_h_norm"] for r in rows],
            past_bf16_limit=[(r["max_h_norm"] or 0) > STATE_NORM_LIMIT for r in rows],
            highest_trained=max((rate for rate, r in zip(RATES, rows) if not r["diverged"]), default=None))
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
# Report: verdicts.json, the table and the figures

def fmt_interval(j, digits=3):
    ci = "" if j["ci90"] is None else f" [{j['ci90'][0]:+.{digits}f}, {j['ci90'][1]:+.{digits}f}]"
    return "-" if j["measured"] is None else f"{j['measured']:+.{digits}f}{ci}, n = {j['n']}"


def fmt_drift(drift):
    return "-" if drift is None else f"{fmt_interval(drift['drift'])} (within ±{drift['limit']:.3f}: " \
                                     f"{'yes' if drift['long_enough'] else 'no'})"


def table_markdown(verdicts):
    return markdown_table(["#", "optimiser", "claim", "the paper", "this run: A - B, 90% interval",
                           "drift: 100% - 80% of training", "verdict"],
                          [(v["id"], v["optimizer"], v["claim"], v["paper"], fmt_interval(v), fmt_drift(v["drift"]),
                            f"**{v['verdict']}" + (f" ({v['reason']})" if v["reason"] else "") + "**")
                           for v in verdicts])


def details_markdown(verdicts, details):
    """The numbers behind the verdicts, as markdown tables (docs/evidence.md links them)."""
    def cell(x, form="{:.3g}"):  # a one-sample interval (paired_interval of the values)
        return "-" if x["ci90"] is None else \
            f"{form.format(x['measured'])} [{form.format(x['ci90'][0])}, {form.format(x['ci90'][1])}]"

    out = "## Each claim's pairs: the mean difference at 60 / 70 / 80 / 90 / 100% of training\n\n" + markdown_table(
        ["claim", "optimiser", "seeds", "sd of the differences"] + [f"{f:.0%}" for f in FRACTIONS] + ["one sign"],
        [(v["id"], v["optimizer"], v["n"], "-" if v["sd"] is None else f"{v['sd']:.4f}")
         + (tuple(f"{m:+.4f}" for m in v["drift"]["by_fraction"].values()) + (v["drift"]["one_sign"],)
            if v["drift"] else ("-",) * (len(FRACTIONS) + 1)) for v in verdicts])
    for optimizer, sweep in details["sweep"].items():
        out += f"\n## The sweep under {optimizer}, seed 0 (final val loss / max rho / max ||h_T||; x: diverged; " \
               f"!: ||h_T|| past bf16's {STATE_NORM_LIMIT:g}, a warning in float32)\n\n" + markdown_table(
                   ["model"] + [f"lr {r:g}" for r in RATES] + ["highest rate that trained"],
                   [[label] + [f"{'x ' * bad}{loss:.3f} / {rho or 0:.2f} / {h or 0:.3g}{' !' * big}"
                               for loss, rho, h, bad, big in zip(row["loss"], row["max_rho"], row["max_h_norm"],
                                                                 row["diverged"], row["past_bf16_limit"])]
                    + [row["highest_trained"]] for label, row in sweep.items()])
    out += f"\n## Claim 2: ‖h_T‖ and the loss, T = 8 to 32, lr {SHARED_RATE:g} (mean [90%])\n\n" + markdown_table(
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
        raise ValueError(f"{len(missing)} of {len(runs)} runs are unfinished ({missing[0]}, ...); run "
                         f"`python -m experiments.evidence run` first")
    verdicts = []
    for claim, optimizer in claim_arms(results):
        paper, n = PAPER[claim], seeds_for(claim, args.seeds, args.max_seeds)
        verdicts.append(dict(id=claim, optimizer=optimizer, claim=paper["claim"], paper=paper["paper"],
                             paper_effect=paper["effect"], expected_sign=paper["sign"], seeds=n,
                             **judge(claim, optimizer, results, n)))
    seeds = args.seeds  # the details: at the base seeds
    rates = {f"claim{c}_rate_{o}": chosen_rate(results, o, norms) for c, norms in (("1", (1,)), ("5", (1, 0)))
             for o in OPTIMIZERS}
    details = dict(setup=dict(train_flags=MAIN, steps=STEPS, small_flags=SMALL, small_steps=SMALL_STEPS, rates=RATES,
                              fractions=FRACTIONS, **rates),
                   sweep={o: sweep_details(results, o) for o in OPTIMIZERS}, depth=depth_details(results, seeds),
                   transformer=transformer_details(results, seeds), test_time=test_time_details(results, seeds))
    OUT.mkdir(parents=True, exist_ok=True)
    write_json(OUT / "verdicts.json", dict(verdicts=verdicts, details=details))
    table = table_markdown(verdicts)
    write_atomically(TABLE, lambda p: p.write_text(table))
    write_atomically(DETAILS, lambda p: p.write_text("# The laptop evidence suite: the numbers behind its verdicts\n\n"
                                                     "`python -m experiments.evidence report` writes this page.\n\n"
                                                     + details_markdown(verdicts, details)))
    draw_evidence(OUT, figure_data(results, seeds, details, verdicts))
    print(table)
    print(f"wrote {OUT / 'verdicts.json'}, {TABLE}, {DETAILS} and the figures in {OUT}")
    return 0


def figure_data(results, seeds, details, verdicts):
    """What plot.draw_evidence draws: the sweep, and per figure the trained runs of each line colour (base seeds)."""
    def trained(arm):
        return [r for r in (results[arm(s)["name"]] for s in range(seeds)) if not r["diverged"]]

    def fitted(r):
        fit = fit_test_time(r["curve"]["T"], r["curve"]["loss"])
        return dict(r["curve"], fit=[fit["L_inf"], fit["Z"], fit["z"]], stop=gains_stop(r))

    return dict(rates=RATES, uniform=UNIFORM_LOSS, bf16_limit=STATE_NORM_LIMIT, shared_rate=SHARED_RATE,
                sweep=details["sweep"], max_T=max(CURVE_T),
                depth={i: [r["curve"] for r in trained(lambda s, i=i: make_run(i, seed=s))] for i in INJECTIONS},
                sampling={o: {m: [r["curve"] for r in trained(lambda s, m=m, o=o: make_run(sampling=m, seed=s,
                                                                                            optimizer=o))]
                              for m in ("per_batch", "per_sequence")} for o in OPTIMIZERS},
                transformer={rate: {label: [dict(x=[v["step"] * BATCH / SMALL_PARAMS for v in r["val"]],
                                                 y=[v["loss"] for v in r["val"]])
                                            for r in trained(lambda s, i=i, r=rate: make_run(i, r, s, small=True))]
                                    for label, i in (("Parcae (T = 8)", "diagonal"), ("Transformer", "none"))}
                             for rate in SMALL_RATES},
                test_time={mu: [fitted(r) for r in trained(lambda s, mu=mu: make_run(mu_rec=mu, seed=s))]
                           for mu in (2, 4, 8)},
                drift=[dict(label=f"{v['id']} {v['optimizer']}", x=FRACTIONS, ok=v["drift"]["long_enough"],
                            y=list(v["drift"]["by_fraction"].values())) for v in verdicts if v["drift"]])


def fill_table(page):
    """A page's evidence table, between its two markers, replaced by TABLE."""
    text, table = page.read_text(), TABLE.read_text()
    start, end = "<!-- evidence-table -->\n", "<!-- /evidence-table -->"
    if start not in text or end not in text:
        raise ValueError(f"{page} has no {start.strip()} ... {end} block to fill")
    head, rest = text.split(start, 1)
    write_atomically(page, lambda partial: partial.write_text(head + start + table + end + rest.split(end, 1)[1]))


# -----------------------------------------------------------------------------
# Command line

def plan(args):
    runs, results = all_results(args.seeds, args.max_seeds)
    for r in sorted(runs, key=lambda r: r["name"]):
        print(f"{r['name']:52s} {r['steps']:5d} steps  {'done' if r['name'] in results else ''}")
    for claim in PAPER:
        n, (sd, mean) = seeds_for(claim, args.seeds, args.max_seeds), PILOT[claim]
        print(f"claim {claim}: {n} seeds (pilot sd {sd:g}: the interval resolves "
              f"±{t_quantile(0.95, n - 1) * sd / math.sqrt(n):.3g})")
    print(f"\n{len(runs)} runs ({len(results)} done; claims 1 and 5 come once the sweep has chosen their rates).")
    return 0


def main(argv=None):
    parser = command_parser(__doc__)
    parser.add_argument("command", choices=["plan", "run", "report", "evaluate"])
    parser.add_argument("names", nargs="*", help="evaluate: a run name, its mu_rec and 1 for the T curve (internal)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    parser.add_argument("--seeds", type=int, default=3, help="paired seeds of each claim, at least")
    parser.add_argument("--max_seeds", type=int, default=5, help="at most, where the pilot's spread needs more")
    parser.add_argument("--page", help="report: also fill this page's evidence table, e.g. docs/evidence.md")
    args = parser.parse_args(argv)
    if args.seeds < 2 or args.max_seeds < args.seeds or args.jobs < 1:
        raise ValueError(f"--seeds={args.seeds} must be >= 2 (an interval needs two pairs), --max_seeds="
                         f"{args.max_seeds} >= --seeds, --jobs={args.jobs} >= 1")
    if args.command == "evaluate":
        return evaluate(args.names[0], int(args.names[1]), args.names[2] == "1")
    code = {"plan": plan, "run": run, "report": report}[args.command](args)
    if args.command == "report" and code == 0 and args.page:
        fill_table(Path(args.page))
    return code


if __name__ == "__main__":
    run_command(main)
