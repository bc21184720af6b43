"""evidence.py: the judging of claims from paired runs, on synthetic records, and one tiny real run through
train.py and the final evaluation. The interval itself is tested in tests/test_scaling.py.

Run as a script, this file is that tiny run, in the base folder its environment names:

    python tests/test_evidence.py LOG_PATH
"""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too
from conftest import awaited, beforehand, python, raises_naming  # noqa: E402
from experiments import evidence  # noqa: E402


def record(run, loss=2.0, diverged=False, fall=0.0, gap_left=0.0, curve=None):
    """A finished run as load_results returns it, with evals at 60 / 70 / 80 / 90 / 100% of the steps: the loss
    falls by `fall` over the last 40% (a warmdown) and by another `gap_left` x (1 - fraction) / 0.4 before the end
    (a gap still closing, when one arm has it)."""
    steps = run["steps"]
    losses = [loss + (fall + gap_left) * min(1.0, (1 - f) / 0.4) for f in evidence.FRACTIONS]
    val = [dict(step=round(f * steps), loss=L, loss_T1=L + 0.5) for f, L in zip(evidence.FRACTIONS, losses)]
    return dict(run, val=val, diverged=diverged, diverged_at=5 if diverged else None, curve=curve,
                loss=evidence.UNIFORM_LOSS if diverged else loss, max_rho=0.5, max_h_norm=10.0, train_loss=[])


def results_of(pairs, claim, optimizer="muon", sweep=None):
    """{name: record} for claim's arms, one (kwargs of arm A, kwargs of arm B) per seed, and `sweep`'s records
    (claims 1 and 5 need the sweep's to choose their rates)."""
    sweep = sweep or {}
    arms = evidence.claim_arms(sweep)[(claim, optimizer)]
    out = dict(sweep)
    for seed, (a, b) in enumerate(pairs):
        for arm, kwargs in zip(arms, (a, b)):
            r = record(arm(seed), **kwargs)
            out[r["name"]] = r
    return out


def test_a_clear_paired_difference_is_shown_even_when_the_seeds_spread():
    """Seeds move both arms together by up to 0.3 nats; the within-seed difference of 0.05 is shown."""
    offsets, gaps = [0.0, 0.3, -0.2], [0.05, 0.052, 0.048]
    results = results_of([(dict(loss=2 + o + g), dict(loss=2 + o)) for o, g in zip(offsets, gaps)], "3a")
    judged = evidence.judge("3a", "muon", results, 3)
    assert judged["verdict"] == "shown" and judged["n"] == 3 and judged["measured"] == pytest.approx(0.05)
    assert judged["ci90"][0] > 0.04 and judged["ci90"][1] < 0.06
    flipped = results_of([(dict(loss=2 + o), dict(loss=2 + o + g)) for o, g in zip(offsets, gaps)], "3a")
    assert evidence.judge("3a", "muon", flipped, 3)["verdict"] == "opposite"
    assert evidence.judge("3a", "muon", results, 4) is None  # seed 3 has not run


def test_a_warmdown_that_lowers_both_arms_alike_never_trips_the_drift_rule():
    """Both arms fall 0.3 nats over the last 40% of training, three times the 0.05 gap: still shown."""
    results = results_of([(dict(loss=2.05 + 0.002 * s, fall=0.3), dict(loss=2.0, fall=0.3)) for s in range(3)], "3a")
    judged = evidence.judge("3a", "muon", results, 3)
    assert judged["verdict"] == "shown" and judged["reason"] is None
    drift = judged["drift"]
    assert drift["long_enough"] and drift["one_sign"] and drift["limit"] == pytest.approx(judged["measured"] / 2)
    assert drift["drift"]["measured"] == pytest.approx(0.0, abs=1e-12)
    assert list(drift["by_fraction"]) == ["0.6", "0.7", "0.8", "0.9", "1"]


