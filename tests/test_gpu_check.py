"""experiments/gpu_check.py, the table of runs/gpu_check.sh, built from stage outputs: a time-out, a crash, a missing
stage, the kill and the resume against an unbroken run, the bf16 difference, the device batch it reads from train.py
--dry_run's plan, sampling's overhead at that batch; its exit status, held to the targets a CPU can meet and, on a GPU,
to the GPU's; and the three faults the script injects, each caught: a real train.py run with dynamo's recompile limits
forced low, a real checkpoint with a weight perturbed, and real runs of two processes, one reading another data order,
against one. runs/test.sh runs `bash runs/gpu_check.sh --tiny` itself, every stage on a CPU."""

import json
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, TINY, awaited, beforehand, python, train_env, write_corpus
from experiments import gpu_check
from model import Parcae, ParcaeConfig
from nanoparcae.checkpoint import save_checkpoint

NUMBERS = ["1", "2a", "2b", "2c", "2d", "2e", "2f", "2g", "3a", "3b", "4a", "4b", "4c", "4d", "4e", "4f", "5"]
DRY_RUN = ("steps: 198364 x 524,288 tokens = 1 process(es) x 8 micro-batch(es) x 32 x 2048 | data: fineweb-edu\n"
           "memory per GPU (GB): weights 5.4 + grads 5.4 + DDP buckets 5.4 + optimizer 8.0 + activations 294.7 (32 x "
           "2048 at mu_bwd 4, bfloat16) = 318.8 | largest device batch: 5 in 80 GB, 11 in 141 GB\n")
DRY_RUN_AT_4 = DRY_RUN.replace("294.7 (32 x", "36.8 (4 x").replace("= 318.8", "= 61.0")
# bench.py's rows as --json writes them: figures that miss the GPU's targets, and its own verdicts
STEP = {"Parcae per-sequence": {"flops": 8e8, "mfu_measured": 0.05}, "Parcae fixed depth": {"flops": 8.4e8},
        "Transformer": {"flops": 1e9}, "matmul_rate": 5e10}
BENCH = {"sizes": "tiny", "figures": {"step": STEP, "sampling_overhead": 0.25},
         "rows": [["9", "the step", "measured 50 GFLOP/s", "", ""], ["9a", "per-sequence", "1 ktok/s", "+5%", ""],
                  ["9b", "fixed depth", "1.1 ktok/s", "", ""], ["9c", "Transformer", "2 ktok/s", "", ""],
                  ["3b", "sampling", "per-sequence", "overhead +25%", ""],
                  ["4", "memory", "T=8: 9 MB", "max/min 1.00x", "flat within 10%: met"],
                  ["5a", "decoding depth", "auto", "-64%", "time saved >= steps saved - 20%: not met"],
                  ["5b", "KV cache", "T=8", "1.03x concat", ">= 1.5x concat: not met"],
                  ["7", "torch.compile", "0 recompilations", "1.01x", "none after step 11: met"]]}
SAMPLING = {"sizes": "tiny", "figures": {"sampling_overhead": 0.25},  # row 3 again, at the plan's device batch
            "rows": [["3a", "sampling, 4 sequences per micro-batch", "per-sequence", "overhead +9.0%", "paper: +1.8%"],
                     ["3b", "sampling, 32 sequences per micro-batch", "per-sequence", "overhead +25%", "paper: +1.8%"]]}
LOSSES = [6.0 - 0.1 * step for step in range(16)]
EVALS = [{"step": 16, "val_loss_T1": 4.5, "val_loss_T8": 4.25, "graphs": 5, "recompile_limits": 0}]
CORE = {"runs": [{"T": 8, "core": 0.125}]}  # what eval_core.py keeps beside the checkpoint


def table_rows(table):
    """{number: (check, result, target)} of a gpu_check table; the header and rule lines checked first."""
    lines = table.strip().splitlines()
    assert lines[0].startswith("| # | runs/gpu_check.sh") and lines[1] == "|---|---|---|---|"
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]
    assert all(len(row) == 4 for row in rows), lines
    return {row[0]: tuple(row[1:]) for row in rows}


