"""
nanoparcae/results.py: where an evaluation's results are kept, and which kept result is read back.
The run's own result sits beside its checkpoint as <stem>_<kind>_T<Ts>.json; the report card reads it.
"""

import json
import math
import os
import sys
import tempfile

from nanoparcae.command import EnvironmentFailure
from nanoparcae.files import NO_WRITE, check_writable, read_json, write_json
from nanoparcae.ranks import print0, rank_and_world
from nanoparcae.core_tasks import EXTENDED_TASKS
from nanoparcae.dataset import data_key

TASK_BYTES = 400  # a task's lines in a CORE run's JSON: its items, accuracy, centered accuracy, why skipped
DEPTH_BYTES = 200  # a depth's numbers in a bpb or ppl result


def run_data(ckpt):
    """The --data a checkpoint's run trained on."""
    return ckpt.get("args", {}).get("data", "fineweb-edu")


def result_path(ckpt, ckpt_path, kind, Ts, measured):
    """Where an eval's results go -> (path, the run's own result it leaves as it is, or None).
    The key is what the eval measured: data, amount (tokens or CORE items) and T.
    An eval replaces the run's own only on the run's data, measuring as much or more.
    Any other goes to evals/, named after what it measured."""
    name = f"{ckpt_path.stem}_{kind}_T{'-'.join(map(str, Ts))}"
    own = ckpt_path.with_name(f"{name}.json")
    try:  # the content key the run recorded; before records, its --data's now
        recorded = ckpt.get("run", {}).get("data") or data_key(run_data(ckpt))
    except (FileNotFoundError, ValueError):  # its files are gone: no data is its own
        recorded = None
    try:
        there = (read_json(own) or {}).get("measured", {})
    except ValueError:  # torn: nothing to keep
        there = {}
    if measured["data"] in (None, recorded) and measured["amount"] >= there.get("amount", 0):
        return own, None
    aside = f"{name}_{measured['data'] or 'core'}_{measured['amount']}.json"
    return ckpt_path.parent / "evals" / aside, own


def result_bytes(args, Ts):
    """An upper estimate of an eval's JSON: its flags, then each depth's numbers, or each depth and seed's tasks."""
    flags = len(json.dumps(vars(args), indent=2, default=str))
    if args.eval == "core":
        return 4096 + 2 * flags + len(Ts) * len(args.seeds) * len(EXTENDED_TASKS) * TASK_BYTES
    return 4096 + 2 * flags + len(Ts) * DEPTH_BYTES


def check_results_folder(ckpt_path, needs=1 << 16):
    """Refuse before any work when rank 0 could not keep `needs` bytes of results beside ckpt_path."""
    if rank_and_world()[0] == 0:
        check_writable(ckpt_path.parent, "the results", needs)


def non_finite(value, where=""):
    """The keys of value's NaN or infinite numbers, such as loss[2] or fit.L_inf."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [where]
    if isinstance(value, dict):
        return [key for k, v in value.items() for key in non_finite(v, f"{where}.{k}" if where else str(k))]
    if isinstance(value, list):
        return [key for i, v in enumerate(value) for key in non_finite(v, f"{where}[{i}]")]
    return []


def refuse_non_finite(out, ckpt_path):
    """Refuse results that hold NaN or infinity, in one line -> whether it refused them.
    Such numbers say the weights diverged or overflow: they are no run's result."""
    bad = non_finite(out)
    if not bad:
        return False
    print0(f"error: the results of {ckpt_path} are not finite ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''}):"
           f" its weights diverged or overflow; nothing was written", file=sys.stderr)
    return True


def spare_copy(path, value):
    """Keep value as JSON in the temporary folder -> where it went; printed on stdout when that fails too."""
    try:
        handle, name = tempfile.mkstemp(prefix=f"{path.stem}.", suffix=".json")
        try:
            with os.fdopen(handle, "w") as spare:
                spare.write(json.dumps(value, indent=2) + "\n")
            return name
        except OSError:
            os.unlink(name)
            raise
    except OSError:
        print(json.dumps(value), flush=True)
        return "stdout, as the JSON line above"


def keep_results(out, args, ckpt, ckpt_path, Ts, kind):
    """Write the results as JSON where result_path says, from rank 0.
    A disk that refuses them keeps them in spare_copy's place, named in the one line of EnvironmentFailure."""
    if rank_and_world()[0] != 0:
        return
    # the harness's results say nothing of what they measured: they replace as before
    path, kept = result_path(ckpt, ckpt_path, kind, Ts, out.get("measured", {"data": None, "amount": 0}))
    value = {"ckpt": str(ckpt_path), "step": ckpt.get("step"), "args": vars(args), **out}
    try:
        path.parent.mkdir(exist_ok=True)
        write_json(path, value)
    except (OSError, EnvironmentFailure) as err:
        why = err if isinstance(err, OSError) else err.__cause__
        if not isinstance(why, OSError) or why.errno not in NO_WRITE:
            raise
        raise EnvironmentFailure(f"{path} could not be written ({why.strerror}); the results are kept in "
                                 f"{spare_copy(path, value)}: copy them to {path} once it can be written") from None
    print0(f"Wrote {path}" + (f"; the run's own, {kept}, stays: this eval measured other data, or less"
                              if kept else ""))


def widest(run_dir, pattern):
    """The run's own result matching pattern that measured most, or None.
    Ties go to the one over most depths, then to the newest."""
    def breadth(path):
        result = read_json(path) or {}
        return result.get("measured", {}).get("amount", 0), len(result.get("T", [])), path.stat().st_mtime, path.name
    found = sorted(run_dir.glob(pattern), key=breadth)
    return found[-1] if found else None