def test_a_difference_still_shrinking_towards_zero_is_not_shown():
    """Arm A's extra loss closes from 0.10 at 60% to 0.02 at the end: the interval alone excludes 0, but the drift
    from 80% (-0.03) is more than half the final difference (0.01), so the run was too short to judge."""
    results = results_of([(dict(loss=2.02 + 0.001 * s, gap_left=0.08), dict(loss=2.0)) for s in range(3)], "3a")
    judged = evidence.judge("3a", "muon", results, 3)
    assert judged["ci90"][0] > 0 and judged["verdict"] == "not shown"
    assert judged["reason"].startswith("still drifting") and "the interval alone would say shown" in judged["reason"]
    assert judged["drift"]["drift"]["measured"] == pytest.approx(-0.04)
    changing = results_of([(dict(loss=1.98, gap_left=0.1), dict(loss=2.0)) for _ in range(3)], "3a")
    assert "changes sign" in evidence.judge("3a", "muon", changing, 3)["drift"]["reason"]


def test_claim_4_is_judged_at_t1_and_a_claim_holding_zero_says_so():
    results = results_of([(dict(loss=2.0 + 0.01 * s), dict(loss=2.0 + 0.01 * s)) for s in range(3)], "4", "adamw")
    judged = evidence.judge("4", "adamw", results, 3)
    assert judged["verdict"] == "not shown" and judged["reason"] == "the 90% interval holds 0"
    name = evidence.claim_arms({})[("4", "adamw")][0](0)["name"]
    assert "_per_batch_adamw_" in name and "--optimizer=adamw" in results[name]["flags"]
    results[name]["val"][-1]["loss_T1"] += 1.0  # at T = 1 only: claim 4 sees it, T = mu_rec would not
    assert evidence.judge("4", "adamw", results, 3)["measured"] == pytest.approx(1 / 3)


def test_a_diverged_run_counts_as_a_uniform_guess():
    sweep = {r["name"]: record(r) for r in evidence.sweep_runs()}
    results = results_of([(dict(diverged=True), dict(loss=2.0)) for _ in range(3)], "1", sweep=sweep)
    judged = evidence.judge("1", "muon", results, 3)
    assert judged["measured"] == pytest.approx(math.log(259) - 2.0) and judged["verdict"] == "shown"


def test_claims_1_and_5_run_at_the_rates_the_sweep_chose_per_optimiser():
    """Under AdamW Parcae without the norm diverged above the lowest rate, with it above the second: claim 5 runs
    at the lowest, claim 1 at the second; under Muon every run trained, so both run at the top rate."""
    results = {}
    for r in evidence.sweep_runs():
        adamw = r["optimizer"] == "adamw" and r["injection"] == "diagonal"
        bad = adamw and r["rate"] > evidence.RATES[0 if not r["prelude_norm"] else 1]
        results[r["name"]] = record(r, diverged=bad)
    assert evidence.chosen_rate(results, "adamw", (1, 0)) == evidence.RATES[0]
    assert evidence.chosen_rate(results, "adamw", (1,)) == evidence.RATES[1]
    assert evidence.chosen_rate(results, "muon", (1, 0)) == evidence.RATES[-1]
    arms = evidence.claim_arms(results)
    assert arms[("5", "adamw")][0](1)["rate"] == evidence.RATES[0] and arms[("1", "adamw")][1](1)["rate"] == 8e-3
    assert [key for key in arms] == evidence.CLAIMS
    assert ("5", "muon") not in evidence.claim_arms({})  # before the sweep has finished


