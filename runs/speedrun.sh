#!/bin/bash
# runs/speedrun.sh: a fresh clone to a trained, evaluated and sampled model of the paper's, on one GPU node, ending
# in its report card. The 140M takes about 8 GPU-hours (1 hour on 8 GPUs); README's table sizes the others.
#
#     bash runs/speedrun.sh            # the paper's 140M: depth 6, Parcae, mu_rec 8, on every GPU torch sees
#     bash runs/speedrun.sh 12         # the 370M (18: the 770M, 24: the 1.3B)
#     bash runs/speedrun.sh 6 none     # the Transformer baseline of that depth
#     screen -L -Logfile speedrun.log -S speedrun bash runs/speedrun.sh 24   # hours: survives a dropped ssh
#
# Stages: setup (.venv with PyPI's torch, the CUDA build), gpu_check (runs/gpu_check.sh), download (the FineWeb-Edu
# shards this depth reads, the eval bundle), tokenizer, train (torchrun), eval_bpb (val loss and bpb at T = 1, 2, 4,
# 8, 16, 32 and the fit of L(T)), eval_ppl (the paper's val PPL at T = mu_rec), eval_core (CORE and Core-Extended,
# every item), figures, samples (T = 1 and T = mu_rec), report (report.md in the run's folder). Each says what it
# runs and how long it took; train's log line and download's ends in an eta. Run again after a failure at any
# stage, it skips the finished ones (<run>/recipe/NAME.done) and training resumes from its checkpoint.
#
# Environment (the defaults are the GPU path):
#     SKIP_GPU_CHECK=1           skip runs/gpu_check.sh (it takes up to 10 minutes)
#     NPROC=N                    processes (default: every GPU torch sees)
#     TRAIN_FLAGS="..."          more train.py flags, after the recipe's (--vocab_size reaches the tokenizer too)
#     EVAL_FLAGS="..."           more eval_core.py flags, e.g. "--max_per_task=100" for a quicker CORE
#     DOWNLOAD_FLAGS="..."       the download's size in place of --depth=D, e.g. "-n 50"
#     FINEWEB_URL, EVAL_BUNDLE_URL   mirrors of the shards' host and of the eval bundle
#     PROMPT="..."               the samples' prompt
#     TORCH_INDEX=URL            the wheel index of torch's CUDA build (default PyPI's), e.g. for an older driver
#     CPU_REHEARSAL=1            rehearse every stage on a CPU (gloo, no GPU check); SKIP_SETUP=1 keeps this Python
set -euo pipefail
cd "$(dirname "$0")/.."
depth=${1:-6}
injection=${2:-diagonal}
case "$depth" in 6|12|18|24) ;; *)
    echo "runs/speedrun.sh: depth '$depth' is none of the paper's sizes; pass 6, 12, 18 or 24" >&2; exit 2 ;; esac
case "$injection" in diagonal|concat|add|none) ;; *)
    echo "runs/speedrun.sh: injection '$injection' is not diagonal, concat, add or none (the Transformer)" >&2
    exit 2 ;; esac
rehearsal=${CPU_REHEARSAL:-0}

# No GPU: said before anything is installed or downloaded
if [ "$rehearsal" != 1 ] && ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "runs/speedrun.sh: no NVIDIA GPU here (nvidia-smi finds none), and the paper's runs need one; on a CPU," \
         "bash runs/cpu.sh trains a small model with no download" >&2
    exit 1
fi

export NANOPARCAE_BASE_DIR=${NANOPARCAE_BASE_DIR:-$HOME/.cache/nanoparcae}
export PYTHONUNBUFFERED=1  # each stage's lines as they come, through tee
mu_rec=8  # the paper's, at every size
run=d${depth}_${injection}
RECIPE=$NANOPARCAE_BASE_DIR/runs/$run/recipe
. runs/stage.sh
echo "== runs/speedrun.sh: depth $depth, injection $injection, run $run under $NANOPARCAE_BASE_DIR"