def write_stage(work, name, status=0, limit=60, log=""):
    (work / f"{name}.rc").write_text(f"{status} {limit}\n")
    (work / f"{name}.log").write_text(log)


def write_steps(runs_dir, name, losses, first_step=1, extra=(), **fields):
    """metrics.jsonl of run gpu_check_NAME: one record per loss from first_step on, then the `extra` records."""
    run = runs_dir / f"gpu_check_{name}"
    run.mkdir(parents=True, exist_ok=True)
    records = [{"step": step, "loss": loss, "tokens_per_s": 1000.0, **fields}
               for step, loss in enumerate(losses, first_step)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*records, *extra]))


def write_checkpoints(runs_dir, step=16):
    """The same real checkpoint of a tiny model at `step` in runs gpu_check_ddp and gpu_check_unbroken."""
    torch.manual_seed(0)
    model = Parcae(ParcaeConfig.from_depth(depth=3, d_model=64, head_dim=32, mu_rec=3, vocab_size=320, seq_len=32))
    paths = [runs_dir / f"gpu_check_{name}" / f"ckpt_{step:06d}.pt" for name in ("ddp", "unbroken")]
    for path in paths:
        save_checkpoint(path, model, step=step)
    return paths


def write_passing_check(work, runs_dir):
    """Every stage's output as a passing --tiny check leaves it: killed at step 3, resumed at step 2, to step 16."""
    work.mkdir()
    for name in ("plan", "plan_at", "step24", "ddp", "ddp_resume", "core", "unbroken", "world", "world_one", "fp32",
                 "bf16", "bench", "sampling"):
        write_stage(work, name)
    (work / "bench.json").write_text(json.dumps(BENCH))
    (work / "sampling.json").write_text(json.dumps(SAMPLING))
    (work / "plan.log").write_text(DRY_RUN)
    (work / "plan_at.log").write_text(DRY_RUN_AT_4)
    (work / "ddp.log").write_text("steps: 16 x 1,024 tokens = 2 process(es) x 2 micro-batch(es) x 4 x 64\n"
                                  "== ddp: killed the workers at step 3\n")
    (work / "ddp_resume.log").write_text("resumed gpu_check_ddp at step 2, from ckpt_000002.pt\n")
    write_steps(runs_dir, "ddp", LOSSES, extra=EVALS, graphs=4, recompile_limits=0)
    (runs_dir / "gpu_check_ddp" / "ckpt_000016_core_T8.json").write_text(json.dumps(CORE))
    write_steps(runs_dir, "unbroken", LOSSES, graphs=4, recompile_limits=0)
    write_steps(runs_dir, "step24", [5.9], peak_memory=58e9)
    for name in ("world", "world_one"):
        write_steps(runs_dir, name, LOSSES[:3])
    write_steps(runs_dir, "fp32", [6.0, 5.0, 4.0])
    write_steps(runs_dir, "bf16", [6.0, 5.1, 4.0])  # 2% apart: the GPU's target missed
    return write_checkpoints(runs_dir)


def check(capsys, work, runs_dir, *flags):
    """gpu_check's exit status and table rows for these stage outputs (2 processes, 80 GB, and flags)."""
    status = gpu_check.main(["table", str(work), str(runs_dir), "--gpus", "2", "--memory", str(80 * 10**9), *flags])
    return status, table_rows(capsys.readouterr().out)


def test_the_device_batch_of_the_plan():
    # train.py plans the default 32, which does not fit: the largest size dividing the step's 256 sequences that does
    assert gpu_check.planned_batch(DRY_RUN, 80e9) == 4 and gpu_check.planned_batch(DRY_RUN, 150e9) == 8
    assert gpu_check.planned_batch(DRY_RUN_AT_4, 80e9) == 4  # a plan at a size that fits is train.py's choice
    assert gpu_check.planned_batch(DRY_RUN, 40e9) is None  # no GPU size it lists fits within 40 GB
    assert gpu_check.plan_figures(DRY_RUN_AT_4) == (4, 61.0, {80: 5, 141: 11})
    assert gpu_check.plan_figures("no plan here") == (None, None, {})


