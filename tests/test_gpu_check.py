"""experiments/gpu_check.py, the table of runs/gpu_check.sh, built from stage outputs written by hand: a time-out, a
crash, a missing stage, the kill and the resume, the bf16 difference; and the device batch it reads from train.py
--dry_run's plan. runs/test.sh runs `bash runs/gpu_check.sh --tiny` itself, every stage on a CPU, before the tests."""

import json

from experiments import gpu_check

NUMBERS = ["1", "2a", "2b", "2c", "2d", "2e", "2f", "2g", "3a", "3b", "4a", "4b", "4c", "4d", "4e", "5"]
DRY_RUN = ("steps: 198364 x 524,288 tokens = 1 process(es) x 8 micro-batch(es) x 32 x 2048 | data: fineweb-edu\n"
           "memory per GPU (GB): weights 5.4 + grads 5.4 + DDP buckets 5.4 + optimizer 8.0 + activations 294.7 (32 x "
           "2048 at mu_bwd 4, bfloat16) = 318.8 | largest device batch: 5 in 80 GB, 11 in 141 GB\n")
DRY_RUN_AT_4 = DRY_RUN.replace("294.7 (32 x", "36.8 (4 x").replace("= 318.8", "= 61.0")


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


def test_the_device_batch_of_the_plan():
    # train.py plans the default 32, which does not fit: the largest size dividing the step's 256 sequences that does
    assert gpu_check.planned_batch(DRY_RUN, 80e9) == 4 and gpu_check.planned_batch(DRY_RUN, 150e9) == 8
    assert gpu_check.planned_batch(DRY_RUN_AT_4, 80e9) == 4  # a plan at a size that fits is train.py's choice
    assert gpu_check.planned_batch(DRY_RUN, 40e9) is None  # no GPU size it lists fits within 40 GB
    assert gpu_check.plan_figures(DRY_RUN_AT_4) == (4, 61.0, {80: 5, 141: 11})
    assert gpu_check.plan_figures("no plan here") == (None, None, {})


def test_rows_from_stage_outputs(tmp_path, capsys):
    work, runs_dir = tmp_path / "work", tmp_path / "runs"
    work.mkdir()
    args = [str(work), str(runs_dir), "--gpus", "2", "--memory", str(80 * 10**9), "--tiny"]
    write_stage(work, "bench", status=124, limit=200)  # timed out before its first row
    write_stage(work, "plan", log=DRY_RUN)
    write_stage(work, "plan_at", log=DRY_RUN_AT_4)
    write_stage(work, "step24", status=1, log="step 1/2\nTraceback (most recent call last):\n  File x\n"
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n[rank0] teardown\n")
    write_stage(work, "fp32")
    write_stage(work, "bf16")
    write_steps(runs_dir, "fp32", [6.0, 5.0, 4.0])
    write_steps(runs_dir, "bf16", [6.0, 5.04, 4.0])
    assert gpu_check.main(args) == 1
    rows = table_rows(capsys.readouterr().out)
    assert list(rows) == NUMBERS
    assert rows["2a"][1] == "failed: bench timed out after 200 s"
    assert rows["1"][1].endswith("matmul failed: bench timed out after 200 s")  # the versions themselves print
    assert rows["3a"][1:] == ("device batch 4: plan 61.0 GB per GPU, a GPU faked to report 80 GB", "fits: met")
    assert rows["3b"][1] == ("failed: step24 exited 1: torch.OutOfMemoryError: CUDA out of memory. "
                             "Tried to allocate 2 GiB")
    assert rows["4a"][1] == "failed: stage ddp did not run"
    assert "largest 0.800%" in rows["5"][1] and "step 1 0.000%" in rows["5"][1]
    assert rows["5"][2] == "<= 1%: met"

    # the torchrun stages: killed at step 3, resumed from the checkpoint of step 2, to step 16
    write_stage(work, "ddp", log="steps: 16 x 1,024 tokens = 2 process(es) x 2 micro-batch(es) x 4 x 64\n"
                "== ddp: killed the workers at step 3\n")
    write_stage(work, "ddp_resume", log="resumed gpu_check_ddp at step 2, from ckpt_000002.pt\n")
    losses = [6.0 - 0.1 * step for step in range(16)]
    evals = [{"step": 16, "val_loss_T1": 4.5, "val_loss_T8": 4.25}, {"step": 16, "core": 0.125, "core_T": 8}]
    write_steps(runs_dir, "ddp", losses, extra=evals, graphs=4)
    (runs_dir / "gpu_check_ddp" / "ckpt_000016.pt").write_bytes(b"")
    gpu_check.main(args)
    rows = table_rows(capsys.readouterr().out)
    assert rows["4a"][1:] == ("loss 5.800 -> 4.700 (means of steps 1-5 and 12-16)", "falls: met")
    assert rows["4b"][1:] == ("4 after step 3, 4 after step 12, 4 after step 16", "none after step 12: met")
    assert rows["4d"][1:] == ("killed at step 3; resumed at step 2, ended at step 16; steps 1-16 logged once each; "
                              "ckpt_000016.pt saved", "resumes, each step once, saves: met")
    assert rows["4e"][1] == "step 16: val loss T=1 4.500, T=8 4.250; step 16: CORE 0.125 at T=8"

    # a resume that redid a step twice, a resume too late for a warm-up, a run without accumulation
    steps = [1, 2, 3, 3, *range(4, 17)]  # step 3 twice: the killed command's and the resumed one's
    (runs_dir / "gpu_check_ddp" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "loss": 5.0, "tokens_per_s": 1000.0, "graphs": 4}) + "\n" for step in steps))
    write_stage(work, "ddp_resume", log="resumed gpu_check_ddp at step 8\n")
    write_stage(work, "ddp", log="2 process(es) x 1 micro-batch(es) x 4 x 64\n")
    (runs_dir / "gpu_check_bf16" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 6.2}) + "\n")
    gpu_check.main(args)
    rows = table_rows(capsys.readouterr().out)
    assert rows["4a"][2] == "falls: not met"
    assert rows["4b"][1] == "failed: the run resumed at step 8: no step after its warm-up to compare"
    assert "logged out of order or twice" in rows["4d"][1] and rows["4d"][1].startswith("killed at step ?")
    assert rows["4d"][2].endswith(": not met")
    assert rows["4e"][1] == "failed: the run logged no eval"
    assert rows["5"][1] == "failed: the runs logged different steps: [1, 2, 3] and [1]"
