#!/bin/bash
# runs/cpu.sh: set up (runs/setup.sh), train a small looped model on this Python's standard library (no download, no
# GPU), then sample from it. 6.5 to 17 minutes on a 2-core machine; a second run reuses .venv.
#
#     bash runs/cpu.sh
set -euo pipefail
. "$(dirname "$0")/setup.sh" requirements.txt
# train.py's defaults are the paper's 140M on FineWeb-Edu (bf16, compiled, GPUs); these flags make a 2.2M model
# (run d3_diagonal) that trains on a CPU in float32, eager, with an eval and a checkpoint every 130 steps
python train.py --depth=3 --d_model=128 --head_dim=64 --mu_rec=4 --vocab_size=4096 --seq_len=256 --data=stdlib \
    --device_batch_size=16 --total_batch_size=8192 --max_tokens=3.2e6 --dtype=float32 --compile=0 \
    --eval_every=130 --eval_tokens=65536 --save_every=130 --log_every=20 --core_every=-1
python sample.py --prompt="class Test" --max_new_tokens=64 --num_samples=3 --seed=42
