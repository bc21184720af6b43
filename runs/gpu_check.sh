#!/bin/bash
# runs/gpu_check.sh: the CUDA path checked in one command before a long run, 10 minutes at most on one H100 or H200
# node (its stages' limits, which add up to that or less; docs/performance.md records how long it took). It prints one
# markdown table, the one for docs/performance.md, and writes it to $OUT/gpu_check.md when $OUT is set (with every
# stage's output in $OUT/gpu_check.log). Each row says met / not met against its target where it has one; a row
# that cannot run says why in one line, and the rest go on. It exits 1 when a row failed or missed a target it is
# held to (the GPU's figures only on a GPU), 0 otherwise.
#
#   1. versions: torch, CUDA, the GPUs, and the bf16 matmul rate at the 140M's MLP shape (bench.py's row 9);
#   2. bench.py at the 140M (its CUDA default), rows 3-5, 7 and 9: FLOP/s Parcae vs the Transformer and MFU against
#      the measured matmul rate of the step train.py runs, compiled (row 9; matmul FLOPs executed), per-sequence
#      sampling's overhead at 32
#      sequences per GPU and at the device batch the depth-24 plan picks (row 3 again, at that batch), memory flat
#      in T, decoding, torch.compile;
#   3. the paper's 1.3B as users type it: `train.py --depth=24 --mu_rec=8 --dry_run`, the device batch it picks
#      for this GPU's free memory and its memory plan; then one compiled step of that model at that batch under
#      torchrun (DDP's buckets included), its peak torch.cuda.max_memory_allocated against the plan;
#   4. train.py --depth=6 --mu_rec=8 under torchrun on every GPU torch sees (NCCL), bf16 and compiled, 2
#      micro-batches per step on the stdlib corpus (no download): the workers are killed after step 7 and the same
#      command resumes from the checkpoint of step 5 to step 20, where it evaluates (one validation batch per
#      rank at T = 1, 2, 4, 8); eval_core.py under torchrun then scores a CORE subset of its checkpoint from a
#      bundle the check makes up (three tasks, offline); the same run is trained unbroken to step 20 beside it:
#      the loss falls, no recompilation after warm-up and no recompile limit hit (through the eval), tokens/s, each step logged once, the resumed run's losses
#      and weights equal to the unbroken run's; then 3 eager steps on every GPU against the same 3 in one process
#      with as many micro-batches (the same global batch, bf16; float32 on --tiny): their losses equal within a
#      tolerance (gpu_check.py's TARGETS), which a rank reading another data order breaks (skipped on one GPU);
#   5. bf16 against float32: the losses of 5 identical eager steps (8 x 2048), their relative difference.
#
#     bash runs/gpu_check.sh            # PYTHON=... to pick the interpreter (default python, else python3)
#     bash runs/gpu_check.sh --tiny     # every stage on a CPU: a tiny model, gloo, 2 processes (runs/test.sh runs it)
#     GPU_CHECK_FAULT=recompile_limit|perturb_resume|rank_order bash runs/gpu_check.sh [--tiny]  # 4b, 4d, 4f catch
#
# --tiny runs the same stages with a tiny model (dynamo's eager backend, bf16 autocast, 2 processes over gloo),
# and the depth-24 plan against a GPU faked to report 80 GB; figures that test the script, not the claims: it holds
# only the rows a CPU can meet to their targets (the run's life: the loss, recompilation, the kill and the resume).
# The faults: recompile_limit sets dynamo's recompile limits to 2 once model.compile_regions has run, in
# every train.py; perturb_resume scales a weight of the checkpoint the resume reads by 1.01; rank_order has rank 1
# read each epoch's chunks in reverse order, in every train.py.
# On a GPU machine without internet, install the requirements from wheel files fetched elsewhere first
# (docs/performance.md says how).
#
# Everything it writes is under $NANOPARCAE_BASE_DIR/gpu_check (default ~/.cache/nanoparcae/gpu_check): its runs
# gpu_check_*, replaced each time, the stdlib tokenizer, and the made-up CORE bundle, which there stands where
# eval_core.py looks for the real one and so never takes its place in your own base folder.
set -uo pipefail  # no -e: a stage that fails becomes its rows' "failed: ..." and the next stage runs
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}
tiny=0
case "${1:-}" in
    "") ;;
    --tiny) tiny=1 ;;
    *) echo "runs/gpu_check.sh: unknown argument '$1'; run it with no argument, or --tiny on a CPU" >&2; exit 2 ;;
esac
fault=${GPU_CHECK_FAULT:-}
case "$fault" in
    ""|recompile_limit|perturb_resume|rank_order) ;;
    *) echo "runs/gpu_check.sh: unknown GPU_CHECK_FAULT '$fault'; recompile_limit, perturb_resume or rank_order" >&2
       exit 2 ;;
