"""
timing.py: the experiments' timers and tables.
It logs progress on stderr, times interleaved repeats and takes their medians, and formats markdown tables.
Imported, not run.
"""

import statistics
import sys
import time

import torch


def log(message):
    print(message, file=sys.stderr, flush=True)


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # CUDA kernels run asynchronously: wait for them before reading the clock


def timed(fn):
    synchronize()
    t0 = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - t0


def median_seconds(fns, repeats, warmup=1):
    """{name: fn} -> {name: median seconds of fn()}; warm-up calls first, then the fns take turns each repeat, so
    a shared machine's noise falls on all of them."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    seconds = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            seconds[name].append(timed(fn))
    return {name: statistics.median(s) for name, s in seconds.items()}


def markdown_table(header, rows):
    """A markdown table of header and rows, each a sequence of cells, as text."""
    return "\n".join([f"| {' | '.join(header)} |", "|---" * len(header) + "|"]
                     + [f"| {' | '.join(map(str, row))} |" for row in rows]) + "\n"


def print_table(rows, what):
    """Print a benchmark's rows under the columns #, what, result, ratio and target."""
    print(markdown_table(["#", what, "result", "ratio", "target"], rows), end="")
