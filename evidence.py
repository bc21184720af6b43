"""
evidence.py: the paper's claims about Parcae as paired experiments on a laptop CPU, each with a 90% interval and
a verdict. runs/evidence_cpu.sh runs it end to end (about an hour on a quiet 2-core machine).

    python evidence.py plan                  # the runs, their cost, and what each claim can detect
    python evidence.py run --jobs=2          # train (and evaluate) every run, two at a time, with an ETA
    python evidence.py report                # judge the claims: figures/evidence_cpu/{*.png, verdicts.json, .md}

The setup: train.py's CPU preset shape on a byte-level vocabulary (259 = 256 bytes + 3 specials) of the stdlib
corpus: depth 3 (1 prelude, 1 recurrent, 1 coda layer), d_model 128, rows of 128 tokens, 16 rows a step, mu_rec 8,
300 steps (614,400 tokens), the recipe's schedule. Byte-level, so the embeddings are small and nearly every
parameter is in the blocks the claims are about; 300 steps, because that is where the loss of this model bends
flat under the recipe's warmdown and a run costs about two minutes.

The design (README, "Evidence"): every comparison is paired. Arm A and arm B of a pair share the seed, and with it
the data order, the depth draws, h0 and every initial weight whose module both arms build the same way; the only
difference is the factor under test. A claim's difference is measured within each seed, and its interval is a
two-sided t-interval over the pairs (scaling_fit.paired_interval). Verdict: "shown" when the 90% interval excludes
0 on the side the paper predicts, "opposite" when it excludes 0 on the other side, "not shown" when it holds 0,
or when the loss still fell by more than the effect over the last 20% of the steps (the run was too short to
tell). A run train.py declares diverged (exit 3), or whose loss ends non-finite or above ln(vocab), counts with
the loss of a uniform guess, ln 259 = 5.557 nats. A claim whose interval holds 0 and is wider than the paper's
effect gets another seed, up to --max_seeds.

The learning rate is the whole model's: --adamw_lr and --muon_lr set to the same value r (the recipe has both at
8e-3 at the paper's 140M; the sweep moves both together).
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

import numpy as np

from plot import read_run
from scaling_fit import interval_verdict, paired_interval

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "figures" / "evidence_cpu"

# -----------------------------------------------------------------------------
# The setup and the experiments

VOCAB, STEPS, BATCH = 259, 300, 2048
UNIFORM_LOSS = math.log(VOCAB)  # a diverged run counts as a uniform guess
MAIN = ["--depth=3", "--d_model=128", "--head_dim=64", f"--vocab_size={VOCAB}", "--seq_len=128",
        "--device_batch_size=16", f"--total_batch_size={BATCH}", "--data=stdlib", "--compile=0", "--dtype=float32",
        "--core_every=-1", "--log_every=1", "--save_every=1000000", "--eval_tokens=8192"]
# claim 6 needs >= 10 tokens per parameter: a narrower model (217,856 parameters) for 1,064 steps (10.0 per param)
SMALL = [flag for flag in MAIN if not flag.startswith(("--d_model", "--head_dim"))] + ["--d_model=64", "--head_dim=32"]
SMALL_STEPS = 1064
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
    width, executed = (64 if small else 128), (1 if injection == "none" else mu_rec * (1.5 if sampling == "per_batch"
                                                                                        else 1))
    cost = steps * BATCH * width ** 2 * (2 + executed)  # proportional to FLOPs: prelude + coda + loop steps
    curve = not small and injection != "none" and prelude_norm and rate == SHARED_RATE  # claims 2, 4 and 7
    return dict(name=name, flags=flags, cost=cost, injection=injection, rate=rate, seed=seed, mu_rec=mu_rec,
                sampling=sampling, prelude_norm=prelude_norm, small=small, steps=steps, curve=curve)


def sweep_runs():
    """Claim 1 (and 5's choice of rate): every model at every rate, seed 0."""
    runs = [make_run(injection, rate) for rate in RATES for injection in INJECTIONS + ["none"]]
    return runs + [make_run("diagonal", rate, prelude_norm=0) for rate in RATES]


def norm_rate(results):
    """Claim 5's rate: the highest of the sweep at which Parcae both with and without the prelude norm trained
    (seed 0); None until both sweeps have finished."""
    trained = []
    for rate in RATES:
        pair = [results.get(make_run("diagonal", rate, prelude_norm=p)["name"]) for p in (1, 0)]
        if None in pair:
            return None
        if not any(r["diverged"] for r in pair):
            trained.append(rate)
    return max(trained) if trained else RATES[0]


def claim_arms(results):
    """Each claim's two arms, as run builders of a seed: {claim: (arm A, arm B)}; A - B is the measured difference.
    Claim 5 appears once the sweep has chosen its rate."""
    arms = {
        "1": (lambda s: make_run("concat", TOP_RATE, s), lambda s: make_run("diagonal", TOP_RATE, s)),
        "2": (lambda s: make_run("add", SHARED_RATE, s), lambda s: make_run("diagonal", SHARED_RATE, s)),
        "3a": (lambda s: make_run("add", SHARED_RATE, s), lambda s: make_run("diagonal", SHARED_RATE, s)),
        "3b": (lambda s: make_run("concat", SHARED_RATE, s), lambda s: make_run("diagonal", SHARED_RATE, s)),
        "4": (lambda s: make_run(sampling="per_batch", seed=s), lambda s: make_run(seed=s)),
        "6": (lambda s: make_run("diagonal", SHARED_RATE, s, small=True),
              lambda s: make_run("none", SHARED_RATE, s, small=True)),
        "7": (lambda s: make_run(mu_rec=8, seed=s), lambda s: make_run(mu_rec=2, seed=s)),
    }
    rate = norm_rate(results)
    if rate is not None:
        arms["5"] = (lambda s: make_run("diagonal", rate, s, prelude_norm=0), lambda s: make_run("diagonal", rate, s))
    return arms


def planned_runs(results, seeds, max_seeds):
    """Every run the suite needs now: the sweep, each claim's arms at `seeds` seeds (more where the adaptive rule
    of the docstring asks for them), the rest of claim 2's injections, claim 6's second rate, claim 7's mu_rec 4."""
    runs = sweep_runs()
    for claim, arms in claim_arms(results).items():
        for seed in range(seeds_wanted(claim, results, seeds, max_seeds)):
            runs += [arm(seed) for arm in arms]
    for seed in range(seeds):
        runs += [make_run("concat", SHARED_RATE, seed), make_run("add", TOP_RATE, seed), make_run(mu_rec=4, seed=seed)]
        runs += [make_run(injection, SMALL_RATES[1], seed, small=True) for injection in ("diagonal", "none")]
    unique = {}
    for run in runs:
        unique.setdefault(run["name"], run)
    return list(unique.values())


def seeds_wanted(claim, results, seeds, max_seeds):
    """`seeds`, plus one for each finished round whose interval held 0 while wider than the paper's effect."""
    n = seeds
    while n < max_seeds:
        judged = judge(claim, results, n)
        if judged is None or judged["verdict"] != "not shown" or judged["ci90"] is None:
            break
        half = (judged["ci90"][1] - judged["ci90"][0]) / 2
        if PAPER[claim]["effect"] is not None and half <= abs(PAPER[claim]["effect"]):
            break
        n += 1
    return n


# -----------------------------------------------------------------------------
# Training and the final evaluation of one run (a subprocess each, so that --jobs of them run at once)

def run_dir(name):
    from common import get_base_dir  # imports torch: not needed by `plan`
    return get_base_dir() / "runs" / name


def train_and_evaluate(run, log_path, threads):
    """train.py from scratch (a run cut short is restarted: it takes minutes), then `evaluate` -> ok."""
    directory = run_dir(run["name"])
    for stale in list(directory.glob("ckpt_*.pt")) + list(directory.glob("metrics.jsonl")):
        stale.unlink()
    directory.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        for cmd in ([sys.executable, "train.py"] + run["flags"],
                    [sys.executable, "evidence.py", "evaluate", run["name"], str(run["mu_rec"]), str(int(run["curve"]))]):
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                  env=dict(os.environ, OMP_NUM_THREADS=str(threads))).returncode
            if code not in (0, 3):  # 3: train.py declared the run diverged, a result
                return False
    return (directory / "evidence.json").exists()