# setup: in this shell, so that its .venv stays active; quick once it is made
start=$SECONDS
if [ "${SKIP_SETUP:-0}" != 1 ]; then
    # runs/setup.sh would install the CPU build where no torch imports: the GPU's goes in first
    if [ "$rehearsal" != 1 ] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
        [ -x .venv/bin/python ] || python3 -m venv .venv
        echo "setup: installing ${TORCH_SPEC:-torch==2.13.0} from ${TORCH_INDEX:-PyPI}, the CUDA build (several GB)"
        .venv/bin/python -m pip install -q --upgrade pip
        .venv/bin/python -m pip install -q ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "${TORCH_SPEC:-torch==2.13.0}"
    fi
    . runs/setup.sh requirements.txt
fi
echo "== setup: done in $(hms $((SECONDS - start)))"
if [ "$rehearsal" != 1 ]; then
    gpus=$(python -c "import torch; print(torch.cuda.device_count())")
    if [ "$gpus" = 0 ]; then
        echo "runs/speedrun.sh: torch $(python -c 'import torch; print(torch.__version__)') sees no GPU; it is" \
             "the CPU build or the driver is too old: remove .venv and run again for PyPI's CUDA build" >&2
        exit 1
    fi
fi
export NPROC=${NPROC:-$([ "$rehearsal" = 1 ] && echo 2 || echo "$gpus")}
launch=(python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" --)
vocab=32768
if [[ " ${TRAIN_FLAGS:-} " =~ --vocab_size=([0-9]+) ]]; then vocab=${BASH_REMATCH[1]}; fi
stage machine python -m nanoparcae.report --run="$run" --machine

if [ "$rehearsal" != 1 ] && [ "${SKIP_GPU_CHECK:-0}" != 1 ]; then
    stage gpu_check bash runs/gpu_check.sh
fi

eta() {  # the download's lines, each shard's with how many are done and an eta
    local total=0 done=0 fetched=0 start=$SECONDS line
    while IFS= read -r line; do
        case "$line" in
            "Downloading "*" shards "*) total=$(echo "$line" | cut -d' ' -f2) ;;
            Downloaded*) done=$((done + 1)); fetched=$((fetched + 1))
                line="$line [$done/$total, eta $(hms $(((SECONDS - start) * (total - done) / fetched)))]" ;;
            Skipping*) done=$((done + 1)) ;;
        esac
        echo "$line"
    done
}
# A stage that is a function runs its commands in an `if` (stage's), where set -e is off: each one's `|| return`
download() {  # the hosts' addresses are dataset.py's and core_tasks.py's unless the environment names mirrors
    show python -m nanoparcae.dataset download ${DOWNLOAD_FLAGS:---depth=$depth} \
        ${FINEWEB_URL:+--base_url="$FINEWEB_URL"} | eta || return
    echo "\$ the eval bundle from ${EVAL_BUNDLE_URL:-EVAL_BUNDLE_URL in nanoparcae/core_tasks.py}"
    python -c "import sys; from nanoparcae.core_tasks import download_eval_bundle
try:
    print(f'the eval bundle: {download_eval_bundle(*sys.argv[1:])}')
except (OSError, ValueError) as err:
    sys.exit(f'the eval bundle: {err}')" ${EVAL_BUNDLE_URL:+"$EVAL_BUNDLE_URL"}
}
stage download download
stage tokenizer python -m nanoparcae.dataset tokenizer --data=fineweb-edu --vocab_size="$vocab"
# shellcheck disable=SC2086  # TRAIN_FLAGS and EVAL_FLAGS are lists of flags
stage train "${launch[@]}" train.py --depth="$depth" --injection="$injection" --mu_rec=$mu_rec --run="$run" \
    ${TRAIN_FLAGS:-}

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
stage report python -m nanoparcae.report --run="$run"
echo "== the report card: $NANOPARCAE_BASE_DIR/runs/$run/report.md"
