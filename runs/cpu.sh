#!/bin/bash
# runs/cpu.sh: set up (runs/setup.sh), train a small looped model on this Python's standard library (no download, no
# GPU), evaluate it at T = 1 to 32, sample from it and write its report card, report.md in the run's folder. 7.5 to
# 18.5 minutes on a 2-core machine; a second run reuses .venv and skips the stages that finished (runs/stage.sh).
#
#     bash runs/cpu.sh
set -euo pipefail
. "$(dirname "$0")/setup.sh" requirements.txt
export PYTHONUNBUFFERED=1  # each stage's lines as they come, through tee
run=d3_diagonal
RECIPE=${NANOPARCAE_BASE_DIR:-$HOME/.cache/nanoparcae}/runs/$run/recipe
. runs/stage.sh
stage machine python -m experiments.report --run=$run --machine
# train.py's defaults are the paper's 140M on FineWeb-Edu (bf16, compiled, GPUs); these flags make a 2.2M model
# (run d3_diagonal) that trains on a CPU in float32, eager, with an eval and a checkpoint every 130 steps
stage train python train.py --depth=3 --d_model=128 --head_dim=64 --mu_rec=4 --vocab_size=4096 --seq_len=256 \
    --data=stdlib --device_batch_size=16 --total_batch_size=8192 --max_tokens=3.2e6 --dtype=float32 --compile=0 \
    --eval_every=130 --eval_tokens=65536 --save_every=130 --log_every=20
# the loss at each depth and the fit of L(T); CORE needs the eval bundle's download (python eval_core.py)
stage eval_bpb python eval_core.py --run $run --eval bpb --T 1,2,4,8,16,32 --val_tokens 65536 --batch_size 16
figures() {  # in stage's `if`, where set -e is off: `|| return`
    show python -m experiments.plot $run --metrics=loss -o "$(dirname "$RECIPE")/loss.png" || return
    show python -m experiments.plot --test_time=$run
}
stage figures figures
samples() {  # samples T: sample.py's text at depth T, to recipe/samples_T<T>.txt
    show python sample.py --run=$run --T="$1" --prompt="class Test" --max_new_tokens=64 --num_samples=3 --seed=42 \
        >"$RECIPE/samples_T$1.txt.tmp" || return
    mv "$RECIPE/samples_T$1.txt.tmp" "$RECIPE/samples_T$1.txt"
    cat "$RECIPE/samples_T$1.txt"
}
stage samples_T4 samples 4
stage samples_T1 samples 1
rm -f "$RECIPE/report.done"  # the card is written again on every run
stage report python -m experiments.report --run=$run
echo "== the report card: $(dirname "$RECIPE")/report.md"
