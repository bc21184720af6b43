"""Bitwise regression guard: a fixed-seed CPU training run of train.py must give exactly the reference
numbers below, recorded from the code before a refactor that was meant to change no behaviour.

The run: train.py on a small generated corpus, 20 optimiser steps of a tiny diagonal (Parcae) model with a
log line every step, then the short runs of the three other injections. Compared bit for bit: every
step's loss, gradient norm, rho, ||h_T|| and update ratio (the floats metrics.jsonl holds), the final
validation losses, and a sha256 of the final weights (their float32 bytes in state-dict order; names are
left out, so renaming a parameter does not change it, but reordering or changing one does).

Regenerating the reference: any intended change of numbers (a new init, another depth sampler) changes
them too. Check out the code whose numbers are the reference, run

    python tests/test_refactor.py

and paste its output over REFERENCE below. The lead regenerates them after merging branches that change the
initialisation (the truncated-orthogonal init) from the code before the refactor, then checks the refactored
code against them.
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


REFERENCE = {
    "diagonal": {
        "steps": [
            [6.085355758666992, 6.125514030456543, 0.45206573605537415, 10.160453796386719, 0.17984116077423096],
            [5.005166053771973, 4.571501731872559, 0.4539009630680084, 9.761332511901855, 0.25988468527793884],
            [4.51348876953125, 5.685739994049072, 0.4546372890472412, 9.298859596252441, 0.3782121241092682],
            [3.8955726623535156, 4.7127861976623535, 0.45565396547317505, 12.129278182983398, 0.044398169964551926],
            [3.6263461112976074, 4.448394775390625, 0.4567919671535492, 10.258101463317871, 0.3221571445465088],
            [3.32211971282959, 3.212061643600464, 0.45724645256996155, 11.105627059936523, 0.27589359879493713],
            [3.1376211643218994, 3.238823890686035, 0.45806315541267395, 14.242471694946289, 0.02678961493074894],
            [2.6614670753479004, 3.023810625076294, 0.458942711353302, 14.712015151977539, 0.06432041525840759],
            [2.4315834045410156, 2.159240245819092, 0.4598190188407898, 13.383641242980957, 0.23571008443832397],
            [2.3156726360321045, 1.876487374305725, 0.46018603444099426, 11.43679428100586, 0.5174664855003357],
            [2.089717388153076, 1.6981102228164673, 0.4607451856136322, 14.747262001037598, 0.16913312673568726],
            [2.2473535537719727, 3.212456226348877, 0.4618258774280548, 14.052228927612305, 0.21618983149528503],
            [1.9649105072021484, 2.0303516387939453, 0.4625387191772461, 13.570089340209961, 0.2979602515697479],
            [2.2307467460632324, 2.6541762351989746, 0.46294263005256653, 13.490419387817383, 0.36152154207229614],
            [2.3093371391296387, 1.7727866172790527, 0.4629572629928589, 15.729351043701172, 0.12543393671512604],
            [2.351642608642578, 1.9533368349075317, 0.4633997678756714, 14.616708755493164, 0.22179025411605835],
            [2.088405132293701, 1.345109224319458, 0.4635363519191742, 15.08069896697998, 0.20384782552719116],
            [2.237555980682373, 1.91012704372406, 0.4636632800102234, 14.014533996582031, 0.2896793782711029],
            [2.0916271209716797, 1.9865037202835083, 0.46362558007240295, 14.784770965576172, 0.21741729974746704],
            [2.2362325191497803, 1.4387365579605103, 0.46367359161376953, 14.61056137084961, 0.28356507420539856],
        ],
        "val": {
            "val_loss_T1": 2.1195745215009083,
            "val_bpb_T1": 0.8915971647457555,
            "val_loss_T2": 2.1190953639961663,
            "val_bpb_T2": 0.8913956075613484,
            "val_loss_T3": 2.1189194848775514,
            "val_bpb_T3": 0.8913216241642542,
            "val_loss_T4": 2.1188128941794275,
            "val_bpb_T4": 0.8912767868805109,
        },
        "weights": "3c8b074d43a86baef35c8171ec8ea54776712d4d5b626e7ba8e02db30ee0d6da",
    },
    "concat": {
        "steps": [
            [5.865037441253662, 6.443882942199707, 0.6447404623031616, 6.136987209320068, 0.3607853353023529],
            [4.901362419128418, 5.220693111419678, 0.6440355777740479, 6.38871955871582, 0.3995423913002014],
            [4.377462387084961, 5.599851608276367, 0.6374051570892334, 6.709163188934326, 0.550360381603241],
            [3.7189979553222656, 4.1649909019470215, 0.6231567859649658, 9.136286735534668, 0.14722293615341187],
        ],
        "val": {
            "val_loss_T1": 3.6513934582471848,
            "val_bpb_T1": 1.5359554579091,
            "val_loss_T2": 3.503715648315847,
            "val_bpb_T2": 1.4738349165952678,
            "val_loss_T3": 3.4808966917917132,
            "val_bpb_T3": 1.4642361425333077,
            "val_loss_T4": 3.4969290329609066,
            "val_bpb_T4": 1.4709801327944132,
        },
        "weights": "731cb533b25fca4dd91ad3fd38a6a471152fc414408ecaf870e94fd3b14d8b79",
    },
    "add": {
        "steps": [
            [5.942014217376709, 4.985409736633301, 1.0, 23.98122215270996, 0.3333064913749695],
            [5.09259033203125, 3.7552125453948975, 1.0, 26.014026641845703, 0.30761122703552246],
            [4.729857444763184, 4.9726881980896, 1.0, 16.0333251953125, 0.4999282658100128],
            [3.9825382232666016, 3.427385091781616, 1.0, 34.1485481262207, 0.23523160815238953],
        ],
        "val": {
            "val_loss_T1": 3.95030980091542,
            "val_bpb_T1": 1.6616943554640897,
            "val_loss_T2": 3.9594938217196614,
            "val_bpb_T2": 1.6655576057659613,
            "val_loss_T3": 3.9630596842616796,
            "val_bpb_T3": 1.6670575827189231,
            "val_loss_T4": 3.964935719035566,
            "val_bpb_T4": 1.6678467351022879,
        },
        "weights": "758c89ff5b69dfbcac428bd259855f54cf8942f307a0cf39054640790961418e",
    },
    "none": {
        "steps": [
            [6.113729953765869, 10.708168029785156, None, None, None],
            [5.174805164337158, 9.567194938659668, None, None, None],
            [4.777935981750488, 10.306843757629395, None, None, None],
            [3.9037575721740723, 7.101945877075195, None, None, None],
        ],
        "val": {
            "val_loss_T1": 3.988564402796328,
            "val_bpb_T1": 1.6777861202166415,
        },
        "weights": "0c305e422d1377b35e6bce7c0ba6df796cf99fd524c19079548519d9a92eb1be",
    },
}


def format_reference(numbers):
    """The REFERENCE literal, a step per line."""
    lines = ["REFERENCE = {"]
    for injection, run in numbers.items():
        lines += [f'    "{injection}": {{', '        "steps": [']
        lines += [f"            {[*step]!r}," for step in run["steps"]]
        lines += ["        ],", '        "val": {']
        lines += [f'            "{key}": {value!r},' for key, value in run["val"].items()]
        lines += ["        },", f'        "weights": "{run["weights"]}",', "    },"]
    return "\n".join(lines + ["}"])


def test_training_run_is_bitwise_equal_to_the_reference(tmp_path):
    numbers = run_numbers(tmp_path)
    assert len(numbers["diagonal"]["steps"]) == RUNS["diagonal"]
    for injection in RUNS:
        assert numbers[injection] == REFERENCE[injection], injection  # floats compared exactly


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print(format_reference(run_numbers(Path(tmp))))
