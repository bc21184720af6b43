"""Tests for scaling.py: the fitters recover known laws from noisy synthetic points, the plan's arithmetic gives
back C, a killed sweep resumes without retraining finished points, fit survives missing and diverged runs."""

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import scaling  # noqa: E402

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
        budgets[C] = scaling.parabola_optimum(mu, losses, D)
        assert budgets[C]["vertex_inside"]
    laws = scaling.fit_power_laws(budgets, notes := [])
    assert not notes
    assert abs(laws["mu_rec"]["exponent"] - g_mu) < 0.05
    assert abs(laws["D"]["exponent"] - (1 - g_mu)) < 0.05
    assert laws["mu_rec"]["held_out"]["relative_error"] < 0.1 and laws["D"]["held_out"]["relative_error"] < 0.1


def synthetic_unified(rng, mus=(2, 3, 4, 6, 8), Ds=(1e8, 3e8, 1e9, 3e9), Ts=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16)):
    rows = [(mu, D, T) for mu in mus for D in Ds for T in Ts]
    mu, D, T = (np.array(v, float) for v in zip(*rows))
    clean = scaling.unified_predict(LAW, mu, D, T)
    return mu, D, T, clean * (1 + 1e-3 * rng.standard_normal(clean.size))


def test_unified_law_recovers_its_parameters_and_predicts_held_out_models():
    mu, D, T, L = synthetic_unified(np.random.default_rng(1))
    train, held = D < 3e9, D == 3e9  # the largest data budget is held out, as fit_unified_law does with C
    params = scaling.fit_unified(mu[train], D[train], T[train], L[train])
    assert abs(params["x"] - LAW["x"]) < 0.05 and abs(params["y"] - LAW["y"]) < 0.05
    assert abs(params["z"] - LAW["z"]) < 0.1 * LAW["z"]
    assert scaling.mean_relative_error(scaling.unified_predict(params, mu[train], D[train], T[train]), L[train]) < 2e-3
    assert scaling.mean_relative_error(scaling.unified_predict(params, mu[held], D[held], T[held]), L[held]) < 5e-3


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
        C, mu, fpt, tokens, steps = (float(cell.replace(",", "")) for cell in row.strip("|").split("|")[:5])
        assert f"--mu_rec={int(mu)} " in command and f"--target_flops={C:g}" in command
        params, exact_fpt = scaling.model_size(dict(depth=6, model=scaling.PAPER_MODEL), int(mu))
        assert abs(fpt - exact_fpt) / exact_fpt < 1e-4  # printed to 5 significant digits
        assert abs(tokens * exact_fpt - C) <= exact_fpt  # tokens printed to the unit
        trained = steps * scaling.PAPER_BATCH * exact_fpt
        assert C - scaling.PAPER_BATCH * exact_fpt < trained <= C  # within one step's tokens


# -----------------------------------------------------------------------------
# A toy sweep: resume, and fit with a missing and a diverged run

TOY = dict(depth=3, flops=[1.2e9, 2.4e9, 4.8e9], mu_rec=[1, 2, 3], T=[1, 2, 3, 4], batch=256,
           model=dict(d_model=64, head_dim=32, vocab_size=320, seq_len=32),
           train_args=["--device_batch_size=4", "--eval_every=1000", "--eval_tokens=256", "--save_every=1",
                       "--log_every=1", "--core_every=-1", "--compile=0"],
           eval_args=["--val_tokens=256", "--batch_size=4"], name="toy")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("scaling")
    rng = random.Random(0)
    words = ["loop", "state", "depth", "token", "model", "stable", "the", "a", "of", "is", "and", "runs", "step"]
    (root / "corpus.txt").write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(20, 80)))
                                                 for _ in range(300)))
    sweep = dict(TOY, train_args=TOY["train_args"] + [f"--data={root / 'corpus.txt'}"])
    return root, sweep


