#!/bin/bash
# runs/cpu.sh: set up (runs/setup.sh), train the CPU default, a small looped model on this Python's standard library
# (no download, no GPU), then sample from it. 6.5 to 17 minutes on a 2-core machine; a second run reuses .venv.
#
#     bash runs/cpu.sh
set -euo pipefail
. "$(dirname "$0")/setup.sh" requirements.txt
python train.py
python sample.py --prompt="class Test" --max_new_tokens=64 --num_samples=3 --seed=42
