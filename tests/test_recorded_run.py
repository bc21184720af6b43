"""A fixed-seed CPU training run of train.py must give the numbers recorded in tests/recorded_run.json, within the
rounding that another CPU's kernels (AVX2, AVX-512, scalar) can cause: a change meant to keep behaviour keeps them.

The run: train.py on a small generated corpus, 20 optimiser steps of a tiny diagonal (Parcae) model with a
log line every step, then the short runs of the three other injections. Compared: every step's loss,
gradient norm, rho, ||h_T|| and update ratio (the floats metrics.jsonl holds), the final validation losses,
and each final weight tensor's shape and norm, in state-dict order (names are left out, so renaming a
parameter does not change them, but reordering, reshaping or changing one does).

The tolerances (TOLERANCES) come from the same run under ATEN_CPU_CAPABILITY=default/avx2/avx512 and
MKL_ENABLE_INSTRUCTIONS=AVX2 on two CPUs. Step 1 is float32 forward and backward only: kernels moved it by
at most 3e-6 (relative), while a changed init, sampler or forward moves it by 1e-3 or more. From step 2 on
the bf16 orthogonalisation of Muon rounds differently per kernel and training amplifies it: losses moved up to
3e-3, rho and update ratios 5e-4, ||h_T|| 3e-3, final validation losses 3.5e-4, weight norms 1.3e-3, and
gradient norms up to 5e-2 (so they are compared at step 1 only). Each tolerance is 3x to 30x the largest
drift seen, and a real change lands far outside them: a 5% larger Muon learning rate moves the weight norms
by 5% and the short runs' validation losses by 0.4-1%.

Any intended change of numbers (a new init, another depth sampler) records them again: check out the code whose
numbers are to be recorded and run

    python tests/test_recorded_run.py

which prints fresh numbers and writes them to tests/recorded_run.json; then check the changed code against them.
"""

import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY, awaited, beforehand, python, write_corpus

RECORD = Path(__file__).resolve().parent / "recorded_run.json"
# each run sets its horizon; concat's rho at every step (--rho_every=1), as every other injection's
FLAGS = [flag for flag in TINY if not flag.startswith("--max_tokens")] + ["--seed=7", "--rho_every=1"]
RUNS = {"diagonal": 20, "concat": 4, "add": 4, "none": 4}  # injection -> optimiser steps
STEP_KEYS = ("loss", "grad_norm", "rho", "h_norm", "update_ratio")


def weights_summary(checkpoint):
    """[[shape, L2 norm], ...] of the final weights in state-dict order."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    return [[list(tensor.shape), tensor.double().norm().item()] for tensor in state.values()]


def run_numbers(root):
    """Train every run of RUNS under root -> {injection: {"steps": [...], "val": {...}, "weights": [...]}}."""
    write_corpus(root / "corpus.txt")
    numbers, runs = {}, {}
    with ThreadPoolExecutor(len(RUNS)) as pool:  # all at once: each is one thread and trains its own tokenizer copy
        for injection, steps in RUNS.items():
            flags = [f"--data={root / 'corpus.txt'}", *FLAGS, f"--injection={injection}",
                     f"--max_tokens={256 * steps}", f"--run={injection}"]
            runs[injection] = pool.submit(python, [str(ROOT / "train.py"), *flags],
                                          {"NANOPARCAE_BASE_DIR": str(root / "base" / injection)}, timeout=600)
    for injection, run in runs.items():
        assert run.result().returncode == 0, run.result().stderr[-3000:]
        run_dir = root / "base" / injection / "runs" / injection
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        numbers[injection] = {
            "steps": [[r[key] for key in STEP_KEYS] for r in records if "loss" in r],
            "val": {k: v for r in records for k, v in r.items() if k.startswith("val_")},
            "weights": weights_summary(next(run_dir.glob("ckpt_*.pt"))),
        }
    return numbers


# relative tolerances: (step 1, later steps) per STEP_KEYS entry (None: not compared), validation, weight norms
TOLERANCES = dict(steps=dict(loss=(1e-4, 1e-2), grad_norm=(1e-4, None), rho=(1e-4, 5e-3), h_norm=(1e-4, 1e-2),
                             update_ratio=(1e-4, 5e-3)), val=3e-3, weights=1e-2)


def close(got, want, rtol):
    return got == want if got is None or want is None else abs(got - want) <= rtol * abs(want)


def differences(numbers, reference):
    """-> the list of quantities of numbers that differ from reference by more than TOLERANCES allows."""
    out = []
    for injection, want in reference.items():
        got = numbers[injection]
        if len(got["steps"]) != len(want["steps"]) or got["val"].keys() != want["val"].keys():
            out.append(f"{injection}: {len(got['steps'])} steps / {sorted(got['val'])}, want "
                       f"{len(want['steps'])} / {sorted(want['val'])}")
            continue
        for step, (got_row, want_row) in enumerate(zip(got["steps"], want["steps"]), 1):
            for key, g, w in zip(STEP_KEYS, got_row, want_row):
                rtol = TOLERANCES["steps"][key][step > 1]
                if rtol is not None and not close(g, w, rtol):
                    out.append(f"{injection} step {step} {key}: {g} != {w}")
        out += [f"{injection} {key}: {got['val'][key]} != {w}" for key, w in want["val"].items()
                if not close(got["val"][key], w, TOLERANCES["val"])]
        shapes = [shape for shape, _ in got["weights"]]
        if shapes != [shape for shape, _ in want["weights"]]:
            out.append(f"{injection} weight shapes: {shapes}")
        else:
            out += [f"{injection} weight {i} norm: {g} != {w}"
                    for i, ((_, g), (_, w)) in enumerate(zip(got["weights"], want["weights"]))
                    if not close(g, w, TOLERANCES["weights"])]
    return out


def test_differences_catch_a_change_and_pass_rounding():
    reference = json.loads(RECORD.read_text())
    assert differences(reference, reference) == []
    rounded = json.loads(json.dumps(reference))
    rounded["diagonal"]["steps"][0][0] *= 1 + 1e-7  # what another CPU's kernels do to step 1
    rounded["diagonal"]["steps"][-1][1] *= 1.05     # and to a late gradient norm
    assert differences(rounded, reference) == []
    changed = json.loads(json.dumps(reference))
    changed["diagonal"]["steps"][0][0] *= 1 + 1e-3  # what a changed init or forward does
    changed["add"]["val"]["val_loss_T1"] *= 1.01
    changed["none"]["weights"].reverse()
    found = differences(changed, reference)
    assert len(found) == 3 and "diagonal step 1 loss" in found[0] and "add val_loss_T1" in found[1], found


@pytest.mark.slow
@beforehand(run_numbers)
def test_training_run_gives_the_recorded_numbers():
    reference = json.loads(RECORD.read_text())
    numbers = awaited(run_numbers)
    assert len(numbers["diagonal"]["steps"]) == RUNS["diagonal"]
    assert differences(numbers, reference) == []


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        text = json.dumps(run_numbers(Path(tmp)), indent=1) + "\n"
    partial = RECORD.with_name(RECORD.name + ".tmp")
    partial.write_text(text)
    os.replace(partial, RECORD)
    print(text, end="")
