#!/bin/bash
# runs/gpu_check.sh: the CUDA path checked in one command, about 5 minutes on one H100 or H200 (not yet measured).
# It prints one markdown table, the one for docs/performance.md, and writes it to $OUT/gpu_check.md
# when $OUT is set (with every stage's output in $OUT/gpu_check.log). Each row says met / not met against its
# target where it has one; a row that cannot run says why in one line, and the rest go on.
#
#   1. versions: torch, CUDA, the GPU, and its bf16 matmul rate at the 140M's shapes (bench.py's row 2);
#   2. bench.py at the 140M (its CUDA default), rows 1-5 and 7: FLOP/s Parcae vs the Transformer and MFU against
#      the measured matmul rate (both of the matmul FLOPs executed), per-sequence sampling's overhead at 32
#      sequences per GPU, memory flat in T, decoding, torch.compile;
#   3. train.py --depth=6 --mu_rec=8, bf16 and compiled, 50 steps of one 32 x 2048 micro-batch on the stdlib
#      corpus (no download): the loss falls, no recompilation after step 10, tokens/s; then 10 steps of the
#      same under torchrun with one process per GPU present (NCCL), ending in a checkpoint;
#   4. that torchrun run's peak torch.cuda.max_memory_allocated against train.py --dry_run's plan;
#   5. bf16 against float32: the losses of 5 identical eager steps (8 x 2048), their relative difference.
#
#     bash runs/gpu_check.sh            # PYTHON=... to pick the interpreter (default python, else python3)
#     bash runs/gpu_check.sh --tiny     # the same rows on a tiny model on a CPU, ~40 s on 2 cores (a test runs it)
#
# On a GPU machine without internet, install the requirements from wheel files fetched elsewhere first
# (docs/performance.md says how).
#
# Runs are named gpu_check_* under $NANOPARCAE_BASE_DIR/runs (default ~/.cache/nanoparcae/runs), replaced each time.
# Every stage has a time limit, 8.5 minutes in all on a GPU, so the table is always written.
set -uo pipefail  # no -e: a stage that fails becomes its rows' "failed: ..." and the next stage runs
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}
tiny=0
case "${1:-}" in
    "") ;;
    --tiny) tiny=1 ;;
    *) echo "runs/gpu_check.sh: unknown argument '$1'; run it with no argument, or --tiny on a CPU" >&2; exit 2 ;;
esac
base=${NANOPARCAE_BASE_DIR:-$HOME/.cache/nanoparcae}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$gpus" -ge 1 ] || gpus=1

if [ "$tiny" = 1 ]; then
    MODEL=(--depth=3 --d_model=64 --head_dim=32 --mu_rec=8 --vocab_size=320 --seq_len=64)
    seq=64; micro=4; steps=20; ddp_steps=3; precision_micro=4; precision_steps=3
    COMPILE=(--compile=1 --compile_backend=eager)  # dynamo's tracing and guards without inductor's C++ (minutes)
    BENCH=(--depth 3 --d_model 64 --head_dim 32 --vocab_size 320 --seq_len 64 --batch_size 4 --steps 1 --repeats 1
           --new_tokens 16 --compile_backend eager)
    declare -A LIMIT=([train]=300 [fp32]=300 [bf16]=300 [ddp]=300 [bench]=300)  # loose: a shared CPU can crawl
else
    MODEL=(--depth=6 --mu_rec=8)  # train.py's defaults, the paper's, fill in the rest: d_model 768, vocab 32768
    seq=2048; micro=32; steps=50; ddp_steps=10; precision_micro=8; precision_steps=5
    COMPILE=(--compile=1)
    BENCH=(--repeats 3)  # bench.py's CUDA default is the 140M, 16 x 2048 per step
    declare -A LIMIT=([train]=160 [fp32]=40 [bf16]=40 [ddp]=70 [dry_run]=20 [bench]=180)  # 8.5 minutes
fi
# evals and CORE kept out of the way: one eval batch at the end
RUN=("${MODEL[@]}" --data=stdlib --eval_every=100000 --eval_tokens=$((micro * seq)) --core_every=-1
     --save_every=100000 --log_every=1)

stage() {  # stage NAME COMMAND...: its output to $work/NAME.log, "exit status, time limit" to $work/NAME.rc
    local name=$1 start=$SECONDS status
    shift
    echo "== $name: $*" | tee "$work/$name.log" >&2
    PYTHONUNBUFFERED=1 timeout --kill-after=10 "${LIMIT[$name]}" "$@" >>"$work/$name.log" 2>&1
    status=$?
    echo "$status ${LIMIT[$name]}" >"$work/$name.rc"
    echo "== $name: exit status $status after $((SECONDS - start)) s" | tee -a "$work/$name.log" >&2
}

train() {  # train NAME PROCESSES MICRO_BATCH STEPS FLAGS...: train.py as run gpu_check_NAME, started afresh;
           # PROCESSES 0 is a plain python process, N > 0 torchrun's N processes
    local name=$1 procs=$2 batch=$3 num_steps=$4 launch=()
    shift 4
    # "--" ends torchrun's own flags: without it, it takes train.py's --run for an abbreviation of its --run_path
    [ "$procs" -gt 0 ] && launch=(-m torch.distributed.run --standalone --nproc_per_node="$procs" --)
    local tokens=$((batch * seq * (procs > 0 ? procs : 1)))
    rm -rf "$base/runs/gpu_check_$name"
    stage "$name" "$PY" "${launch[@]}" train.py "${RUN[@]}" --device_batch_size="$batch" --total_batch_size="$tokens" \
        --max_tokens=$((tokens * num_steps)) --run="gpu_check_$name" "$@"
}

train train 0 $micro $steps --dtype=bfloat16 "${COMPILE[@]}"
train fp32 0 $precision_micro $precision_steps --dtype=float32 --compile=0
train bf16 0 $precision_micro $precision_steps --dtype=bfloat16 --compile=0
train ddp "$gpus" $micro $ddp_steps --dtype=bfloat16 "${COMPILE[@]}"
if [ "$tiny" = 0 ]; then  # the torchrun run's plan per GPU (no GPU, no peak to hold it against)
    stage dry_run "$PY" train.py "${RUN[@]}" --device_batch_size=$micro --dtype=bfloat16 --dry_run
fi
ckpt=$(ls "$base/runs/gpu_check_train"/ckpt_*.pt 2>/dev/null | tail -n 1)
stage bench "$PY" -m experiments.bench --rows 1,2,3,4,5,7 "${BENCH[@]}" ${ckpt:+--ckpt "$ckpt"} --json "$work/bench.json"

"$PY" -m experiments.gpu_check "$work" "$base/runs" --gpus "$gpus" $([ "$tiny" = 1 ] && echo --tiny) >"$work/table.md"
status=$?
cat "$work/table.md"
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp "$work/table.md" "$OUT/gpu_check.md"
    cat "$work"/*.log >"$OUT/gpu_check.log"
fi
exit $status
