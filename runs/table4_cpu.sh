#!/bin/bash
# runs/table4_cpu.sh: the paper's Table 4 (stability ablations and baselines) at laptop scale, 4.6 minutes on one core.
# One small fast setup for every row: train.py's CPU preset shape at d_model 64 with mu_rec 8 (so train.py
# evaluates T = 1 / 2 / 4 / 8), 60 steps of 2,048 tokens of stdlib bytes, the recipe's default rates.
# Parcae and the fixed-depth Transformer with 3 seeds each; plot.py prints each run's final val losses.
#
#     bash runs/table4_cpu.sh                        # PYTHON=... to pick the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
SHAPE=(--d_model=64 --head_dim=32 --mu_rec=8 --seq_len=128 --device_batch_size=16 --total_batch_size=2048
       --max_tokens=122880 --log_every=1 --eval_every=1000 --eval_tokens=32768 --save_every=1000)

train() {  # train.py, a diverged run (status 3) counted as a result
    "$PY" train.py "${SHAPE[@]}" "$@" || [ $? -eq 3 ]
}

train --injection=concat --sampling=per_batch --prelude_norm=0 --run=table4_rdm
train --injection=diagonal --sampling=per_batch --prelude_norm=0 --run=table4_abar
train --injection=diagonal --sampling=per_sequence --prelude_norm=0 --run=table4_per_sequence
for seed in 0 1 2; do
    train --run="table4_parcae_s$seed" --seed="$seed"
    train --injection=none --run="table4_transformer_s$seed" --seed="$seed"
done
train --injection=add --run=table4_add
train --mu_rec=1 --sampling=fixed --run=table4_mu_rec1

runs=(table4_rdm table4_abar table4_per_sequence table4_parcae_s{0,1,2} table4_add table4_transformer_s{0,1,2}
      table4_mu_rec1)
base=${NANOPARCAE_BASE_DIR:-$HOME/.cache/nanoparcae}
"$PY" plot.py "${runs[@]}" --metrics=loss,h_norm --title="Table 4 at laptop scale" -o "$base/table4_cpu.png" --table