def test_a_cpu_holds_the_run_to_its_targets_and_only_reports_the_gpus_figures(tmp_path, capsys):
    work, runs_dir = tmp_path / "work", tmp_path / "runs"
    write_passing_check(work, runs_dir)
    status, rows = check(capsys, work, runs_dir, "--tiny")
    assert list(rows) == NUMBERS and status == 0, rows
    for number in ("2a", "2b", "2c", "2e", "2f", "3a", "5"):  # each misses its target here, unjudged on a CPU
        assert rows[number][2].endswith(": not judged (no GPU)"), rows[number]
    assert rows["2d"][2] == "flat within 10%: met" and rows["2g"][2] == "none after step 11: met"
    # the throughput rows are bench.py's row 9, the step train.py runs
    assert rows["2a"][1] == "Parcae 1 ktok/s; Transformer 2 ktok/s; FLOP/s 0.80x"
    assert rows["2b"][1] == "measured 50 GFLOP/s; Parcae 5.0% of the measured rate"
    assert rows["1"][1].endswith("matmul 50 GFLOP/s")
    assert rows["3a"][1] == "device batch 4: plan 61.0 GB per GPU, a GPU faked to report 80 GB free; peak: no GPU"
    assert rows["4a"][1:] == ("loss 5.800 -> 4.700 (means of steps 1-5 and 12-16)", "falls: met")
    assert rows["4b"][1:] == ("graphs 4 after step 3, 4 after step 12, 4 after step 16, 5 after the eval; recompile "
                              "limit hit 0 time(s), no warning", "no graph after step 12, no limit hit: met")
    assert rows["4d"][1:] == ("killed at step 3; resumed at step 2, ended at step 16; steps 1-16 logged once each; "
                              "against the unbroken run: losses equal, weights at step 16 equal",
                              "resumes, each step once, equal: met")
    assert rows["4e"][1] == "step 16: val loss T=1 4.500, T=8 4.250; CORE 0.125 at T=8"
    assert rows["2c"][1].endswith("At the plan's 4: per-sequence; overhead +9.0%"), rows["2c"]
    assert rows["4f"][1:] == ("2 processes 6.0000, 5.9000, 5.8000; one process 6.0000, 5.9000, 5.8000; largest "
                              "relative difference 0.0e+00", "within 0.001 (relative, each step): met")
    assert "largest 2.000%" in rows["5"][1] and "step 1 0.000%" in rows["5"][1]

    for name in ("ddp", "unbroken"):  # a held target missed: the loss does not fall
        write_steps(runs_dir, name, [6.0] * 16, extra=EVALS if name == "ddp" else (), graphs=4, recompile_limits=0)
    status, rows = check(capsys, work, runs_dir, "--tiny")
    assert [number for number, row in rows.items() if row[2].endswith(": not met") or "failed" in row[1]] == ["4a"]
    assert status == 1