def test_each_claims_seeds_are_fixed_from_the_pilot_before_any_run():
    """The pilot's spread fixes n: a noisy claim gets more seeds (up to the cap), never depending on results."""
    assert evidence.seeds_needed(0.0084, 0.03, 3, 5) == 3  # claim 5: t(0.95, 2) 0.0084 / sqrt 3 = 0.0142 <= 0.015
    assert evidence.seeds_needed(0.013, 0.03, 3, 5) == 5  # 0.0153 at n = 4 > 0.015, 0.0124 at 5
    assert evidence.seeds_needed(0.05, 0.03, 3, 5) == 5 and evidence.seeds_needed(0.05, 0.03, 3, 4) == 4
    assert all(evidence.seeds_for(claim, 3, 5) == 3 for claim in evidence.PAPER)  # this suite's pilot
    planned = {r["name"] for r in evidence.planned_runs({}, 3, 5)}
    assert "ev_diagonal_per_batch_adamw_mu8_lr0.008_s2" in planned and not any(n.endswith("_s3") for n in planned)


def test_the_test_time_fit_recovers_a_known_curve_and_the_gains_stop_where_the_loss_flattens():
    T = np.array(evidence.CURVE_T, float)
    loss = 1.8 + 0.5 * np.exp(-0.7 * T)
    fit = evidence.fit_test_time(T, loss)
    assert fit["L_inf"] == pytest.approx(1.8, abs=1e-3) and fit["z"] == pytest.approx(0.7, rel=0.02)
    assert fit["error"] < 1e-3
    # 0.5 exp(-0.7 T) <= 1e-3 from T = 8.9 on: the first measured depth there is 12; 1e-4 (T >= 12.2): 16
    assert evidence.gains_stop(dict(curve=dict(T=list(T), loss=list(loss)))) == 12
    assert evidence.gains_stop(dict(curve=dict(T=list(T), loss=list(loss))), 1e-4) == 16
    rising = [1.76, 1.75, 1.753, 1.755, 1.757, 1.758, 1.758, 1.758, 1.758]  # a minimum at T = 2, then up
    assert evidence.gains_stop(dict(curve=dict(T=evidence.CURVE_T, loss=rising))) == 2


def test_the_crossing_is_where_parcae_stays_below():
    def runs(losses):
        return [dict(val=[dict(step=10 * (i + 1), loss=L) for i, L in enumerate(losses)])]
    assert evidence.crossing(runs([3.0, 2.5, 2.0, 1.9]), runs([2.8, 2.4, 2.1, 2.0])) == 30
    assert evidence.crossing(runs([3.0, 2.0, 2.5, 1.9]), runs([2.8, 2.4, 2.1, 2.0])) == 40  # dipped, came back
    assert evidence.crossing(runs([3.0, 2.5]), runs([2.8, 2.4])) is None


def test_the_table_is_replaced_between_its_markers(tmp_path, monkeypatch):
    monkeypatch.setattr(evidence, "TABLE", tmp_path / "table.txt")
    evidence.TABLE.write_text("| new |\n")
    page = tmp_path / "page.txt"
    page.write_text("a\n<!-- evidence-table -->\n| old |\n<!-- /evidence-table -->\nb\n")
    evidence.fill_table(page)
    assert page.read_text() == "a\n<!-- evidence-table -->\n| new |\n<!-- /evidence-table -->\nb\n"
    page.write_text("no markers\n")
    with raises_naming(ValueError, str(page), "<!-- evidence-table -->"):
        evidence.fill_table(page)


def tiny_run():
    """evidence's run at mu_rec 2, cut to 4 steps of a narrow model."""
    run = evidence.make_run(mu_rec=2, seed=0)
    run.update(steps=4, flags=[f for f in run["flags"] if not f.startswith(("--d_model", "--head_dim", "--seq_len",
                                                                             "--max_tokens", "--eval_every"))]
               + ["--d_model=32", "--head_dim=16", "--seq_len=32", f"--total_batch_size={16 * 32}",
                  f"--max_tokens={4 * 16 * 32}", "--eval_every=2"])
    return run


def real_run(folder):
    """tiny_run through train_and_evaluate, in a process of its own (this file as a script) with its base folder in
    folder: the tests beside it change this process's environment -> the folder, the finished process."""
    return folder, python([__file__, str(folder / "log.txt")], {"NANOPARCAE_BASE_DIR": str(folder / "base")})


