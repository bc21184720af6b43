#!/bin/bash
# runs/test.sh: set up (runs/setup.sh, with requirements-eval.txt for the lm-evaluation-harness's tests), then run
# the tests: about 3.5 minutes on 2 cores; -rs says why any test is skipped. A second run reuses .venv.
#
#     bash runs/test.sh
set -euo pipefail
. "$(dirname "$0")/setup.sh" requirements.txt requirements-eval.txt
python -m pytest -q -rs tests
