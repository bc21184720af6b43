#!/bin/bash
# runs/evidence_cpu.sh: the paper's claims about Parcae as paired experiments on a laptop CPU, each with a 90%
# interval and a verdict (evidence.py; docs/evidence.md explains the design and the results). 76 runs, 75 minutes
# on a 2-core machine: the runs of train.py two at a time, a progress line with an ETA after each. Finished runs are
# skipped, so a killed suite continues where it stopped. Writes the figures, verdicts.json and
# figures/evidence_cpu/verdicts.md, and fills the evidence table of docs/evidence.md.
#
#     bash runs/evidence_cpu.sh                      # PYTHON=... to pick the interpreter, JOBS=... runs at once
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
"$PY" -m experiments.evidence plan | tail -n 1
"$PY" -m experiments.evidence run --jobs="${JOBS:-2}"
"$PY" -m experiments.evidence report --page=docs/evidence.md
