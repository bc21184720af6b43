"""Tests for scaling.py and scaling_fit.py: the fitters recover known laws from noisy synthetic points and the
bootstrap's intervals cover a known exponent, the plan's arithmetic gives back C and the CPU preset is in the
paper's regime, a killed sweep resumes without retraining finished points and prints its progress, a looped win
counts only above twice the seed spread, fit survives missing and diverged runs."""

import functools
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from conftest import TINY, Started, carries, forked  # noqa: E402
from experiments import scaling, scaling_fit  # noqa: E402

# -----------------------------------------------------------------------------
# Fitters on synthetic laws

LAW = dict(E=2.0, X=0.5, x=0.6, Y=30.0, y=0.3, Z=0.8, z=1.5)


def train_loss(mu, D, law=LAW):
    return law["E"] + law["X"] * mu ** -law["x"] + law["Y"] * D ** -law["y"]


def test_parabolas_and_power_laws_recover_the_optimal_exponents():
    """With FLOPs per token f0 * mu, D = C / (f0 mu) and L = E + X mu^-x + Y D^-y has its optimum at
    mu* ~ C^(y / (x + y)) and D* ~ C^(x / (x + y)): exactly 1/3 and 2/3 here. Noise: 0.05% of the loss."""
    rng = np.random.default_rng(0)
    law, f0 = LAW, 1e6
    g_mu = law["y"] / (law["x"] + law["y"])
    budgets = {}
    for C in np.geomspace(1e15, 1e18, 5):
        true_mu = (law["x"] * law["X"] / (law["y"] * law["Y"] * f0 ** law["y"])) ** (1 / (law["x"] + law["y"])) \
            * C ** g_mu
        mu = true_mu * 2.0 ** np.linspace(-1.5, 1.5, 7)
        D = C / (f0 * mu)
        losses = train_loss(mu, D, law) * (1 + 5e-4 * rng.standard_normal(mu.size))
        budgets[C] = scaling_fit.parabola_optimum(mu, losses, D)
        assert budgets[C]["vertex_inside"]
    laws = scaling.fit_power_laws(budgets, None, notes := [])
    assert len(notes) == 1 and "no interval" in notes[0]
    assert abs(laws["mu_rec"]["exponent"] - g_mu) < 0.05
    assert abs(laws["D"]["exponent"] - (1 - g_mu)) < 0.05
    assert laws["mu_rec"]["held_out"]["relative_error"] < 0.1 and laws["D"]["held_out"]["relative_error"] < 0.1


def synthetic_unified(rng, mus=(2, 3, 4, 6, 8), Ds=(1e8, 3e8, 1e9, 3e9), Ts=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16)):
    rows = [(mu, D, T) for mu in mus for D in Ds for T in Ts]
    mu, D, T = (np.array(v, float) for v in zip(*rows))
    clean = scaling_fit.unified_predict(LAW, mu, D, T)
    return mu, D, T, clean * (1 + 1e-3 * rng.standard_normal(clean.size))


@pytest.mark.slow  # fits the law from 18 starts
def test_unified_law_recovers_its_parameters_and_predicts_held_out_models():
    mu, D, T, L = synthetic_unified(np.random.default_rng(1))
    train, held = D < 3e9, D == 3e9  # the largest data budget is held out, as fit_unified_law does with C
    params = scaling_fit.fit_unified(mu[train], D[train], T[train], L[train])
    assert abs(params["x"] - LAW["x"]) < 0.05 and abs(params["y"] - LAW["y"]) < 0.05
    assert abs(params["z"] - LAW["z"]) < 0.1 * LAW["z"]
    error = scaling_fit.mean_relative_error
    assert error(scaling_fit.unified_predict(params, mu[train], D[train], T[train]), L[train]) < 2e-3
    assert error(scaling_fit.unified_predict(params, mu[held], D[held], T[held]), L[held]) < 5e-3


