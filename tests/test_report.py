"""The report card (experiments/report.py) on made-up run files: each number it shows is the one in the files."""

import json

import pytest
import torch

from conftest import carries

from model import Parcae, ParcaeConfig
from nanoparcae.checkpoint import digest_of, save_checkpoint
from nanoparcae.command import run_command
from nanoparcae.files import get_base_dir
from nanoparcae.memory import memory_plan
from experiments.report import main
from optim import optimizer_state_bytes

CONFIG = dict(vocab_size=320, seq_len=32, d_model=64, head_dim=32, mu_rec=8)  # depth 6: 2/2/2


def write_json(path, obj):
    path.write_text(json.dumps(obj))


def made_up_run():
    """A depth-6 run folder as the GPU recipe leaves it, every figure made up -> its folder."""
    run_dir = get_base_dir() / "runs" / "d6_diagonal"
    recipe = run_dir / "recipe"
    recipe.mkdir(parents=True)
    torch.manual_seed(0)
    model = Parcae(ParcaeConfig(**CONFIG))
    flags = {"depth": 6, "mu_rec": 8, "injection": "diagonal", "max_tokens": 11.2e9, "device_batch_size": 4,
             "total_batch_size": 256, "train_shards": "0-224"}
    args = {"depth": 6, "data": "fineweb-edu", "total_batch_size": 256, "dtype": "bfloat16", "optimizer": "muon"}
    save_checkpoint(run_dir / "ckpt_000010.pt", model, step=10, skipped_steps=1, run=flags, args=args,
                    tokenizer_dir="unused")
    steps = [{"step": s, "loss": 5.0 - 0.1 * s, "tokens_per_s": 1000.0 * s, "mfu": 0.01 * s,
              "peak_memory": 1e9 + s, "skipped_steps": int(s > 4)} for s in (2, 4, 6, 8, 10)]
    lines = [json.dumps(r) for r in steps[:3]]
    lines.append(json.dumps({"step": 6, "warning": "h_norm", "h_norm": 7e4, "limit": 1e4}))
    lines.append(json.dumps({"step": 10, "val_loss_T1": 4.25, "val_bpb_T1": 1.25, "val_loss_T8": 4.125,
                             "val_bpb_T8": 1.125}))
    lines += [json.dumps(r) for r in steps[3:]]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 12, "loss": 9')  # torn last line
    write_json(run_dir / "ckpt_000010_bpb_T1-2-4-8-16-32.json",
               {"T": [1, 2, 4, 8], "loss": [4.5, 4.25, 4.0, 3.875], "bpb": [1.5, 1.375, 1.25, 1.1875],
                "data": "fineweb-edu", "args": {"val_tokens": 1 << 20},
                "fit": {"L_inf": 3.8, "Z": 1.0, "z": 0.5, "rms": 1e-3, "loss_at_mu_rec": 3.875, "mu_rec": 8}})
    write_json(run_dir / "ckpt_000010_ppl_T8.json", {"T": [8], "ppl": [20.5], "args": {"max_docs": 1000}})
    write_json(run_dir / "ckpt_000010_core_T8.json", {"runs": [
        {"T": 8, "seed": 1234, "max_per_task": -1, "core": 0.15, "core_extended": 0.1,
         "accuracy": {"copa": 0.625, "mmlu_zeroshot": 0.3}, "centered": {"copa": 0.25, "mmlu_zeroshot": 0.0625},
         "skipped": {}}]})
    stages = [{"stage": "download", "started": 1}, {"stage": "download", "seconds": 5, "status": 0},
              {"stage": "train", "started": 6},  # killed: no end
              {"stage": "download", "skipped": True}, {"stage": "train", "started": 99},
              {"stage": "train", "seconds": 50, "status": 0}]
    (recipe / "stages.jsonl").write_text("".join(json.dumps(s) + "\n" for s in stages))
    write_json(recipe / "machine.json", {"gpus": ["NVIDIA H100 80GB HBM3"] * 8, "cpu": "x", "cpu_count": 64,
                                         "torch": "2.13.0", "cuda": "12.8", "commit": "abc123", "processes": 8})
    (recipe / "samples_T1.txt").write_text("The loop at one step\n")
    (recipe / "samples_T8.txt").write_text("The loop at eight steps\n")
    return run_dir, model