def test_a_gpu_is_held_to_its_figures(tmp_path, capsys, monkeypatch):
    work, runs_dir = tmp_path / "work", tmp_path / "runs"
    write_passing_check(work, runs_dir)
    monkeypatch.setattr(gpu_check, "CUDA", True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    status, rows = check(capsys, work, runs_dir)
    assert status == 1
    assert [number for number, row in rows.items() if row[2].endswith(": not met")] == ["2a", "2b", "2c", "2e",
                                                                                        "2f", "5"]
    assert rows["3a"][1:] == ("device batch 4: plan 61.0 GB per GPU, this GPU's 80 GB free; peak 58.0 GB (-5%)",
                              "peak within 15% of the plan: met")
    write_steps(runs_dir, "step24", [5.9], peak_memory=75e9)
    assert check(capsys, work, runs_dir)[1]["3a"][2] == "peak within 15% of the plan: not met"  # +23%


def test_failed_stages_say_why_and_fail_the_check(tmp_path, capsys):
    work, runs_dir = tmp_path / "work", tmp_path / "runs"
    write_passing_check(work, runs_dir)
    write_stage(work, "bench", status=124, limit=200)  # timed out before its first row
    (work / "bench.json").unlink()
    write_stage(work, "step24", status=1, log="step 1/2\nTraceback (most recent call last):\n  File x\n"
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n[rank0] teardown\n")
    (work / "ddp.rc").unlink()
    (runs_dir / "gpu_check_bf16" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 6.2}) + "\n")
    status, rows = check(capsys, work, runs_dir, "--tiny")
    assert status == 1
    assert rows["2a"][1] == "failed: bench timed out after 200 s"
    assert rows["1"][1].endswith("matmul failed: bench timed out after 200 s")  # the versions themselves print
    assert rows["3b"][1] == ("failed: step24 exited 1: torch.OutOfMemoryError: CUDA out of memory. "
                             "Tried to allocate 2 GiB")
    assert rows["4a"][1] == rows["4b"][1] == rows["4d"][1] == "failed: stage ddp did not run"
    assert rows["2c"][1] == "failed: bench timed out after 200 s"
    assert rows["5"][1] == "failed: the runs logged different steps: [1, 2, 3] and [1]"


def test_a_resume_that_is_not_the_unbroken_run_fails_4d(tmp_path, capsys, monkeypatch):
    work, runs_dir = tmp_path / "work", tmp_path / "runs"
    resumed, _ = write_passing_check(work, runs_dir)
    assert gpu_check.perturb_checkpoint(resumed) == "wte.weight"  # the fault GPU_CHECK_FAULT=perturb_resume
    status, rows = check(capsys, work, runs_dir, "--tiny")
    assert rows["4d"][1].endswith("losses equal, weights at step 16 1.0e-02 apart (relative)"), rows["4d"]
    assert rows["4d"][2] == "resumes, each step once, equal: not met" and status == 1
    monkeypatch.setattr(gpu_check, "CUDA", True)  # a GPU's tolerance is 1e-3: the fault still fails it
    assert gpu_check.kill_and_resume(work, runs_dir, SimpleNamespace(gpus=2, tiny=True))[2].endswith(": not met")

    write_checkpoints(runs_dir)
    write_steps(runs_dir, "unbroken", [*LOSSES[:8], LOSSES[8] * (1 + 1e-4), *LOSSES[9:]])
    row = gpu_check.kill_and_resume(work, runs_dir, SimpleNamespace(gpus=2, tiny=True))
    assert row[1].endswith("losses 1.0e-04 apart (relative), weights at step 16 equal") and row[2].endswith(": met")
    monkeypatch.setattr(gpu_check, "CUDA", False)  # on a CPU nothing short of equal
    assert gpu_check.kill_and_resume(work, runs_dir, SimpleNamespace(gpus=2, tiny=True))[2].endswith(": not met")

    # a resume that redid a step twice; one that stopped short of the unbroken run's last step
    steps = [1, 2, 3, 3, *range(4, 17)]
    (runs_dir / "gpu_check_ddp" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "loss": 5.0, "graphs": 4}) + "\n" for step in steps))
    status, rows = check(capsys, work, runs_dir, "--tiny")
    assert "logged out of order or twice" in rows["4d"][1] and rows["4d"][2].endswith(": not met") and status == 1
    write_steps(runs_dir, "ddp", LOSSES[:15])
    assert check(capsys, work, runs_dir, "--tiny")[1]["4d"][1] == ("failed: the resumed run logged steps 1-15, the "
                                                                    "unbroken one 1-16")


