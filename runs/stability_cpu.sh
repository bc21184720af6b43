#!/bin/bash
# runs/stability_cpu.sh: the paper's stability claim (METHOD.md §4) on a CPU, about 19 minutes on one core.
# An AdamW learning-rate sweep of the three injections (concat = RDM, add, diagonal = Parcae), then
# Parcae without its prelude norm, with the project's recipe (MuonAdamW, train.py's CPU preset shape:
# depth 3, d_model 128, mu_rec 4, stdlib bytes), 100 steps of 4,096 tokens each; then plot.py draws
# figures/stability_cpu/*.png and prints one row per run.
#
# The sweep moves --adamw_lr, the rate of the injection's own parameters (Abar and B, or the concat adapter),
# embeddings and norms; Muon's rate for the blocks' matrices stays at its 8e-3. A run that train.py declares
# diverged (exit status 3: five steps in a row with ||h_T|| > 1e4 or non-finite gradients) is an outcome here.
#
#     bash runs/stability_cpu.sh                     # PYTHON=... to pick the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
SHAPE=(--d_model=128 --mu_rec=4 --seq_len=256 --device_batch_size=16 --total_batch_size=4096 --max_tokens=409600
       --log_every=1 --eval_every=1000 --eval_tokens=65536 --save_every=1000)
LRS=(8e-3 3e-2 1e-1)  # the recipe's AdamW rate at depth 6 and 12 (METHOD.md §2), then about 4x and 12x
NORM_LR=3e-2

train() {  # train.py, a diverged run (status 3) counted as a result
    "$PY" train.py "${SHAPE[@]}" "$@" || [ $? -eq 3 ]
}

for lr in "${LRS[@]}"; do
    for injection in concat add diagonal; do
        train --injection="$injection" --adamw_lr="$lr" --run="stability_${injection}_lr$lr"
    done
done
train --injection=diagonal --prelude_norm=0 --adamw_lr="$NORM_LR" --run="stability_diagonal_nonorm_lr$NORM_LR"

out=figures/stability_cpu
mkdir -p "$out"
for injection in concat add diagonal; do
    "$PY" plot.py "${LRS[@]/#/stability_${injection}_lr}" --metrics=loss,rho,h_norm,update_ratio \
        --title="$injection injection, AdamW learning rate sweep" -o "$out/lr_sweep_$injection.png" --table
done
"$PY" plot.py stability_{concat,add,diagonal}_lr"$NORM_LR" --metrics=loss,rho,h_norm,update_ratio,lr \
    --title="the three injections at AdamW lr $NORM_LR" -o "$out/injections_lr$NORM_LR.png"
"$PY" plot.py stability_diagonal_lr"$NORM_LR" stability_diagonal_nonorm_lr"$NORM_LR" \
    --metrics=loss,h_norm,update_ratio --title="Parcae with and without the prelude norm, AdamW lr $NORM_LR" \
    -o "$out/prelude_norm.png" --table