def test_card_shows_the_numbers_of_the_run_files():
    run_dir, model = made_up_run()
    main(["--run=d6_diagonal"])
    card = (run_dir / "report.md").read_text()
    assert "8 x NVIDIA H100 80GB HBM3" in card and "torch 2.13.0, CUDA 12.8" in card and "abc123" in card
    assert f"parameters: {model.num_params():,}" in card
    assert "2,560 trained" in card  # step 10 x 256 tokens
    assert f"{model.paper_flops_per_token() * 2560:.4e} trained" in card
    assert f"{model.matmul_flops_per_token() * 2560:.4e} trained" in card
    assert "0.8 min over 2 attempt(s) (1 interrupted" in card and f"{2560 / 50:,.0f} tokens/s" in card
    assert "10,000" in card and "MFU 10.0%" in card  # step 10's, the torn step 12 skipped
    plan = memory_plan(model, 4, True, optimizer_state_bytes(model))["total"]
    assert f"1.0 GB measured, {plan / 1e9:.1f} GB planned" in card
    assert "skipped steps (non-finite gradients): 1" in card
    assert "step 6: warning, h_norm 7e+04 > 10000" in card
    assert "| train | 2 | 50 | done |" in card and "| download | 1 | 5 | done; skipped on 1 later run(s) |" in card
    assert "| 8 | 3.8750 | 1.1875 | 20.50 |" in card and "| 1 | 4.5000 | 1.5000 | - |" in card
    assert "L_inf 3.8000" in card and "-1.94%" in card  # (3.8 - 3.875) / 3.875
    assert "| val PPL | 19.06 | 20.50 | +1.44 |" in card  # METHOD.md §4, Parcae 140M
    assert "| CORE | 14.04 | 15.00 | +0.96 |" in card and "| Core-Extended | 9.67 | 10.00 | +0.33 |" in card
    assert "not comparable" not in card
    assert "| copa | CORE | 0.6250 | +0.2500 |" in card and "| mmlu_zeroshot | extended |" in card
    assert "The loop at one step" in card and "The loop at eight steps" in card
    assert "T = 1: loss 4.2500, bpb 1.2500" in card


def test_card_of_another_horizon_says_it_is_not_the_papers(capsys):
    run_dir, _ = made_up_run()
    ckpt = torch.load(run_dir / "ckpt_000010.pt", weights_only=True)
    ckpt["run"]["max_tokens"] = 1e6
    torch.save({**ckpt, "digest": digest_of(ckpt)}, run_dir / "ckpt_000010.pt")  # signed, as train.py saves it
    main(["--run=d6_diagonal"])
    assert "not comparable" in (run_dir / "report.md").read_text()


def test_a_run_without_a_checkpoint_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        run_command(main, ["--run=nothing"])
    error = capsys.readouterr().err
    assert exit.value.code == 2 and len(error.strip().splitlines()) == 1, error
    assert carries(error, "nothing", "train.py"), error


def test_a_fit_at_the_edge_of_its_search_is_said_and_metrics_that_are_a_folder_end_in_one_line(capsys):
    run_dir, _ = made_up_run()
    bpb = run_dir / "ckpt_000010_bpb_T1-2-4-8-16-32.json"
    write_json(bpb, {**json.loads(bpb.read_text()), "fit": {**json.loads(bpb.read_text())["fit"], "at_edge": True}})
    main(["--run=d6_diagonal"])
    fit_line = next(line for line in (run_dir / "report.md").read_text().splitlines() if "L_inf 3.8000" in line)
    assert carries(fit_line, "edge"), fit_line
    (run_dir / "metrics.jsonl").unlink()
    (run_dir / "metrics.jsonl").mkdir()
    with pytest.raises(SystemExit) as exit:
        run_command(main, ["--run=d6_diagonal"])
    error = capsys.readouterr().err
    assert exit.value.code == 2 and len(error.strip().splitlines()) == 1, error
    assert carries(error, str(run_dir / "metrics.jsonl")), error
