#!/bin/bash
# runs/stage.sh: the stages of a recipe, each run once. Sourced by runs/speedrun.sh and runs/cpu.sh after they set
# RECIPE, the run's recipe/ folder:
#
#     stage NAME COMMAND...    # runs COMMAND, its output also in $RECIPE/NAME.log, unless NAME finished before
#
# A stage that finishes leaves $RECIPE/NAME.done; the same recipe run again skips it, so a run that failed at any
# stage continues from there. Each start, end and skip is a line of $RECIPE/stages.jsonl, which the report card
# reads for the stages' times. A stage that fails stops the recipe with its status, saying what to do next.

show() {  # show COMMAND...: prints the command, then runs it (the lines of a stage that is a function)
    echo "\$ $*" >&2  # stderr: the command's own output may be going to a file
    "$@"
}

hms() {  # seconds -> 1h02m03s, 2m03s or 3s
    local s=$1
    if [ "$s" -ge 3600 ]; then printf '%dh%02dm%02ds' $((s / 3600)) $((s % 3600 / 60)) $((s % 60))
    elif [ "$s" -ge 60 ]; then printf '%dm%02ds' $((s / 60)) $((s % 60))
    else printf '%ds' "$s"; fi
}

stage() {
    local name=$1 start=$SECONDS status
    shift
    mkdir -p "$RECIPE"
    if [ -f "$RECIPE/$name.done" ]; then
        echo "== $name: finished before ($(hms "$(cat "$RECIPE/$name.done")")), skipped; its output: $RECIPE/$name.log"
        echo "{\"stage\": \"$name\", \"skipped\": true}" >>"$RECIPE/stages.jsonl"
        return 0
    fi
    echo "== $name: $*"
    echo "{\"stage\": \"$name\", \"started\": $(date +%s)}" >>"$RECIPE/stages.jsonl"
    if "$@" 2>&1 | tee -a "$RECIPE/$name.log"; then status=0; else status=${PIPESTATUS[0]}; fi
    local seconds=$((SECONDS - start))
    echo "{\"stage\": \"$name\", \"seconds\": $seconds, \"status\": $status}" >>"$RECIPE/stages.jsonl"
    if [ "$status" != 0 ]; then  # 2: bad input and 3: diverged fail again unless something changes
        case "$status" in
            2) next="change what its last line names; then the same command continues from here" ;;
            3) next="the run diverged: docs/troubleshooting.md says what to change; rerun alone repeats it" ;;
            *) next="the same command continues from here" ;;
        esac
        echo "== $name: failed (exit status $status) after $(hms $seconds); $next" >&2
        exit "$status"
    fi
    echo "$seconds" >"$RECIPE/$name.done"
    echo "== $name: done in $(hms $seconds)"
}
