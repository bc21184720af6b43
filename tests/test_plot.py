"""Tests for plot.py: it draws from a metrics file as train.py writes it (log axis for a quantity spanning
decades, the diverged run marked), reads a run that stopped mid-line, and a missing run ends in one line; it draws
L(T) from eval_core.py --eval bpb's JSON."""

import json
import math
import os
from pathlib import Path

import pytest

from conftest import carries, python, raises_naming, run_here
from experiments import plot

ROOT = Path(__file__).resolve().parent.parent


def write_run(folder, records, tail=""):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return folder


def step(n, h_norm, loss=5.0):
    return {"step": n, "loss": loss, "lr_mult": 1.0, "adamw_lr": 8e-3, "muon_lr": 8e-3, "grad_norm": 1.0,
            "tokens_per_s": 1e3, "rho": 0.5, "skipped_steps": 0, "h_norm": h_norm, "update_ratio": 0.1}


@pytest.fixture
def runs(tmp_path):
    stable = write_run(tmp_path / "base" / "runs" / "stable", [step(n, 10.0 + n) for n in range(1, 6)] +
                       [{"step": 5, "val_loss_T1": 4.5, "val_bpb_T1": 2.0, "val_loss_T4": 4.2, "val_bpb_T4": 1.9}])
    exploded = write_run(tmp_path / "exploded", [step(1, 10.0), step(2, 1e5), step(3, 1e7, float("nan"))] +
                         [{"step": 3, "diverged_at": 2, "reason": "||h_T|| > 10000"}])
    return stable, exploded


def test_draws_log_axes_for_quantities_spanning_decades_and_marks_the_divergence(runs):
    stable, exploded = (plot.read_run(path) for path in runs)
    assert exploded["diverged_at"] == 2 and [r["step"] for r in exploded["steps"]] == [1, 2, 3]
    assert [values for _, values, _ in plot.series(exploded, "loss")] == [[5.0, 5.0]]  # the NaN is left out
    assert plot.series(stable, "loss")[1][:2] == ([5], [4.2])  # validation at the largest T
    fig = plot.draw({"stable": stable, "exploded": exploded}, ["loss", "rho", "h_norm"])
    loss_ax, rho_ax, h_ax = fig.axes
    assert h_ax.get_yscale() == "log" and rho_ax.get_yscale() == loss_ax.get_yscale() == "linear"
    marks = [line for line in h_ax.lines if line.get_marker() == "x"]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [2] and list(marks[0].get_ydata()) == [1e5]
    assert any(list(line.get_xdata()) == [2, 2] for line in h_ax.lines)  # the dotted line at the step
    assert "| exploded | nan |" in plot.summary_row("exploded", exploded) and \
        plot.summary_row("stable", stable).endswith("| 4.500 / 4.200 (T = 1 / 4) | 0.5 | 15 | - |")


@pytest.mark.slow
def test_cli_reads_a_run_by_name_and_a_run_that_stopped_mid_line(tmp_path, runs):
    cut = write_run(tmp_path / "cut", [step(1, 10.0), step(2, 11.0)], tail='{"step": 3, "loss": 4.')
    assert [r["step"] for r in plot.read_run(cut)["steps"]] == [1, 2]
    out = tmp_path / "figs" / "out.png"
    env = {**os.environ, "NANOPARCAE_BASE_DIR": str(tmp_path / "base")}
    result = python(["-m", "experiments.plot", "stable", str(runs[1]), str(cut), "--metrics=loss,h_norm,rho", "-o",
                     str(out), "--table"], env)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(out.parent.glob("*.tmp.png"))
    assert "| exploded | nan |" in result.stdout and "| cut | 5.000 | - |" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("args,named", [
    (["missing_run"], ["missing_run"]),
    (["stable", "--metrics=loss,perplexity"], ["perplexity"]),
])
def test_a_missing_run_or_metric_ends_in_one_line(tmp_path, runs, args, named):
    env = {**os.environ, "NANOPARCAE_BASE_DIR": str(tmp_path / "base")}
    result = python(["-m", "experiments.plot", *args, "-o", str(tmp_path / "x.png")], env)
    assert result.returncode != 0 and carries(result.stderr, *named), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "x.png").exists()