esac
export NANOPARCAE_BASE_DIR=${NANOPARCAE_BASE_DIR:-$HOME/.cache/nanoparcae}/gpu_check
base=$NANOPARCAE_BASE_DIR
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
FAKE_GPU_BYTES=80000000000  # --tiny: the depth-24 plan against an 80 GB GPU, an H100's

# Each stage's time limit: process start-up + compilation + its steps x a per-step bound (STEP: one optimizer step of
# 2 micro-batches), cut to what is left of the whole check's limit. The GPU bounds are estimates, several times
# what an H100 should need except compilation's, and add up to the whole: no stage's limit is cut but by overruns.
# CACHED_S: the same graphs compiled again, which inductor reads from its on-disk cache.
if [ "$tiny" = 1 ]; then
    gpus=2
    MODEL=(--depth=3 --d_model=64 --head_dim=32 --mu_rec=8 --vocab_size=320 --seq_len=64)
    seq=64; vocab=320; micro=4; precision_micro=4; precision_steps=3
    steps=18; save_every=2; kill_at=3  # resumed from step 2 or 4: 10 steps of warm-up, then some without recompiling
    world_micro=4; world_dtype=float32
    COMPILE=(--compile=1 --compile_backend=eager)  # dynamo's tracing and guards without inductor's C++ (minutes)
    BENCH=(--depth 3 --d_model 64 --head_dim 32 --vocab_size 320 --seq_len 64 --batch_size 4 --steps 1 --repeats 1
           --new_tokens 16 --compile_backend eager)
    TOKENIZER=120; DRY=30; START=30; COMPILE_S=60; CACHED_S=60; COMPILE24_S=60; STEP=10; STEP24=5; EVAL=30; CORE=60
    BENCH_S=300; SAMPLING_S=60
    WHOLE=1800  # a shared CPU can crawl
else
    gpus=$("$PY" -m experiments.gpu_check gpus 2>/dev/null)  # CUDA_VISIBLE_DEVICES counts
    [ "${gpus:-0}" -ge 1 ] || gpus=1
    MODEL=(--depth=6 --mu_rec=8)  # train.py's defaults, the paper's, fill in the rest: d_model 768, vocab 32768
    seq=2048; vocab=32768; micro=8; precision_micro=8; precision_steps=5
    steps=20; save_every=5; kill_at=7  # the resumed leg: steps 6-20, 10 of warm-up, then five without recompiling
    world_micro=1; world_dtype=bfloat16  # one process's step: as many sequences as GPUs, 8 x 2048 on 8
    COMPILE=(--compile=1)
    BENCH=(--repeats 3)  # bench.py's CUDA default is the 140M, 16 x 2048 per step
    # a 140M step of 2 x 8 x 2048 runs in well under a second; the 1.3B's at the plan's batch in a few; the stdlib
    # tokenizer trains in 6 s; the depth-24 dry run took over 10 s on an H200 machine, where a process starts in
    # about 12 s; CORE scores 24 short items
    TOKENIZER=10; DRY=20; START=15; COMPILE_S=45; CACHED_S=25; COMPILE24_S=90; STEP=1; STEP24=10; EVAL=15; CORE=15
    BENCH_S=90; SAMPLING_S=12
    WHOLE=570  # 10 minutes, less the table's 30 s
fi
resumed_steps=$((steps - kill_at / save_every * save_every))
world_steps=3
declare -A LIMIT=([tokenizer]=$TOKENIZER [plan]=$DRY [plan_at]=$DRY [step24]=$((START + COMPILE24_S + STEP24))
    [ddp]=$((START + COMPILE_S + kill_at * STEP))
    [ddp_resume]=$((START + CACHED_S + resumed_steps * STEP + EVAL)) [core]=$((START + CORE))
    [unbroken]=$((START + CACHED_S + steps * STEP))
    [world]=$((START + world_steps * STEP)) [world_one]=$((START + world_steps * STEP))
    [fp32]=$((START + precision_steps * STEP)) [bf16]=$((START + precision_steps * STEP)) [bench]=$BENCH_S
    [sampling]=$((START + SAMPLING_S)))
limits=0
for name in "${!LIMIT[@]}"; do limits=$((limits + LIMIT[$name])); done
echo "== the stages' limits add up to $limits s, the whole check's limit is $WHOLE s" >&2
if [ "$limits" -gt "$WHOLE" ]; then
    echo "runs/gpu_check.sh: the stages' limits add up to $limits s, over the whole's $WHOLE s" >&2
    exit 2
fi
RUN=("${MODEL[@]}" --data=stdlib --log_every=1)