def test_vertices_of_many_loss_rows_at_once_match_one_polyfit_per_row():
    rng = np.random.default_rng(2)
    mu, tokens = np.array([1, 2, 3, 4, 8]), np.array([9e5, 8e5, 7e5, 6e5, 4e5])
    losses = 3 + 0.05 * (np.log(mu) - 0.8) ** 2 + 0.01 * rng.standard_normal((200, mu.size))
    many = scaling_fit.parabola_vertices(mu, losses, tokens)
    for i in range(0, 200, 17):
        one = scaling_fit.parabola_optimum(mu, losses[i], tokens)
        a, b, c = np.polyfit(np.log(mu), losses[i], 2)
        assert np.allclose(one["parabola"], [a, b, c]) and np.allclose(many["a"][i], a)
        assert one["mu_star"] == pytest.approx(many["mu_star"][i])
        if a > 0 and abs(b / (2 * a)) < math.log(8) * 2:
            assert one["mu_star"] == pytest.approx(math.exp(-b / (2 * a)))
        slope, intercept = np.polyfit(np.log(mu), np.log(tokens), 1)
        assert one["D_star"] == pytest.approx(math.exp(intercept + slope * math.log(one["mu_star"])))


def test_pooled_spread_is_the_root_mean_sample_variance_of_the_repeated_points():
    assert scaling_fit.pooled_spread([[1.0, 3.0], [2.0, 4.0, 6.0], [5.0]]) == (pytest.approx(math.sqrt(10 / 3)), 3)
    assert scaling_fit.pooled_spread([[1.0], [2.0]]) == (None, 0)
    rng = np.random.default_rng(3)
    sigma, dof = scaling_fit.pooled_spread(list(0.02 * rng.standard_normal((400, 3))))
    assert dof == 800 and abs(sigma - 0.02) < 0.002


def test_bootstrap_interval_covers_the_true_exponent_in_most_draws():
    """Synthetic isoFLOP studies shaped like the CPU preset (5 budgets over 16x, mu_rec 1-8, 3 seeds at the middle
    budget, noise 0.005 nats): loss = L*(C) + 0.05 (ln mu - ln mu*(C))^2 with mu* ~ C^0.4, and FLOPs per token
    ~ mu^0.3, so D* ~ C^(1 - 0.3 x 0.4). Each draw estimates the spread from its own seeds, as fit does; the 90%
    intervals must cover both true exponents in at least 80% of 100 draws."""
    g_mu, p = 0.4, 0.3
    C, mu = 1e12 * 2.0 ** np.arange(5), np.array([1.0, 2.0, 4.0, 8.0])
    covered = {"mu_rec": 0, "D": 0}
    for draw in range(100):
        rng, budgets, groups = np.random.default_rng(100 + draw), [], []
        for j, c in enumerate(C):
            clean = 3.0 * (c / C[0]) ** -0.05 + 0.05 * (np.log(mu) - np.log(1.6 * (c / C[0]) ** g_mu)) ** 2
            seeds = 3 if j == 2 else 1
            losses = clean + 0.005 * rng.standard_normal((seeds, mu.size))
            groups += list(losses.T)
            budgets.append(dict(C=c, mu_rec=mu, loss=losses.mean(0), seeds=[seeds] * mu.size, tokens=c / mu ** p))
        sigma, _ = scaling_fit.pooled_spread(groups)
        intervals = scaling_fit.bootstrap_exponents(budgets, sigma, draws=500, seed=draw)
        for label, truth in (("mu_rec", g_mu), ("D", 1 - p * g_mu)):
            low, high = intervals[label]
            assert high - low < 0.5
            covered[label] += low <= truth <= high
    assert covered["mu_rec"] >= 80 and covered["D"] >= 80


# -----------------------------------------------------------------------------
# The plan's arithmetic

