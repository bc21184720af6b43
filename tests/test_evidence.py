"""evidence.py: the judging of claims from paired runs, on synthetic records, and one tiny real run through
train.py and the final evaluation. The interval itself is tested in tests/test_scaling.py."""

import json
import math

import numpy as np
import pytest

import evidence


def record(run, loss=2.0, diverged=False, fall=0.0, curve=None):
    """A finished run as load_results returns it: evals at 60% / 80% / 100% of the steps."""
    steps = run["steps"]
    val = [dict(step=int(f * steps), loss=loss + fall * (1 - f) / 0.2) for f in (0.6, 0.8, 1.0)]
    return dict(run, val=val, diverged=diverged, diverged_at=5 if diverged else None, curve=curve,
                loss=evidence.UNIFORM_LOSS if diverged else loss, max_rho=0.5, max_h_norm=10.0, train_loss=[])


def results_of(pairs, claim):
    """{name: record} for claim's arms, one (loss A, loss B) per seed, plus kwargs per arm."""
    arms = evidence.claim_arms({})[claim]
    out = {}
    for seed, (a, b) in enumerate(pairs):
        for arm, kwargs in zip(arms, (a, b)):
            r = record(arm(seed), **kwargs)
            out[r["name"]] = r
    return out


def test_a_clear_paired_difference_is_shown_even_when_the_seeds_spread():
    """Seeds move both arms together by up to 0.3 nats; the within-seed difference of 0.05 is shown."""
    offsets, gaps = [0.0, 0.3, -0.2], [0.05, 0.052, 0.048]
    results = results_of([(dict(loss=2 + o + g), dict(loss=2 + o)) for o, g in zip(offsets, gaps)], "3a")
    judged = evidence.judge("3a", results, 3)
    assert judged["verdict"] == "shown" and judged["n"] == 3 and judged["measured"] == pytest.approx(0.05)
    assert judged["ci90"][0] > 0.04 and judged["ci90"][1] < 0.06
    flipped = results_of([(dict(loss=2 + o), dict(loss=2 + o + g)) for o, g in zip(offsets, gaps)], "3a")
    assert evidence.judge("3a", flipped, 3)["verdict"] == "opposite"
    assert evidence.judge("3a", results, 4) is None  # seed 3 has not run


def test_a_difference_smaller_than_the_late_fall_is_not_shown():
    """The loss still fell 0.2 over the last 20% of the steps: a 0.05 gap is not a verdict."""
    results = results_of([(dict(loss=2.05 + 0.001 * s, fall=0.2), dict(loss=2.0, fall=0.2)) for s in range(3)], "3a")
    judged = evidence.judge("3a", results, 3)
    assert judged["verdict"] == "not shown" and "still falling" in judged["reason"]
    assert "the interval alone would say shown" in judged["reason"] and judged["ci90"][0] > 0
    assert judged["late_fall"] == pytest.approx(0.2)
    assert evidence.seeds_wanted("3a", results, 3, 5) == 3  # more seeds cannot make a run longer


def test_a_diverged_run_counts_as_a_uniform_guess():
    results = results_of([(dict(diverged=True), dict(loss=2.0)) for _ in range(3)], "1")
    judged = evidence.judge("1", results, 3)
    assert judged["measured"] == pytest.approx(math.log(259) - 2.0) and judged["verdict"] == "shown"


def test_an_interval_holding_zero_and_wider_than_the_papers_effect_asks_for_another_seed():
    """Claim 5 (paper: 0.03 nats): noisy pairs around 0 want a 4th seed, then a 5th, never more than max_seeds;
    a clear result keeps 3."""
    noisy = [0.1, -0.1, 0.05, -0.02, 0.08]
    results = {}
    rate = evidence.RATES[0]
    for seed, gap in enumerate(noisy):
        for norm, loss in ((0, 2.0 + gap), (1, 2.0)):
            r = record(evidence.make_run("diagonal", rate, seed, prelude_norm=norm), loss=loss)
            results[r["name"]] = r
    for r in evidence.sweep_runs():  # the sweep: without the norm, every rate but the lowest diverged
        if r["name"] not in results:
            results[r["name"]] = record(r, diverged=r["injection"] == "diagonal" and not r["prelude_norm"])
    assert evidence.norm_rate(results) == rate
    assert evidence.seeds_wanted("5", results, 3, 5) == 5
    assert evidence.seeds_wanted("5", results, 3, 4) == 4
    clear = results_of([(dict(loss=2.1 + 0.001 * s), dict(loss=2.0)) for s in range(3)], "3a")
    assert evidence.seeds_wanted("3a", clear, 3, 5) == 3


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


def test_the_readme_table_is_replaced_between_its_markers(tmp_path, monkeypatch):
    monkeypatch.setattr(evidence, "TABLE", tmp_path / "table.txt")
    evidence.TABLE.write_text("| new |\n")
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- evidence-table -->\n| old |\n<!-- /evidence-table -->\nb\n")
    evidence.write_readme_table(readme)
    assert readme.read_text() == "a\n<!-- evidence-table -->\n| new |\n<!-- /evidence-table -->\nb\n"
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="no <!-- evidence-table --> ... <!-- /evidence-table --> block"):
        evidence.write_readme_table(readme)


def test_a_real_run_its_curve_at_mu_rec_equals_train_pys_own_eval(tmp_path):
    """A tiny run through train_and_evaluate: the final evaluation's loss at T = mu_rec is train.py's last val loss
    (the same batches and h0), the curve is recorded at every CURVE_T, and load_results reads the run back."""
    run = evidence.make_run(mu_rec=2, seed=0)
    run.update(steps=4, flags=[f for f in run["flags"] if not f.startswith(("--d_model", "--head_dim", "--seq_len",
                                                                             "--max_tokens", "--eval_every"))]
               + ["--d_model=32", "--head_dim=16", "--seq_len=32", f"--total_batch_size={16 * 32}",
                  f"--max_tokens={4 * 16 * 32}", "--eval_every=2"])
    assert evidence.train_and_evaluate(run, tmp_path / "log.txt", threads=1), (tmp_path / "log.txt").read_text()
    record = json.loads((evidence.run_dir(run["name"]) / "evidence.json").read_text())
    assert record["curve"]["T"] == evidence.CURVE_T and len(record["curve"]["h_norm"]) == len(evidence.CURVE_T)
    assert [v["step"] for v in record["val"]] == [2, 4]
    assert evidence.depth_loss(record, 2) == pytest.approx(record["val"][-1]["loss"], rel=1e-5)
    loaded = evidence.load_results([run])[run["name"]]
    assert not loaded["diverged"] and loaded["loss"] == record["val"][-1]["loss"] and loaded["curve"] == record["curve"]
