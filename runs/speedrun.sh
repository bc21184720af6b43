#!/bin/bash
# runs/speedrun.sh: a fresh clone to a trained, evaluated and sampled model of the paper's, on one GPU node, ending
# in its report card. The 140M takes about 8 GPU-hours (1 hour on 8 GPUs); README's table sizes the others.
#
#     bash runs/speedrun.sh            # the paper's 140M: depth 6, Parcae, mu_rec 8, on every GPU torch sees
#     bash runs/speedrun.sh 12         # the 370M (18: the 770M, 24: the 1.3B)
#     bash runs/speedrun.sh 6 none     # the Transformer baseline of that depth
#     screen -L -Logfile speedrun.log -S speedrun bash runs/speedrun.sh 24   # hours: survives a dropped ssh
#
# Each stage (runs/stage.sh) says what it runs and how long it took. Run again after a failure: the finished
# stages are skipped (<run>/recipe/NAME.done) and training resumes from its checkpoint.
#
# Environment (the defaults are the GPU path):
#     NPROC=N                    processes (default: every GPU torch sees)
#     TRAIN_FLAGS="..."          more train.py flags, after the recipe's
#     VOCAB_SIZE=N               the tokenizer's and the model's vocabulary (default 32768)
#     EVAL_FLAGS="..."           more eval_core.py flags, e.g. "--max_per_task=100" for a quicker CORE
#     DOWNLOAD_FLAGS="..."       the download's size in place of --depth=D, e.g. "-n 50"
#     FINEWEB_URL, EVAL_BUNDLE_URL   mirrors of the shards' host and of the eval bundle
#     PROMPT="..."               the samples' prompt
#     TORCH_INDEX=URL            the wheel index of torch's CUDA build (default PyPI's), e.g. for an older driver
#     SKIP_GPU_CHECK=1           skip runs/gpu_check.sh (it takes up to 10 minutes)
#     CPU_REHEARSAL=1            rehearse every stage on a CPU (gloo, no GPU check); SKIP_SETUP=1 keeps this Python
set -euo pipefail
cd "$(dirname "$0")/.."
refuse() { echo "runs/speedrun.sh: $*" >&2; exit 2; }
[ $# -le 2 ] || refuse "it takes a depth and an injection, not '${*:3}'; pass train.py's flags in TRAIN_FLAGS"
depth=${1:-6}
injection=${2:-diagonal}
case "$depth" in 6|12|18|24) ;; *) refuse "depth '$depth' is none of the paper's sizes; pass 6, 12, 18 or 24" ;; esac
case "$injection" in diagonal|concat|add|none) ;; *)
    refuse "injection '$injection' is not diagonal, concat, add or none (the Transformer)" ;; esac
[[ "${NPROC:-1}" =~ ^[1-9][0-9]*$ ]] || refuse "NPROC=$NPROC is not a number of processes; pass NPROC=8, say"
[[ "${VOCAB_SIZE:-1}" =~ ^[1-9][0-9]*$ ]] || refuse "VOCAB_SIZE=$VOCAB_SIZE is not a number of tokens"
rehearsal=${CPU_REHEARSAL:-0}
if [ "$rehearsal" != 1 ] && ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then  # before anything is installed
    echo "runs/speedrun.sh: no NVIDIA GPU here (nvidia-smi finds none), and the paper's runs need one; on a CPU," \
         "bash runs/cpu.sh trains a small model with no download" >&2
    exit 1
fi

export NANOPARCAE_BASE_DIR=${NANOPARCAE_BASE_DIR:-$HOME/.cache/nanoparcae}
export PYTHONUNBUFFERED=1  # each stage's lines as they come, through tee
mu_rec=8  # the paper's, at every size
vocab=${VOCAB_SIZE:-32768}
run=d${depth}_${injection}
RECIPE=$NANOPARCAE_BASE_DIR/runs/$run/recipe
. runs/stage.sh
echo "== runs/speedrun.sh: depth $depth, injection $injection, run $run under $NANOPARCAE_BASE_DIR"

# -----------------------------------------------------------------------------
# Setup: .venv with PyPI's torch, the CUDA build (runs/setup.sh), in this shell so that it stays active
if [ "${SKIP_SETUP:-0}" != 1 ]; then
    [ "$rehearsal" = 1 ] || export TORCH_INDEX=${TORCH_INDEX:-pypi}
    . runs/setup.sh requirements.txt