def test_plan_tokens_times_flops_per_token_give_back_the_budget(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(tmp_path))
    scaling.main(["plan", "--depth=6", "--flops=1e18,3e18", "--mu_rec=1,2,4,8"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 8
    commands = (tmp_path / "scaling" / "d6" / "commands.sh").read_text().splitlines()
    assert len(commands) == 8 and all(c.startswith("torchrun ") and " train.py " in c for c in commands)
    for row, command in zip(rows, commands):
        C, mu, seed, fpt, tokens, steps, _, hours = (float(cell.replace(",", "")) for cell in row.strip("|").split("|"))
        assert seed == 0 and "--seed=0" in command  # --seeds defaults to 1
        assert f"--mu_rec={int(mu)} " in command and f"--target_flops={C:g}" in command
        params, exact_fpt, executed = scaling.model_size(dict(depth=6, model=scaling.PAPER_MODEL), int(mu))
        assert abs(fpt - exact_fpt) / exact_fpt < 1e-4  # printed to 5 significant digits
        assert abs(tokens * exact_fpt - C) <= exact_fpt  # tokens printed to the unit
        assert hours == round(C / exact_fpt * executed / (0.4 * 989e12) / 3600, 2)  # MFU of the FLOPs executed
        trained = steps * scaling.PAPER_BATCH * exact_fpt
        assert C - scaling.PAPER_BATCH * exact_fpt < trained <= C  # within one step's tokens


def test_cpu_preset_is_in_the_papers_regime_with_seeds_at_the_middle_budget(capsys, tmp_path, monkeypatch):
    """The paper's 140M isoFLOP points see 5-25 tokens per parameter (paper §5.2): the CPU preset's smallest budget
    must reach at most 6, its largest at least 20, over >= 5 budgets spanning >= 16x, with mu_rec 1, 2, 4, 8."""
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(tmp_path))
    scaling.main(["plan", "--preset=cpu"])
    rows = [line.strip("|").split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    C = [float(row[0]) for row in rows]
    per_param = {c: [float(row[6]) for row in rows if float(row[0]) == c] for c in C}
    assert len(per_param) >= 5 and max(C) / min(C) >= 16
    assert min(per_param[min(C)]) <= 6 and max(per_param[max(C)]) >= 20
    assert {1, 2, 4, 8} <= {int(row[1]) for row in rows}
    sweep = dict(scaling.PRESETS["cpu"], name="cpu")
    middle, points = scaling.seed_budget(sweep), scaling.points(sweep)
    assert sorted(sweep["flops"]).index(middle) == len(sweep["flops"]) // 2
    for mu in sweep["mu_rec"]:
        seeds = [p for p in points if p["C"] == middle and p["mu_rec"] == mu]
        assert sorted(p["seed"] for p in seeds) == [0, 1, 2]
        assert len({p["name"] for p in seeds}) == 3
        assert {f"--seed={p['seed']}" for p in seeds} <= {f for p in seeds for f in scaling.train_flags(sweep, p)}
    assert all(p["seed"] == 0 for p in points if p["C"] != middle)
    commands = (tmp_path / "scaling" / "cpu" / "commands.sh").read_text().splitlines()
    assert len(commands) == len(points) == len(rows)


def test_a_looped_win_counts_only_where_its_paired_interval_excludes_zero():
    """Budget 1 has three seeds: its interval comes from their pairs, whose differences agree although the losses
    spread. The others have one seed: margin +- t(dof) x the pooled paired spread."""
    def budget(fixed, looped):
        return dict(fixed_depth_loss=fixed, best_looped=dict(mu_rec=2, loss=looped))
    offsets = [0.0, 0.3, -0.2]  # a seed's data order moves both arms together
    runs = [dict(C=1, mu_rec=mu, seed=s, loss=3.0 + o - (0.02 + 0.002 * s) * (mu == 2))
            for s, o in enumerate(offsets) for mu in (1, 2)]
    runs += [dict(C=C, mu_rec=mu, seed=0, loss=L) for C, mu, L in
             ((2, 1, 3.0), (2, 2, 2.99), (3, 1, 3.0), (3, 2, 3.03), (4, 1, 3.0), (4, 2, 3.001))]
    budgets = {1: budget(3.0333, 3.0113), 2: budget(3.0, 2.99), 3: budget(3.0, 3.03), 4: budget(3.0, 3.001)}
    scaling.judge_frontier(budgets, runs, paired_sigma=0.004, paired_dof=4)
    assert [b["verdict"] for b in budgets.values()] == ["looped", "looped", "fixed", "within noise"]
    low, high = budgets[1]["ci90"]
    assert low < 0.022 < high and low > 0.015 and budgets[1]["interval_from"] == "3 paired seeds"
    half = scaling_fit.t_quantile(0.95, 4) * 0.004
    assert budgets[2]["ci90"] == pytest.approx([0.01 - half, 0.01 + half])
    assert budgets[3]["margin"] == pytest.approx(-0.03)


def test_t_quantile_matches_tables():
    for p, dof, table in ((0.95, 1, 6.3138), (0.95, 2, 2.9200), (0.95, 3, 2.3534), (0.95, 9, 1.8331),
                          (0.95, 30, 1.6973), (0.975, 5, 2.5706)):
        assert scaling_fit.t_quantile(p, dof) == pytest.approx(table, abs=1e-4)


@pytest.fixture
def t_quantile_once(monkeypatch):
    """scaling_fit.t_quantile, each (p, dof) computed once: 2,000 experiments of 4 pairs ask for the same quantile."""
    monkeypatch.setattr(scaling_fit, "t_quantile", functools.lru_cache(scaling_fit.t_quantile))


def test_paired_interval_covers_a_known_difference_at_its_nominal_rate(t_quantile_once):
    """2,000 synthetic experiments of 4 pairs: a true difference of 0.05 with noise 0.03 per pair (plus a per-seed
    offset that both arms share and pairing cancels). The 90% interval must hold 0.05 in 90% +- 2% of them."""
    rng = np.random.default_rng(0)
    covered = 0
    for _ in range(2000):
        shared = rng.normal(0, 0.5, 4)
        a, b = 3.0 + shared + 0.05 + rng.normal(0, 0.03, 4), 3.0 + shared
        low, high = scaling_fit.paired_interval(a - b)["ci90"]
        covered += low <= 0.05 <= high
    assert abs(covered / 2000 - 0.9) < 0.02


def test_a_zero_difference_is_not_called_shown(t_quantile_once):
    """With no true difference, 'shown' (either sign) must come up in at most ~10% of experiments, as a 90%
    interval's two tails allow; a real difference with enough pairs is shown, and one of the other sign is
    'opposite'."""
    rng = np.random.default_rng(1)
    calls = [scaling_fit.interval_verdict(scaling_fit.paired_interval(rng.normal(0, 0.03, 4))["ci90"], +1)
             for _ in range(2000)]
    assert calls.count("shown") / 2000 < 0.07 and calls.count("opposite") / 2000 < 0.07
    assert calls.count("not shown") / 2000 > 0.86
    assert scaling_fit.interval_verdict(scaling_fit.paired_interval([0.1, 0.12, 0.09])["ci90"], +1) == "shown"
    assert scaling_fit.interval_verdict(scaling_fit.paired_interval([0.1, 0.12, 0.09])["ci90"], -1) == "opposite"
    assert scaling_fit.interval_verdict(scaling_fit.paired_interval([0.1])["ci90"], +1) == "not shown"


def test_paired_spread_cancels_what_a_seed_shares_across_mu_rec():
    """Seed s shifts every mu_rec of a budget by the same offset (its data order): the losses spread, their
    looped - fixed differences do not; a seed without its fixed-depth run is left out."""
    runs = [dict(C=1.0, mu_rec=mu, seed=s, loss=3.0 + 0.1 * mu + [0.0, 0.2, -0.1][s] + 0.01 * (s == 1) * (mu == 4))
            for mu in (1, 2, 4) for s in range(3)] + [dict(C=2.0, mu_rec=2, seed=0, loss=2.0)]
    sigma, dof = scaling_fit.pooled_spread([[r["loss"] for r in runs if r["C"] == 1.0 and r["mu_rec"] == mu]
                                            for mu in (1, 2, 4)])
    paired, paired_dof = scaling.paired_spread(runs)
    assert sigma > 0.1 and paired_dof == 4
    assert paired == pytest.approx(math.sqrt((0 + np.var([0, 0.01, 0], ddof=1) * 2) / 4))


# -----------------------------------------------------------------------------
# A toy sweep: resume, and fit with a missing and a diverged run

TINY_VALUES = dict(flag[2:].split("=") for flag in TINY)
TOY = dict(depth=3, flops=[1.2e9, 2.4e9, 4.8e9], mu_rec=[1, 2, 3], seeds=1, T=[1, 2, 3, 4], batch=256,
           model={name: int(TINY_VALUES[name]) for name in ("d_model", "head_dim", "vocab_size", "seq_len")},
           train_args=[flag for flag in TINY if flag.split("=")[0][2:] in (
               "device_batch_size", "eval_every", "eval_tokens", "log_every", "compile", "dtype")]
           + ["--save_every=1"],  # the sweep's own: the model, batch and horizon come from each point
           eval_args=[f"--val_tokens={TINY_VALUES['eval_tokens']}", "--batch_size=4"], name="toy")


@pytest.fixture(scope="module")
def toy(corpus):
    return corpus, dict(TOY, train_args=TOY["train_args"] + [f"--data={corpus / 'corpus.txt'}"])


def in_base(root, monkeypatch):
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(root / "base"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.slow
def test_killed_sweep_resumes_without_retraining_finished_points(toy, monkeypatch, capsys):
    root, sweep = toy
    in_base(root, monkeypatch)
    forked(scaling, monkeypatch)
    small = dict(sweep, flops=sweep["flops"][:1], mu_rec=[1, 2])
    first, second = scaling.points(small)
    assert first["steps"] >= 3 and second["steps"] >= 3
    # the sweep was killed inside its second point: the first finished, the second left a checkpoint at step 2
    killed = Started(["train.py"] + scaling.train_flags(small, second) + ["--stop_at=2"])
    scaling.run(dict(small, mu_rec=[1]), gpus=0)  # beside it: each is one thread
    _, stderr = killed.communicate()
    assert killed.returncode == 0, stderr[-3000:]
    finished_ckpt = next(scaling.run_dir(first["name"]).glob("ckpt_*.pt"))
    mtime = finished_ckpt.stat().st_mtime_ns
    capsys.readouterr()
    scaling.run(small, gpus=0)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"[1/2] {first['name']} (C") and "done, skipped | elapsed" in lines[0]
    assert lines[0].endswith("ETA -")  # nothing trained yet to time the rest by
    assert lines[1].startswith("[2/2]") and "resuming" in lines[1]
    assert lines[2].startswith("[2/2]") and ": trained | elapsed " in lines[2] and lines[2].endswith("ETA 0.0 min")
    assert lines[3].startswith("run: ") and " in all" in lines[3] and "ktok/s" not in lines[3]  # nothing fresh
    assert finished_ckpt.stat().st_mtime_ns == mtime
    assert (scaling.run_dir(first["name"]) / "train.log").read_text().count("done:") == 1
    assert f"resumed {second['name']} at step 2" in (scaling.run_dir(second["name"]) / "train.log").read_text()
    assert scaling.final_eval(second) is not None and scaling.bpb_result(second, small["T"]) is not None


def fake_runs(sweep):
    """The files train.py and eval_core.py leave, with losses from the unified law (seeds 1 and 2 lie 0.003 nats
    above and below it): fit reads nothing else."""
    for p in scaling.points(sweep):
        offset = [0, 3e-3, -3e-3][p["seed"]]
        curve = [float(scaling_fit.unified_predict(LAW, p["mu_rec"], p["trained_tokens"], T)) + offset
                 for T in sweep["T"]]
        run = scaling.run_dir(p["name"])
        run.mkdir(parents=True)
        record = {"step": p["steps"], f"val_loss_T{p['mu_rec']}": curve[sweep["T"].index(p["mu_rec"])]}
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n" + json.dumps(record) + "\n")
        (run / f"ckpt_{p['steps']:06d}_bpb_T1-2-3-4.json").write_text(
            json.dumps({"step": p["steps"], "T": sweep["T"], "loss": curve}))


@pytest.mark.slow  # fits the law from 18 starts
def test_fit_notes_missing_and_diverged_runs_measures_the_seed_spread_and_draws_the_figures(tmp_path, monkeypatch,
                                                                                           capsys):
    in_base(tmp_path, monkeypatch)
    sweep = dict(TOY, mu_rec=[1, 2, 3, 4], seeds=3)
    fake_runs(sweep)
    largest = [p for p in scaling.points(sweep) if p["C"] == 4.8e9]
    missing, diverged = largest[-1], largest[-2]
    (scaling.run_dir(missing["name"]) / "metrics.jsonl").unlink()
    with open(scaling.run_dir(diverged["name"]) / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": diverged["steps"], f"val_loss_T{diverged['mu_rec']}": math.nan}) + "\n")
    result = scaling.fit(sweep)
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 3 and len(result["notes"]) == 3
    assert diverged["name"] in notes[0] and "diverged" in notes[0]
    assert missing["name"] in notes[1] and "missing" in notes[1]
    assert carries(notes[2], "C=4.8e+09", "2", "mu_rec")  # so the largest budget has no parabola
    assert len(result["runs"]) == 18 and len(result["budgets"]) == 2  # 12 + 8 seeds, less 2
    middle = result["budgets"]["2.4e+09"]
    assert middle["seeds"] == [3, 3, 3, 3] and middle["spread"] == pytest.approx([3e-3] * 4)
    assert result["noise"]["sigma"] == pytest.approx(3e-3) and result["noise"]["degrees_of_freedom"] == 8
    assert "+- 0.0030" in out and "seed spread: 0.0030 nats" in out
    assert middle["interval_from"] == "3 paired seeds"  # whose differences agree: a zero-width interval
    assert middle["ci90"] == pytest.approx([middle["margin"]] * 2, abs=1e-9)
    assert result["noise"]["paired_sigma"] == pytest.approx(0, abs=1e-9)  # each seed shifts all of its mu_rec alike
    assert result["noise"]["paired_degrees_of_freedom"] == 6
    for label in ("mu_rec", "D"):
        low, high = result["power_laws"][label]["interval90"]
        assert low <= result["power_laws"][label]["exponent"] <= high
    assert result["unified"]["held_out_error"] < 1e-3  # the held-out points lie on the law
    out_dir = tmp_path / "base" / "scaling" / "toy"
    for name in ("isoflop.png", "optimal.png", "test_time.png", "frontier.png"):
        assert (out_dir / name).stat().st_size > 5000
    saved = json.loads((out_dir / "fit.json").read_text())
    assert saved["notes"] == result["notes"] and saved["power_laws"]["D"]["interval90"] == list(
        result["power_laws"]["D"]["interval90"])
    # --refit: the recorded runs fitted again with no run folders, written beside the JSON: the same budgets
    recorded = tmp_path / "recorded" / "fit.json"
    recorded.parent.mkdir()
    recorded.write_text((out_dir / "fit.json").read_text())
    shutil.rmtree(tmp_path / "base" / "runs")
    scaling.main(["fit", "--refit", str(recorded)])
    assert (recorded.parent / "frontier.png").stat().st_size > 5000
    assert json.loads(recorded.read_text())["budgets"] == saved["budgets"]