def evaluate(name, mu_rec, with_curve):
    """The run's record (evidence.json): its logged curves and divergence, and, if it trained and with_curve, the
    val loss and ||h_T|| at every CURVE_T with one seeded h0 (scoring.initial_state_table), as eval_core.evaluate_bpb
    does (8,192 tokens: about 30 s a run on one core)."""
    import torch

    from common import find_checkpoint, load_checkpoint, write_atomically
    from data import get_tokenizer, val_batches
    from scoring import initial_state_table
    directory = run_dir(name)
    logged = read_run(directory)
    evals = [e for e in logged["evals"] if f"val_loss_T{mu_rec}" in e or "val_loss_T1" in e]
    record = dict(name=name, diverged_at=logged["diverged_at"], train_loss=[s.get("loss") for s in logged["steps"]],
                  max_rho=max((s["rho"] for s in logged["steps"] if s.get("rho") is not None), default=None),
                  max_h_norm=max((s["h_norm"] for s in logged["steps"] if s.get("h_norm") is not None), default=None),
                  val=[dict(step=e["step"], loss=e.get(f"val_loss_T{mu_rec}", e.get("val_loss_T1"))) for e in evals],
                  curve=None)
    if logged["diverged_at"] is None and with_curve:
        model, _ = load_checkpoint(find_checkpoint(directory.parent, name))
        tokenizer = get_tokenizer("stdlib", VOCAB)
        batches = list(val_batches(tokenizer, "stdlib", 16, model.config.seq_len, 8192))
        h0 = initial_state_table(model, model.config.seq_len, 1234, "cpu")
        depths = [1] if model.config.injection == "none" else CURVE_T
        curve = dict(T=depths, loss=[], h_norm=[])
        with torch.no_grad():
            for T in depths:
                out = [model(x, y, T=T, h0=h0.expand(x.size(0), -1, -1), return_diagnostics=True) for x, y in batches]
                curve["loss"].append(float(np.mean([loss.item() for loss, _ in out])))
                norms = [d["h_norm"] for _, d in out]
                curve["h_norm"].append(None if norms[0] is None else float(np.mean([n.item() for n in norms])))
        record["curve"] = curve
    write_atomically(directory / "evidence.json", lambda path: path.write_text(json.dumps(record)))


