"""Bitwise regression guard: a fixed-seed CPU training run of train.py must give exactly the reference
numbers, recorded from the code before a refactor that was meant to change no behaviour.

The run: train.py on a small generated corpus, 20 optimiser steps of a tiny diagonal (Parcae) model with a
log line every step, then the short runs of the three other injections. Compared bit for bit: every
step's loss, gradient norm, rho, ||h_T|| and update ratio (the floats metrics.jsonl holds), the final
validation losses, and a sha256 of the final weights (their float32 bytes in state-dict order; names are
left out, so renaming a parameter does not change it, but reordering or changing one does).

The reference lives in tests/refactor_reference.json. Any intended change of numbers (a new init, another
depth sampler) changes it too: check out the code whose numbers are the reference and run

    python tests/test_refactor.py

which prints fresh numbers and writes them to that file; then check the refactored code against them.
"""

import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_FILE = Path(__file__).resolve().parent / "refactor_reference.json"
FLAGS = ["--depth=3", "--d_model=64", "--head_dim=32", "--mu_rec=3", "--vocab_size=320", "--seq_len=32",
         "--device_batch_size=4", "--total_batch_size=256", "--eval_every=1000", "--eval_tokens=256",
         "--save_every=1000", "--log_every=1", "--seed=7"]
RUNS = {"diagonal": 20, "concat": 4, "add": 4, "none": 4}  # injection -> optimiser steps
STEP_KEYS = ("loss", "grad_norm", "rho", "h_norm", "update_ratio")


def write_corpus(path):
    rng = random.Random(0)
    words = ["loop", "state", "depth", "token", "model", "stable", "radius", "prelude", "coda", "sample", "the",
             "a", "of", "is", "and", "runs", "learns", "every", "step", "with"]
    paragraphs = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 80))) + "." for _ in range(400)]
    path.write_text("\n\n".join(paragraphs))


def weights_digest(checkpoint):
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    digest = hashlib.sha256()
    for tensor in state.values():
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def run_numbers(root):
    """Train every run of RUNS under root -> {injection: {"steps": [...], "val": {...}, "weights": sha256}}."""
    write_corpus(root / "corpus.txt")
    env = {**os.environ, "NANOPARCAE_BASE_DIR": str(root / "base"), "OMP_NUM_THREADS": "1"}
    numbers = {}
    for injection, steps in RUNS.items():
        cmd = [sys.executable, str(ROOT / "train.py"), f"--data={root / 'corpus.txt'}", *FLAGS,
               f"--injection={injection}", f"--max_tokens={256 * steps}", f"--run={injection}"]
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        run_dir = root / "base" / "runs" / injection
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        numbers[injection] = {
            "steps": [[r[key] for key in STEP_KEYS] for r in records if "loss" in r],
            "val": {k: v for r in records for k, v in r.items() if k.startswith("val_")},
            "weights": weights_digest(next(run_dir.glob("ckpt_*.pt"))),
        }
    return numbers




def test_training_run_is_bitwise_equal_to_the_reference(tmp_path):
    reference = json.loads(REFERENCE_FILE.read_text())
    numbers = run_numbers(tmp_path)
    assert len(numbers["diagonal"]["steps"]) == RUNS["diagonal"]
    for injection in RUNS:
        # a json round trip keeps a float's exact value, so == compares bit for bit
        assert json.loads(json.dumps(numbers[injection])) == reference[injection], injection


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        text = json.dumps(run_numbers(Path(tmp)), indent=1) + "\n"
    partial = REFERENCE_FILE.with_name(REFERENCE_FILE.name + ".tmp")
    partial.write_text(text)
    os.replace(partial, REFERENCE_FILE)
    print(text, end="")