def low_limits_run(folder):
    """A real train.py run with dynamo's recompile limits forced to 2 as the fault GPU_CHECK_FAULT=recompile_limit
    forces them -> the folder, the finished process."""
    write_corpus(folder / "corpus.txt")
    faulty = ["-m", "experiments.gpu_check", "run", "--fault=recompile_limit", str(ROOT / "train.py")]
    return folder, python([*faulty, f"--data={folder / 'corpus.txt'}", *TINY, "--compile=1",
                           "--compile_backend=eager", "--max_tokens=256", "--run=low_limits"], train_env(folder))


@pytest.mark.slow
@beforehand(low_limits_run)
def test_a_recompile_limit_hit_fails_4b_though_the_graph_count_stays_flat(tmp_path, capsys):
    """That run's counters and its warning both fail 4b, each on its own."""
    work, runs_dir = tmp_path / "work", tmp_path / "runs"
    write_passing_check(work, runs_dir)
    folder, result = awaited(low_limits_run)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hit config." in result.stderr
    real = json.loads((folder / "base" / "runs" / "low_limits" / "metrics.jsonl").read_text().splitlines()[-1])
    assert real["recompile_limits"] >= 1, real

    # its counters in every record, the graph count flat: 4b not met
    write_steps(runs_dir, "ddp", LOSSES, graphs=real["graphs"], recompile_limits=real["recompile_limits"])
    status, rows = check(capsys, work, runs_dir, "--tiny")
    assert rows["4b"][1].endswith(f"recompile limit hit {real['recompile_limits']} time(s), no warning"), rows["4b"]
    assert rows["4b"][2].endswith(": not met") and status == 1
    # its warning alone, in the resumed command's log: 4b not met
    write_steps(runs_dir, "ddp", LOSSES, graphs=4, recompile_limits=0)
    (work / "ddp_resume.log").write_text("resumed gpu_check_ddp at step 2, from ckpt_000002.pt\n" + result.stderr)
    status, rows = check(capsys, work, runs_dir, "--tiny")
    warnings = gpu_check.limit_warnings(work, ["ddp_resume"])
    assert warnings and all(warning.endswith("(2)") for warning in warnings), warnings
    assert f"dynamo hit config.{warnings[0]}" in rows["4b"][1] and rows["4b"][2].endswith(": not met")
    assert status == 1


def rank_order_runs(folder):
    """Real train.py runs on the stdlib corpus (many chunks), as runs/gpu_check.sh starts them: one process with two
    micro-batches, then two processes with one each, with GPU_CHECK_FAULT=rank_order's fault (rank 1 reads the chunks
    in reverse order), then without -> the stage outputs, the runs with the fault and the runs without it."""
    work, base = folder / "work", folder / "base"
    write_passing_check(work, base / "runs")
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--no_python", "--",
                sys.executable]
    flags = ["--data=stdlib", *TINY, "--max_tokens=768"]  # 3 steps of 2 micro-batches of 4 x 32

    def run(name, launch):
        shutil.rmtree(base / "runs" / f"gpu_check_{name}")  # write_passing_check's, or the last run's
        result = python([*launch, *flags, f"--run=gpu_check_{name}"], train_env(folder, base))
        assert result.returncode == 0, result.stderr[-3000:]

    run("world_one", [str(ROOT / "train.py")])
    run("world", [*torchrun, "-m", "experiments.gpu_check", "run", "--fault=rank_order", str(ROOT / "train.py")])
    shutil.copytree(base / "runs", folder / "faulty_runs")
    run("world", [*torchrun, str(ROOT / "train.py")])
    return work, folder / "faulty_runs", base / "runs"


@pytest.mark.slow
@beforehand(rank_order_runs)
def test_a_rank_that_reads_another_order_fails_4f(capsys):
    """With the fault 4f is not met; without it, met."""
    work, faulty_runs, runs = awaited(rank_order_runs)
    status, rows = check(capsys, work, faulty_runs, "--tiny")
    assert rows["4f"][2] == "within 0.001 (relative, each step): not met" and status == 1, rows["4f"]
    status, rows = check(capsys, work, runs, "--tiny")
    assert rows["4f"][2] == "within 0.001 (relative, each step): met" and status == 0, rows["4f"]