@pytest.mark.slow
@beforehand(real_run)
def test_a_real_run_its_curve_at_mu_rec_equals_train_pys_own_eval(monkeypatch):
    """A tiny run through train_and_evaluate: the final evaluation's loss at T = mu_rec is train.py's last val loss
    (the same batches and h0), the curve is recorded at every CURVE_T, and load_results reads the run back."""
    folder, result = awaited(real_run)
    assert result.returncode == 0, (folder / "log.txt").read_text()[-3000:] + result.stderr[-3000:]
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(folder / "base"))
    run = tiny_run()
    record = json.loads((evidence.run_dir(run["name"]) / "evidence.json").read_text())
    assert record["curve"]["T"] == evidence.CURVE_T and len(record["curve"]["h_norm"]) == len(evidence.CURVE_T)
    assert [v["step"] for v in record["val"]] == [2, 4] and all(v["loss_T1"] > 0 for v in record["val"])
    assert evidence.depth_loss(record, 2) == pytest.approx(record["val"][-1]["loss"], rel=1e-5)
    loaded = evidence.load_results([run])[run["name"]]
    assert not loaded["diverged"] and loaded["loss"] == record["val"][-1]["loss"] and loaded["curve"] == record["curve"]


def test_the_report_writes_every_claim_per_optimiser_with_its_drift_numbers(tmp_path, monkeypatch):
    """Synthetic records for every planned run (curves for the runs that have one): report writes verdicts.json
    with a row per claim and optimiser, the evidence table, the details page and the six figures."""
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.setattr(evidence, "OUT", tmp_path / "out")
    monkeypatch.setattr(evidence, "TABLE", tmp_path / "out" / evidence.TABLE.name)
    monkeypatch.setattr(evidence, "DETAILS", tmp_path / "out" / evidence.DETAILS.name)
    T = np.array(evidence.CURVE_T, float)
    written = set()
    while True:  # the plan grows once the sweep's records exist (claims 1 and 5)
        runs = [r for r in evidence.all_results(3, 5)[0] if r["name"] not in written]
        if not runs:
            break
        for r in runs:
            loss = 2.0 - 0.05 * (r["injection"] == "diagonal") + 0.01 * r["seed"]
            curve = dict(T=list(T), loss=list(loss + 0.3 * np.exp(-T / r["mu_rec"])), h_norm=list(10 + T)) \
                if r["with_curve"] else None
            fake = record(r, loss=loss, fall=0.1, curve=curve)
            directory = evidence.run_dir(r["name"])
            directory.mkdir(parents=True)
            (directory / "evidence.json").write_text(json.dumps(
                {k: fake[k] for k in ("name", "diverged_at", "max_rho", "max_h_norm", "val", "curve")}))
            written.add(r["name"])
    assert evidence.main(["report"]) == 0
    saved = json.loads((tmp_path / "out" / "verdicts.json").read_text())
    assert [(v["id"], v["optimizer"]) for v in saved["verdicts"]] == evidence.CLAIMS
    for v in saved["verdicts"]:
        assert {"measured", "ci90", "n", "verdict", "reason", "drift"} <= v.keys()
    rdm = saved["verdicts"][1]  # claim 1 under AdamW: concat 0.05 above Parcae at every eval of every seed
    assert rdm["measured"] == pytest.approx(0.05) and rdm["verdict"] == "shown" and rdm["drift"]["long_enough"]
    assert saved["details"]["setup"]["claim1_rate_adamw"] == evidence.RATES[-1]
    assert "| 4 | adamw |" in evidence.TABLE.read_text()
    for name in ("lr_sweep", "depth", "sampling", "transformer", "test_time", "drift"):
        assert (tmp_path / "out" / f"{name}.png").stat().st_size > 5000


if __name__ == "__main__":  # real_run's process: tiny_run, its log at the path given
    sys.exit(0 if evidence.train_and_evaluate(tiny_run(), sys.argv[1], threads=1) else 1)