def load_results(runs):
    """{name: record} of the finished runs, each with `loss` (final val loss at T = mu_rec, a uniform guess's if
    it diverged) and `diverged`."""
    results = {}
    for run in runs:
        path = run_dir(run["name"]) / "evidence.json"
        if not path.exists():
            continue
        record = dict(json.loads(path.read_text()), **run)
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


def priority(run):
    """The sweep's Parcae runs first (claim 5's rate waits for them), then the longest first."""
    return (not (run["injection"] == "diagonal" and run["seed"] == 0 and run["mu_rec"] == 8 and not run["small"]
                 and run["sampling"] == "per_sequence"), -run["cost"])


def run(args):
    """Every planned run not yet finished, --jobs at a time, longest first; the plan is redrawn after each run,
    as finished runs unlock claim 5 and extra seeds. A line per run with the time so far and an ETA."""
    start, done_cost, failed, count = time.time(), 0.0, set(), None
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    (OUT / "logs").mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        running = {}
        while True:
            runs, results = all_results(args.seeds, args.max_seeds)
            count = len(results) if count is None else count
            todo = sorted((r for r in runs if r["name"] not in results and r["name"] not in failed
                           and r["name"] not in {x["name"] for x in running.values()}), key=priority)
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
                print(f"[{count}/{len(runs)}] {r['name']}: "
                      f"{'done' if ok else 'FAILED, see ' + str(OUT / 'logs' / (r['name'] + '.log'))} | elapsed "
                      f"{elapsed / 60:.1f} min | ETA {elapsed / done_cost * left / 60:.1f} min (plan may grow)",
                      flush=True)
    print(f"run: {(time.time() - start) / 60:.1f} min" + (f"; failed: {', '.join(sorted(failed))}" if failed else ""))
    return 1 if failed else 0