stage() {  # stage NAME LIMIT [--kill_after=STEP] COMMAND...: output to $work/NAME.log, "status limit" to NAME.rc.
           # --kill_after: SIGKILL the torchrun workers once run gpu_check_NAME has logged STEP; status 0 if so
    local name=$1 limit=$2 start=$SECONDS status kill_after="" pid launcher
    shift 2
    case "$1" in --kill_after=*) kill_after=${1#*=}; shift ;; esac
    local left=$((WHOLE - SECONDS))
    [ "$limit" -le "$left" ] || limit=$((left > 1 ? left : 1))
    echo "== $name (limit $limit s): $*" | tee "$work/$name.log" >&2
    PYTHONUNBUFFERED=1 timeout --kill-after=10 "$limit" "$@" >>"$work/$name.log" 2>&1 &
    pid=$!
    if [ -n "$kill_after" ]; then
        local metrics="$base/runs/gpu_check_$name/metrics.jsonl"
        until grep -qs "^{\"step\": $kill_after, \"loss\"" "$metrics" || ! kill -0 "$pid" 2>/dev/null; do
            sleep 0.1
        done
        launcher=$(pgrep -P "$pid")  # timeout -> torchrun -> the workers, each in its own session
        if [ -n "$launcher" ] && pkill -KILL -P "$launcher"; then
            wait "$pid"
            echo "== $name: killed the workers at step $(grep -c '"loss"' "$metrics")" | tee -a "$work/$name.log" >&2
            status=0
        else
            wait "$pid"
            status=$?
            echo "== $name: ended before step $kill_after" >>"$work/$name.log"
            [ "$status" != 0 ] || status=1
        fi
    else
        wait "$pid"
        status=$?
    fi
    echo "$status $limit" >"$work/$name.rc"
    echo "== $name: exit status $status after $((SECONDS - start)) s" | tee -a "$work/$name.log" >&2
}

train() {  # train NAME PROCESSES MICRO_BATCH ACCUM STEPS [--kill_after=STEP] FLAGS...: train.py as run
           # gpu_check_NAME (NAME_resume continues it) under LIMIT[NAME]; PROCESSES 0 is a plain python process, N
           # torchrun's N, which start TRAIN themselves (--no_python)
    local name=$1 procs=$2 batch=$3 accum=$4 num_steps=$5 launch=() kill=()
    shift 5
    case "${1:-}" in --kill_after=*) kill=("$1"); shift ;; esac
    # "--" ends torchrun's own flags: without it, it takes train.py's --run for an abbreviation of its --run_path
    [ "$procs" -gt 0 ] && launch=("$PY" -m torch.distributed.run --standalone --nproc_per_node="$procs" --no_python --)
    local tokens=$((batch * seq * (procs > 0 ? procs : 1) * accum))
    [[ "$name" == *_resume ]] || rm -rf "$base/runs/gpu_check_$name"
    stage "$name" "${LIMIT[$name]}" "${kill[@]}" "${launch[@]}" "${TRAIN[@]}" "${RUN[@]}" \
        --device_batch_size="$batch" --total_batch_size="$tokens" --max_tokens=$((tokens * num_steps)) \
        --run="gpu_check_${name%_resume}" "$@"
}

# the command each training stage runs: train.py, or the same with the fault of lowered recompile limits or of rank
# 1's data order
TRAIN=("$PY" train.py)
case "$fault" in recompile_limit|rank_order) TRAIN=("$PY" -m experiments.gpu_check run --fault="$fault" train.py) ;;
esac
FAKE_GPU=("$PY" -m experiments.gpu_check run --fake_gpu=$FAKE_GPU_BYTES)  # SCRIPT ARGS: with torch.cuda faked

rm -rf "$base/eval_bundle"
mkdir -p "$base"
"$PY" -m experiments.gpu_check bundle "$base/eval_bundle"
# the tokenizer first, under a limit of its own (trained once, then cached under $base)
stage tokenizer "${LIMIT[tokenizer]}" "$PY" -m nanoparcae.tokenizer --data=stdlib --vocab_size=$vocab
if [ "$tiny" = 1 ]; then
    stage plan "${LIMIT[plan]}" "${FAKE_GPU[@]}" train.py --depth=24 --mu_rec=8 --device=cuda --dry_run
    memory=$FAKE_GPU_BYTES
else
    stage plan "${LIMIT[plan]}" "$PY" train.py --depth=24 --mu_rec=8 --dry_run
    # the free memory, which train.py plans the device batch for
    memory=$("$PY" -m experiments.gpu_check free_memory 2>/dev/null || echo 0)