def in_base(root, monkeypatch):
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(root / "base"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_killed_sweep_resumes_without_retraining_finished_points(toy, monkeypatch, capsys):
    root, sweep = toy
    in_base(root, monkeypatch)
    small = dict(sweep, flops=sweep["flops"][:1], mu_rec=[1, 2])
    first, second = scaling.points(small)
    assert first["steps"] >= 3 and second["steps"] >= 3
    # the sweep was killed inside its second point: the first finished, the second left a checkpoint at step 2
    scaling.run(dict(small, mu_rec=[1]), gpus=0)
    cmd = [sys.executable, "train.py"] + scaling.train_flags(small, second) + ["--stop_at=2"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    finished_ckpt = next(scaling.run_dir(first).glob("ckpt_*.pt"))
    mtime = finished_ckpt.stat().st_mtime_ns
    capsys.readouterr()
    scaling.run(small, gpus=0)
    out = capsys.readouterr().out
    assert f"{first['name']} (C" in out and "done, skipped" in out.splitlines()[0]
    assert "resuming" in out.splitlines()[1]
    assert finished_ckpt.stat().st_mtime_ns == mtime
    assert (scaling.run_dir(first) / "train.log").read_text().count("done:") == 1
    assert f"resumed {second['name']} at step 2" in (scaling.run_dir(second) / "train.log").read_text()
    assert scaling.final_eval(second) is not None and scaling.bpb_result(second, small["T"]) is not None


def fake_runs(sweep):
    """The files train.py and eval_core.py leave, with losses from the unified law: fit reads nothing else."""
    for p in scaling.points(sweep):
        curve = [float(scaling.unified_predict(LAW, p["mu_rec"], p["trained_tokens"], T)) for T in sweep["T"]]
        run = scaling.run_dir(p)
        run.mkdir(parents=True)
        record = {"step": p["steps"], f"val_loss_T{p['mu_rec']}": curve[sweep["T"].index(p["mu_rec"])]}
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n" + json.dumps(record) + "\n")
        (run / f"ckpt_{p['steps']:06d}_bpb_T1-2-3-4.json").write_text(
            json.dumps({"step": p["steps"], "T": sweep["T"], "loss": curve}))


def test_fit_notes_missing_and_diverged_runs_and_draws_the_figures(tmp_path, monkeypatch, capsys):
    in_base(tmp_path, monkeypatch)
    sweep = dict(TOY, mu_rec=[1, 2, 3, 4])
    fake_runs(sweep)
    missing, diverged = scaling.points(sweep)[-1], scaling.points(sweep)[-2]
    (scaling.run_dir(missing) / "metrics.jsonl").unlink()
    with open(scaling.run_dir(diverged) / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": diverged["steps"], f"val_loss_T{diverged['mu_rec']}": math.nan}) + "\n")
    result = scaling.fit(sweep)
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 3 and len(result["notes"]) == 3
    assert diverged["name"] in notes[0] and "diverged" in notes[0]
    assert missing["name"] in notes[1] and "missing" in notes[1]
    assert "C=4.8e+09 has 2 finished runs" in notes[2]  # so the largest budget has no parabola
    assert len(result["runs"]) == 10 and len(result["budgets"]) == 2  # the largest budget kept only 2 runs
    assert result["unified"]["held_out_error"] < 1e-3  # the points lie on the law
    out_dir = tmp_path / "base" / "scaling" / "toy"
    for name in ("isoflop.png", "optimal.png", "test_time.png", "frontier.png"):
        assert (out_dir / name).stat().st_size > 5000
    assert json.loads((out_dir / "fit.json").read_text())["notes"] == result["notes"]


def test_bad_flags_end_in_one_line():
    result = subprocess.run([sys.executable, "scaling.py", "fit", "--mu_rec=1,x"], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and "--mu_rec" in result.stderr


def test_fit_with_no_finished_run_names_the_run_command_and_writes_nothing(tmp_path, monkeypatch, capsys):
    in_base(tmp_path, monkeypatch)
    with pytest.raises(SystemExit) as exit:
        scaling.main(["fit", "--preset=cpu"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "no finished run of sweep 'cpu'" in err and err.strip().endswith("python scaling.py run --preset=cpu")
    assert not (tmp_path / "base" / "scaling").exists()  # no empty fit.json, no empty figures
