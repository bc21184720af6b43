#!/bin/bash
# runs/test.sh: set up (runs/setup.sh, with requirements-eval.txt for the lm-evaluation-harness's tests), rehearse
# runs/gpu_check.sh on the CPU (every stage of the GPU check, on a tiny model with 2 processes over gloo; about 2
# minutes), then run the tests: about 4 minutes on 2 cores; -rs says why any test is skipped. A second run reuses
# .venv. A rehearsal stage that fails stops it before the tests, with the check's table saying which.
#
#     bash runs/test.sh
set -euo pipefail
. "$(dirname "$0")/setup.sh" requirements.txt requirements-eval.txt
bash runs/gpu_check.sh --tiny
python -m pytest -q -rs tests