fi
batch24=$("$PY" -m experiments.gpu_check planned_batch "$work/plan.log" "$memory" 2>/dev/null)
echo "== plan: device batch ${batch24:-none} for $memory bytes" >>"$work/plan.log"
if [ -n "$batch24" ]; then
    if [ "$tiny" = 1 ]; then
        stage plan_at "${LIMIT[plan_at]}" "${FAKE_GPU[@]}" train.py --depth=24 --mu_rec=8 --device=cuda \
            --device_batch_size="$batch24" --total_batch_size=$((batch24 * 2048)) --dry_run
        # one step of the tiny model stands in for the 1.3B's: the same launch, a CPU's worth of model
        train step24 1 $micro 1 2 --kill_after=1 --dtype=bfloat16 "${COMPILE[@]}" \
            --eval_every=100000 --eval_tokens=$((micro * seq)) --save_every=100000
    else
        stage plan_at "${LIMIT[plan_at]}" "$PY" train.py --depth=24 --mu_rec=8 --device_batch_size="$batch24" \
            --total_batch_size=$((batch24 * 2048)) --dry_run
        # under torchrun for DDP's buckets, which the plan counts; killed after its first step: the 1.3B's
        # checkpoint would take longer to write than the step
        rm -rf "$base/runs/gpu_check_step24"
        stage step24 "${LIMIT[step24]}" --kill_after=1 "$PY" -m torch.distributed.run --standalone \
            --nproc_per_node=1 -- train.py --depth=24 --mu_rec=8 --data=stdlib --device_batch_size="$batch24" \
            --total_batch_size=$((batch24 * 2048)) --max_tokens=$((batch24 * 2048 * 2)) --run=gpu_check_step24 \
            --dtype=bfloat16 --compile=1 --log_every=1 --eval_every=100000 --eval_tokens=$((batch24 * 2048)) \
            --save_every=100000
    fi
fi
# the validation batches: one micro-batch per rank, which the stdlib's validation split holds for 8 ranks (it holds
# less than 8 x 32 x 2049 tokens, so not at the paper's micro-batch of 32)
TRAIN_FLAGS=(--dtype=bfloat16 "${COMPILE[@]}" --save_every=$save_every --eval_tokens=$((micro * seq * gpus)))
DDP_FLAGS=("${TRAIN_FLAGS[@]}" --eval_every=$steps)
train ddp "$gpus" $micro 2 $steps --kill_after=$kill_at "${DDP_FLAGS[@]}"
if [ "$fault" = perturb_resume ]; then
    resumed=$(ls "$base/runs/gpu_check_ddp"/ckpt_*.pt 2>/dev/null | tail -n 1)
    "$PY" -m experiments.gpu_check perturb "$resumed"
fi
train ddp_resume "$gpus" $micro 2 $steps "${DDP_FLAGS[@]}"
# CORE of the resumed run's checkpoint on every GPU, from the made-up bundle: 3 tasks, 8 items each
stage core "${LIMIT[core]}" "$PY" -m torch.distributed.run --standalone --nproc_per_node="$gpus" --no_python -- \
    "$PY" eval_core.py --run=gpu_check_ddp --max_per_task=8
# the same run without the kill; its evals would come after its last update, so it skips them
train unbroken "$gpus" $micro 2 $steps "${TRAIN_FLAGS[@]}" --eval_every=100000
if [ "$gpus" -gt 1 ]; then  # every GPU, one micro-batch each; then one process, as many micro-batches
    WORLD_FLAGS=(--dtype=$world_dtype --compile=0 --eval_every=100000 --eval_tokens=$((world_micro * seq * gpus))
                 --save_every=100000)
    train world "$gpus" $world_micro 1 $world_steps "${WORLD_FLAGS[@]}"
    train world_one 0 $world_micro "$gpus" $world_steps "${WORLD_FLAGS[@]}"
fi
train fp32 0 $precision_micro 1 $precision_steps --dtype=float32 --compile=0 --eval_every=100000 \
    --eval_tokens=$((precision_micro * seq)) --save_every=100000
train bf16 0 $precision_micro 1 $precision_steps --dtype=bfloat16 --compile=0 --eval_every=100000 \
    --eval_tokens=$((precision_micro * seq)) --save_every=100000
ckpt=$(ls "$base/runs/gpu_check_ddp"/ckpt_*.pt 2>/dev/null | tail -n 1)
stage bench "${LIMIT[bench]}" "$PY" -m experiments.bench --rows 3,4,5,7,9 "${BENCH[@]}" ${ckpt:+--ckpt "$ckpt"} \
    --json "$work/bench.json"
if [ -n "$batch24" ] && [ "$batch24" != 32 ]; then  # row 3 again, at the device batch the 1.3B trains at
    stage sampling "${LIMIT[sampling]}" "$PY" -m experiments.bench --rows 3 "${BENCH[@]}" --batch_size="$batch24" \
        --json "$work/sampling.json"
fi

"$PY" -m experiments.gpu_check table "$work" "$base/runs" --gpus "$gpus" --memory "$memory" \
    $([ "$tiny" = 1 ] && echo --tiny) >"$work/table.md"
status=$?
cat "$work/table.md"
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp "$work/table.md" "$OUT/gpu_check.md"
    cat "$work"/*.log >"$OUT/gpu_check.log"
fi
exit $status