# -----------------------------------------------------------------------------
# The claims: what each pair measures, the paper's side and effect, and the verdict

PAPER = {  # expected sign of A - B, and the paper's effect in the same units where it gives one (None: no number)
    "1": dict(claim="learning-rate robustness: at the sweep's top rate, RDM (concat) minus Parcae, final val loss",
              paper="RDM converges only at the lowest of 2e-4..1e-3, Parcae at every rate", sign=+1, effect=None),
    "2": dict(claim="addition is marginally stable: ln(||h_32|| / ||h_8||), addition minus Parcae",
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
    "7": dict(claim="test-time scaling: T at which L(T) = L_inf + Z exp(-zT) has 95% of its gain, mu_rec 8 minus 2",
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
    """L(T) = L_inf + Z exp(-z T), least squares: L_inf and Z linear for each z of a fine log grid.
    -> dict(L_inf, Z, z, T95 = ln(20) / z, error = mean |relative residual|)."""
    T, loss = np.asarray(T, float), np.asarray(loss, float)
    best = None
    for z in np.logspace(-3, 1.5, 600):
        basis = np.stack([np.ones_like(T), np.exp(-z * T)], axis=1)
        coef, *_ = np.linalg.lstsq(basis, loss, rcond=None)
        sse = float(((basis @ coef - loss) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, z, coef)
    _, z, (L_inf, Z) = best
    predicted = L_inf + Z * np.exp(-z * T)
    return dict(L_inf=float(L_inf), Z=float(Z), z=float(z), T95=math.log(20) / z,
                error=float(np.mean(np.abs(predicted - loss) / loss)))


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
    fits = [fit_test_time(r["curve"]["T"], r["curve"]["loss"]) for r in (a, b)]
    return fits[0]["T95"] - fits[1]["T95"]


def late_fall(record):
    """How much the val loss (T = mu_rec) fell over the last 20% of the steps: the eval nearest 80% minus the last."""
    val = [v for v in record["val"] if v["loss"] is not None]
    if record["diverged"] or len(val) < 2:
        return 0.0
    at_80 = min(val, key=lambda v: abs(v["step"] - 0.8 * record["steps"]))
    return at_80["loss"] - val[-1]["loss"]


def judge(claim, results, seeds):
    """The claim over seeds 0..seeds-1 -> dict(measured, ci90, n, sd, verdict, late_fall, reason), or None while
    one of those runs is unfinished."""
    arms = claim_arms(results).get(claim)
    if arms is None:
        return None
    pairs = [[results.get(arm(seed)["name"]) for arm in arms] for seed in range(seeds)]
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
            out["verdict"], out["reason"] = "not shown", \
                f"still falling: the loss fell {out['late_fall']:.3f} over the last 20% of steps, more than the effect"
    return out


# -----------------------------------------------------------------------------
# Details behind each verdict: the sweep's table, claim 2's ratios, claim 6's crossing, claim 7's fits

def mean_interval(values):
    """A one-sample 90% t-interval, as [mean, low, high] (None for fewer than 2 values)."""
    p = paired_interval(values)
    return None if p["ci90"] is None else [p["measured"], *p["ci90"]]


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
                              h_ratio_32_8=mean_interval([math.exp(log_growth(r)) for r in trained]),
                              loss_32_minus_8=mean_interval([depth_loss(r, 32) - depth_loss(r, 8) for r in trained]))
    return out


def crossing(parcae_runs, transformer_runs):
    """The first eval step from which the seeds' mean val loss of Parcae stays below the Transformer's (None: never)."""
    steps = [v["step"] for v in parcae_runs[0]["val"]]
    mean = {k: [np.mean([r["val"][i]["loss"] for r in runs]) for i in range(len(steps))]
            for k, runs in (("p", parcae_runs), ("t", transformer_runs))}
    below = [p < t for p, t in zip(mean["p"], mean["t"])]
    for i in range(len(steps)):
        if all(below[i:]):
            return steps[i]
    return None


def transformer_details(results, seeds):
    """Claim 6 at both rates: the paired difference and where Parcae's val curve crosses below."""
    out = {}
    for rate in SMALL_RATES:
        runs = {injection: [results.get(make_run(injection, rate, s, small=True)["name"]) for s in range(seeds)]
                for injection in ("diagonal", "none")}
        if any(r is None for group in runs.values() for r in group):
            continue
        step = crossing(runs["diagonal"], runs["none"])
        out[f"{rate:g}"] = dict(paired_interval([a["loss"] - b["loss"] for a, b in zip(runs["diagonal"], runs["none"])]),
                                crosses_below_at_step=step,
                                tokens_per_param=None if step is None else step * BATCH / 217_856)
    return out


def test_time_details(results, seeds):
    """Claim 7 per mu_rec: the fit's error, T95, and L_inf against L(mu_rec)."""
    out = {}
    for mu in (2, 4, 8):
        fits = [(fit_test_time(r["curve"]["T"], r["curve"]["loss"]), depth_loss(r, mu))
                for r in (results[make_run(mu_rec=mu, seed=s)["name"]] for s in range(seeds)) if not r["diverged"]]
        out[str(mu)] = dict(fit_error=mean_interval([f["error"] for f, _ in fits]),
                            T95=mean_interval([f["T95"] for f, _ in fits]),
                            L_inf_vs_L_mu=mean_interval([(f["L_inf"] - L) / L for f, L in fits]))
    return out


# -----------------------------------------------------------------------------
# Report: verdicts.json, verdicts.md (README's table) and the figures

def fmt_interval(j, digits=3):
    if j["measured"] is None:
        return "-"
    ci = "" if j["ci90"] is None else f" [{j['ci90'][0]:+.{digits}f}, {j['ci90'][1]:+.{digits}f}]"
    return f"{j['measured']:+.{digits}f}{ci}, n = {j['n']}"


def table_markdown(verdicts):
    lines = ["| # | claim | the paper | this run: A - B, 90% interval | verdict |", "|---|---|---|---|---|"]
    for v in verdicts:
        verdict = v["verdict"] + (f" ({v['reason']})" if v["reason"] else "")
        lines.append(f"| {v['id']} | {v['claim']} | {v['paper']} | {fmt_interval(v)} | **{verdict}** |")
    return "\n".join(lines) + "\n"


def report(args):
    import matplotlib
    matplotlib.use("Agg")
    from common import write_atomically
    runs, results = all_results(args.seeds, args.max_seeds)
    missing = [r["name"] for r in runs if r["name"] not in results]
    if missing:
        print(f"error: {len(missing)} of {len(runs)} runs are unfinished ({', '.join(missing[:3])}, ...); "
              f"run `python evidence.py run` first", file=sys.stderr)
        return 2
    verdicts = []
    for claim, paper in PAPER.items():
        n = seeds_wanted(claim, results, args.seeds, args.max_seeds)
        verdicts.append(dict(id=claim, claim=paper["claim"], paper=paper["paper"], paper_effect=paper["effect"],
                             expected_sign=paper["sign"], seeds=n, **judge(claim, results, n)))
    seeds = args.seeds
    details = dict(setup=dict(train_flags=MAIN, steps=STEPS, small_flags=SMALL, small_steps=SMALL_STEPS, rates=RATES,
                              shared_rate=SHARED_RATE, top_rate=TOP_RATE, claim5_rate=norm_rate(results),
                              interval="two-sided t-interval over paired seeds", uniform_loss=UNIFORM_LOSS),
                   sweep=sweep_details(results), depth=depth_details(results, seeds),
                   transformer=transformer_details(results, seeds), test_time=test_time_details(results, seeds))
    OUT.mkdir(parents=True, exist_ok=True)
    write_atomically(OUT / "verdicts.json", lambda p: p.write_text(json.dumps(dict(verdicts=verdicts, details=details),
                                                                             indent=1)))
    table = table_markdown(verdicts)
    write_atomically(OUT / "verdicts.md", lambda p: p.write_text(table))
    draw(results, seeds, details)
    print(table)
    print(f"wrote {OUT / 'verdicts.json'}, {OUT / 'verdicts.md'} and the figures in {OUT}")
    return 0


def draw(results, seeds, details):
    import matplotlib.pyplot as plt
    from common import write_atomically

    def save(fig, name):
        fig.tight_layout()
        write_atomically(OUT / name, lambda p: fig.savefig(p, dpi=110, format="png"))
        plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))  # claim 1 (and 5): the sweep
    for label, row in details["sweep"].items():
        lines = [axes[0].plot(RATES, row["loss"], "o-", label=label)[0]]
        for rate, loss, bad in zip(RATES, row["loss"], row["diverged"]):
            if bad:
                axes[0].plot(rate, loss, "x", color=lines[0].get_color(), markersize=12, mew=2)
        for ax, key in ((axes[1], "max_h_norm"), (axes[2], "max_rho")):
            if row[key][0] is not None:
                ax.plot(RATES, row[key], "o-", label=label)
    for ax, title in zip(axes, ("final val loss (x: diverged, at ln 259)", "max ||h_T|| in training",
                                "max rho(Abar) in training")):
        ax.set(xscale="log", xlabel="learning rate, whole model (AdamW = Muon)", title=title)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    save(fig, "lr_sweep.png")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))  # claim 2: the state and the loss against test-time depth
    for injection in INJECTIONS:
        trained = [r for r in (results[make_run(injection, SHARED_RATE, s)["name"]] for s in range(seeds))
                   if not r["diverged"]]
        for r in trained:
            for ax, key in zip(axes, ("h_norm", "loss")):
                ax.plot(r["curve"]["T"], r["curve"][key], "o-", alpha=0.6,
                        color=f"C{INJECTIONS.index(injection)}", label=injection if r is trained[0] else None)
    axes[0].set(yscale="log", xscale="log", xlabel="test-time recurrence T", title="||h_T|| (one line per seed)")
    axes[1].set(xscale="log", xlabel="test-time recurrence T", title=f"val loss, trained at mu_rec 8, lr {SHARED_RATE:g}")
    axes[0].legend()
    save(fig, "depth.png")

    fig, ax = plt.subplots(figsize=(6, 4))  # claim 4
    for i, sampling in enumerate(("per_batch", "per_sequence")):
        for s in range(seeds):
            r = results[make_run(sampling=sampling, seed=s)["name"]]
            ax.plot(r["curve"]["T"], r["curve"]["loss"], "o-", color=f"C{i}", alpha=0.6, label=sampling if not s else None)
    ax.set(xscale="log", xlabel="test-time recurrence T", ylabel="val loss", title="depth sampling (one line per seed)")
    ax.legend()
    save(fig, "sampling.png")

    fig, axes = plt.subplots(1, len(SMALL_RATES), figsize=(11, 4), sharey=True)  # claim 6
    for ax, rate in zip(axes, SMALL_RATES):
        for i, injection in enumerate(("diagonal", "none")):
            for s in range(seeds):
                r = results[make_run(injection, rate, s, small=True)["name"]]
                ax.plot([v["step"] * BATCH / 217_856 for v in r["val"]], [v["loss"] for v in r["val"]], "o-",
                        color=f"C{i}", alpha=0.6, label=("Parcae (T = 8)" if i == 0 else "Transformer") if not s else None)
        ax.set(xlabel="tokens per parameter", ylabel="val loss", title=f"same parameters, lr {rate:g}", yscale="log")
    axes[0].legend()
    save(fig, "transformer.png")

    fig, ax = plt.subplots(figsize=(6, 4))  # claim 7
    for i, mu in enumerate((2, 4, 8)):
        for s in range(seeds):
            r = results[make_run(mu_rec=mu, seed=s)["name"]]
            if r["diverged"]:
                continue
            fit = fit_test_time(r["curve"]["T"], r["curve"]["loss"])
            T = np.linspace(1, max(CURVE_T), 200)
            ax.plot(r["curve"]["T"], r["curve"]["loss"], "o", color=f"C{i}", alpha=0.6,
                    label=f"mu_rec {mu}" if not s else None)
            ax.plot(T, fit["L_inf"] + fit["Z"] * np.exp(-fit["z"] * T), "-", color=f"C{i}", alpha=0.6)
            ax.axvline(fit["T95"], color=f"C{i}", ls=":", alpha=0.6)
    ax.set(xscale="log", xlabel="test-time recurrence T", ylabel="val loss",
           title="L(T) = L_inf + Z exp(-zT) (dotted: T95)")
    ax.legend()
    save(fig, "test_time.png")