def test_metrics_that_are_a_folder_unreadable_or_garbage_end_in_one_line_or_are_counted(tmp_path, monkeypatch, capsys):
    """Lines that hold no record (not JSON, not an object, no int step, text for a number, not UTF-8) are skipped
    and counted; the torn last line alone is skipped silently. A folder or an unreadable file is named."""
    import errno
    from nanoparcae.command import EnvironmentFailure
    from nanoparcae.metrics import read_metrics
    path = tmp_path / "noisy" / "metrics.jsonl"
    path.parent.mkdir()
    garbage = ["not json", '{"step": 2, "loss": "x"}', '{"loss": 2.0}', "[1, 2]", '{"step": null, "loss": 1.0}']
    path.write_bytes("\n".join([json.dumps(step(1, 10.0)), *garbage]).encode() + b"\n\xff\xfe\n"
                     + json.dumps(step(3, 11.0)).encode() + b'\n{"step": 4, "lo')
    assert [record["step"] for record in plot.read_run(path.parent)["steps"]] == [1, 3]
    assert carries(capsys.readouterr().err, str(path), "6")

    folder = tmp_path / "folder" / "metrics.jsonl"
    folder.mkdir(parents=True)
    with raises_naming(ValueError, str(folder)):
        read_metrics(folder)
    result = run_here(["-m", "experiments.plot", str(folder.parent), "-o", str(tmp_path / "x.png")], monkeypatch,
                      capsys)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert carries(result.stderr, str(folder)) and not (tmp_path / "x.png").exists()

    opened = Path.open

    def denied(self, *args, **kwargs):  # root reads any file, so its refusal is made here
        if self == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return opened(self, *args, **kwargs)
    monkeypatch.setattr(Path, "open", denied)
    with raises_naming(EnvironmentFailure, str(path)):
        read_metrics(path)


def write_test_time(folder, name, Ts, with_fit=True):
    """A JSON as eval_core.py --eval bpb writes it beside a checkpoint of mu_rec 4."""
    from eval_core import fit_test_time_scaling
    losses = [3.0 + 0.5 * math.exp(-0.9 * T) for T in Ts]
    out = {"ckpt": str(folder / "ckpt_000390.pt"), "step": 390, "T": Ts, "loss": losses, "data": "stdlib"}
    if with_fit:
        out["fit"] = {**fit_test_time_scaling(Ts, losses), "loss_at_mu_rec": losses[Ts.index(4)], "mu_rec": 4}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(out))
    return folder / name


def test_test_time_draws_the_newest_fit_beside_its_json(tmp_path, monkeypatch, capsys):
    """python -m experiments.plot --test_time: no RUN takes the newest evaluation of every run, a RUN its newest,
    a .json that file; the PNG goes beside the JSON, or to -o."""
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(tmp_path / "base"))
    runs = tmp_path / "base" / "runs"
    older = write_test_time(runs / "a", "ckpt_000390_bpb_T1-2-4-8-16-32.json", [1, 2, 4, 8, 16, 32])
    os.utime(older, (1, 1))
    newest = write_test_time(runs / "b", "ckpt_000390_bpb_T1-2-4.json", [1, 2, 4])
    plot.main(["--test_time"])
    png = newest.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert capsys.readouterr().out == f"wrote {png}: L(T) of {newest}\n"
    plot.main(["--test_time", "a"])
    assert older.with_suffix(".png").is_file() and sorted(p.name for p in (runs / "a").iterdir()) == \
        [older.name, older.with_suffix(".png").name]  # the temporary file was renamed
    plot.main(["--test_time", str(older), "-o", str(tmp_path / "figs" / "L.png")])
    assert (tmp_path / "figs" / "L.png").is_file()


@pytest.mark.parametrize("make,named", [  # what is missing, and the command or the depths that make it
    (lambda runs: None, ["python eval_core.py --eval bpb", "c"]),
    (lambda runs: write_test_time(runs / "c", "ckpt_000390_bpb_T1-2-4.json", [1, 2, 4], with_fit=False),
     ["ckpt_000390_bpb_T1-2-4.json", "L(T)", "3"]),
])
def test_test_time_without_a_fit_ends_in_one_line(tmp_path, monkeypatch, make, named):
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(tmp_path / "base"))
    make(tmp_path / "base" / "runs")
    with pytest.raises((FileNotFoundError, ValueError)) as err:
        plot.main(["--test_time", "c"])
    assert "\n" not in str(err.value) and carries(str(err.value), *named), err.value
