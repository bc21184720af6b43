#!/bin/bash
# runs/setup.sh: the environment runs/cpu.sh and runs/test.sh share, made on the first run and reused after:
# .venv (created when absent), torch (skipped when it imports), then the requirements (pip returns in seconds when
# they are satisfied). Sourced by those scripts with the requirement files they need:
#
#     . runs/setup.sh requirements.txt                          # .venv with torch and the requirements, activated
#     . runs/setup.sh requirements.txt requirements-eval.txt    # and lm-eval
#     TORCH_SPEC="torch==2.13.0" . runs/setup.sh requirements.txt   # the torch to install when none imports
#     TORCH_INDEX=pypi . runs/setup.sh requirements.txt      # PyPI's torch: on Linux the CUDA build (several GB)
#     TORCH_INDEX=URL . runs/setup.sh requirements.txt       # torch from that wheel index
#
# By default, on Linux torch comes from PyTorch's CPU wheel index, tried with a short timeout; where it cannot be
# reached, PyPI's wheel, which on Linux is the CUDA build (several GB; it runs on a CPU too). On macOS PyPI's is the
# CPU build.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}  # the version the tests pass with
CPU_INDEX=https://download.pytorch.org/whl/cpu

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
fi
. .venv/bin/activate

torch_version() { python -c "import torch; print(torch.__version__)" 2>/dev/null; }

installed=$(torch_version || true)
if [ -n "$installed" ]; then
    echo "setup: torch $installed is installed"
elif [ "${TORCH_INDEX:-}" = pypi ]; then
    echo "setup: installing $TORCH_SPEC from PyPI (on $(uname -s); on Linux the CUDA build, several GB)"
    pip install -q "$TORCH_SPEC"
elif [ -n "${TORCH_INDEX:-}" ]; then
    echo "setup: installing $TORCH_SPEC from $TORCH_INDEX"
    pip install -q --index-url "$TORCH_INDEX" "$TORCH_SPEC"
elif [ "$(uname -s)" = Linux ]; then
    echo "setup: installing $TORCH_SPEC, the CPU build, from $CPU_INDEX"
    if ! pip install -q --index-url "$CPU_INDEX" --timeout 10 --retries 1 "$TORCH_SPEC"; then
        echo "setup: $CPU_INDEX cannot be reached; installing $TORCH_SPEC from PyPI instead, which on Linux is the" \
             "CUDA build: several GB, and it runs on a CPU too"
        pip install -q "$TORCH_SPEC"
    fi
else
    echo "setup: installing $TORCH_SPEC from PyPI (on $(uname -s), the CPU build)"
    pip install -q "$TORCH_SPEC"
fi
installed=${installed:-$(torch_version)}

echo "setup: $*"
files=()
for requirements in "$@"; do
    files+=(-r "$requirements")
done
pip install -q "${files[@]}" "torch==$installed"  # torch named: pip keeps this one or fails, never swaps it