def write_readme_table(readme):
    """README's evidence table, between its two markers, replaced by verdicts.md."""
    text, table = readme.read_text(), (OUT / "verdicts.md").read_text()
    start, end = "<!-- evidence-table -->\n", "<!-- /evidence-table -->"
    if start not in text or end not in text:
        raise SystemExit(f"error: {readme} has no {start.strip()} ... {end} block to fill")
    head, rest = text.split(start, 1)
    readme.write_text(head + start + table + end + rest.split(end, 1)[1])


# -----------------------------------------------------------------------------
# Command line

def plan(args):
    runs, results = all_results(args.seeds, args.max_seeds)
    total = sum(r["cost"] for r in runs)
    for r in sorted(runs, key=lambda r: r["name"]):
        print(f"{r['name']:48s} {r['steps']:5d} steps  {'done' if r['name'] in results else ''}")
    t = paired_interval([0, 1])  # two pairs: t_{0.95,1}; the detectable effect scales as t(n-1) sd / sqrt(n)
    print(f"\n{len(runs)} runs ({len(results)} done), {total / 1e12:.1f} cost units; claim 5 adds "
          f"{0 if norm_rate(results) is not None else 2 * args.seeds} once the sweep has run, and extra seeds come "
          f"where an interval holds 0 and is wider than the paper's effect (up to --max_seeds={args.max_seeds}).")
    print(f"What {args.seeds} pairs can detect: an interval excludes 0 when |mean| > t(0.95, {args.seeds - 1}) sd / "
          f"sqrt({args.seeds}) = {_detectable(args.seeds):.2f} x the pairs' sd (2 pairs: {t['ci90'][1] - 0.5:.2f} x).")
    return 0


def _detectable(n):
    p = paired_interval(np.r_[np.zeros(n - 1), 1.0])  # any n values: half-width / sd = t / sqrt(n)
    return (p["ci90"][1] - p["measured"]) / p["sd"]


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
        parser.error(f"--seeds={args.seeds} must be >= 2 (an interval needs two pairs), --max_seeds >= --seeds, "
                     f"--jobs >= 1")
    if args.command == "evaluate":
        return evaluate(args.names[0], int(args.names[1]), args.names[2] == "1")
    code = {"plan": plan, "run": run, "report": report}[args.command](args)
    if args.command == "report" and code == 0 and args.readme:
        write_readme_table(Path(args.readme))
    return code


if __name__ == "__main__":
    sys.exit(main())