fi
# The training command, which `train.py --check` checks before any stage as training would (its flags, the model's
# shape, the step's split, the run's name), so a bad VOCAB_SIZE or TRAIN_FLAGS stops the recipe here, not after the
# machine stage and the download
# shellcheck disable=SC2086  # TRAIN_FLAGS is a list of flags
train=(train.py --depth="$depth" --injection="$injection" --mu_rec=$mu_rec --run="$run" --vocab_size="$vocab" \
    ${TRAIN_FLAGS:-})
why=$(python "${train[@]}" --check 2>&1) || refuse "VOCAB_SIZE or TRAIN_FLAGS: ${why#error: }"
if [ "$rehearsal" = 1 ]; then
    launch=(python -m torch.distributed.run --standalone --nproc_per_node="${NPROC:-2}" --)
    stage machine python -m experiments.report --run="$run" --machine
else
    launch=(python -m torch.distributed.run --standalone --nproc_per_node="${NPROC:-gpu}" --)
    stage machine python -m experiments.report --run="$run" --machine --gpu  # torch must see the GPUs
    [ "${SKIP_GPU_CHECK:-0}" = 1 ] || stage gpu_check bash runs/gpu_check.sh
fi

# -----------------------------------------------------------------------------
# Data: the FineWeb-Edu shards this depth reads and the eval bundle, then the tokenizer
download() {  # in stage's `if`, where set -e is off: `|| return`
    show python -m nanoparcae.dataset download ${DOWNLOAD_FLAGS:---depth=$depth} \
        ${FINEWEB_URL:+--base_url="$FINEWEB_URL"} || return
    show python -m nanoparcae.core_tasks ${EVAL_BUNDLE_URL:+--url="$EVAL_BUNDLE_URL"}
}
stage download download
stage tokenizer python -m nanoparcae.tokenizer --data=fineweb-edu --vocab_size="$vocab"

# -----------------------------------------------------------------------------
# Training, then the evals: bpb at T = 1..32 and the fit of L(T), the paper's val PPL and CORE at T = mu_rec
stage train "${launch[@]}" "${train[@]}"
if [ "$injection" = none ]; then
    sweep=1; at=1  # the Transformer runs its blocks once, whatever T
else
    sweep=1,2,4,8,16,32; at=$mu_rec
fi
evaluate=("${launch[@]}" eval_core.py --run="$run")
stage eval_bpb "${evaluate[@]}" --eval=bpb --T=$sweep --val_tokens=5242880 ${EVAL_FLAGS:-}
stage eval_ppl "${evaluate[@]}" --eval=ppl --T=$at ${EVAL_FLAGS:-}
stage eval_core "${evaluate[@]}" --tasks=extended --T=$at ${EVAL_BUNDLE_URL:+--bundle_url="$EVAL_BUNDLE_URL"} \
    ${EVAL_FLAGS:-}

# -----------------------------------------------------------------------------
# Figures, samples at T = 1 and T = mu_rec, and the report card
figures() {
    show python -m experiments.plot "$run" --metrics=loss -o "$NANOPARCAE_BASE_DIR/runs/$run/loss.png" || return
    [ "$injection" = none ] || show python -m experiments.plot --test_time="$run"
}
stage figures figures
samples() {  # samples T: sample.py's text at depth T, to recipe/samples_T<T>.txt
    show python sample.py --run="$run" --T="$1" --prompt="${PROMPT:-The meaning of life is}" --num_samples=3 \
        --max_new_tokens=64 --seed=42 >"$RECIPE/samples_T$1.txt.tmp" || return
    mv "$RECIPE/samples_T$1.txt.tmp" "$RECIPE/samples_T$1.txt"
    cat "$RECIPE/samples_T$1.txt"
}
stage samples_T1 samples 1
[ "$at" = 1 ] || stage "samples_T$at" samples "$at"
rm -f "$RECIPE/report.done"  # the card is written again on every run
stage report python -m experiments.report --run="$run"
echo "== the report card: $NANOPARCAE_BASE_DIR/runs/$run/report.md"
