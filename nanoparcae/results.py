"""
nanoparcae/results.py: where an evaluation's results are kept, and which kept result is read back.
The run's own result sits beside its checkpoint as <stem>_<kind>_T<Ts>.json, which the report card reads.
"""

import json
import math
import sys

from nanoparcae.command import EnvironmentFailure
from nanoparcae.files import check_writable, read_json, write_json
from nanoparcae.ranks import print0, rank_and_world
from nanoparcae.dataset import data_key


def run_data(ckpt):
    """The --data a checkpoint's run trained on."""
    return ckpt.get("args", {}).get("data", "fineweb-edu")


def own_result(ckpt_path, kind, Ts):
    """The run's own result of an eval of `kind` at the depths Ts, beside its checkpoint."""
    return ckpt_path.with_name(f"{ckpt_path.stem}_{kind}_T{'-'.join(map(str, Ts))}.json")


def amount(path):
    """What the result at path measured (tokens or CORE items), and 0 where it is absent or says nothing of it."""
    measured = (read_json(path) or {}).get("measured")
    value = measured.get("amount") if isinstance(measured, dict) else None
    return value if type(value) in (int, float) else 0


def result_path(ckpt, ckpt_path, kind, Ts, measured):
    """Where an eval's results go -> (path, the run's own result it leaves as it is, or None).
    An eval replaces the run's own only on the run's data, measuring as much or more.
    Any other goes to evals/, named after what it measured (data, amount and T)."""
    own = own_result(ckpt_path, kind, Ts)
    try:  # the content key the run recorded, or before records its --data's now
        recorded = ckpt.get("run", {}).get("data") or data_key(run_data(ckpt))
    except (FileNotFoundError, ValueError):  # its files are gone, so no data is its own
        recorded = None
    if measured["data"] in (None, recorded) and measured["amount"] >= amount(own):
        return own, None
    return ckpt_path.parent / "evals" / f"{own.stem}_{measured['data'] or 'core'}_{measured['amount']}.json", own


def check_results_folder(ckpt_path, kind, Ts, needs=1 << 16):
    """Refuse, before any work, results that rank 0 could not keep beside ckpt_path.
    A disk without room, or the result's name taken by a folder or a file of no result (read_json), is refused."""
    if rank_and_world()[0] == 0:
        check_writable(ckpt_path.parent, "the results", needs)
        own = own_result(ckpt_path, kind, Ts)
        try:
            taken = own.is_dir() or (own.parent / "evals").is_file()
            amount(own)  # a torn result there, or one of another kind, is named now
        except OSError as err:  # such as a name the filesystem finds too long
            taken = err.strerror
        if taken:
            raise ValueError(f"the results would go to {own}, whose name or evals/ beside it cannot be used"
                             f"{f' ({taken})' if taken is not True else ''}; nothing was computed, so move what "
                             f"is there away, or pass fewer depths (--T)")


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
    Such numbers say the weights diverged or overflow, so they are no run's result."""
    if not (bad := non_finite(out)):
        return False
    print0(f"error: the results of {ckpt_path} are not finite ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})"
           f"; its weights diverged or overflow, and nothing was written", file=sys.stderr)
    return True


def keep_results(out, args, ckpt, ckpt_path, Ts, kind):
    """Write the results as JSON where result_path says, from rank 0.
    A write that fails prints them on stdout as one JSON line, and EnvironmentFailure says why in one line."""
    if rank_and_world()[0] != 0:
        return
    path, kept = result_path(ckpt, ckpt_path, kind, Ts, out.get("measured", {"data": None, "amount": 0}))
    value = {"ckpt": str(ckpt_path), "step": ckpt.get("step"), "args": vars(args), **out}
    try:
        path.parent.mkdir(exist_ok=True)
        write_json(path, value)
    except (OSError, EnvironmentFailure) as err:
        print(json.dumps(value), flush=True)  # nothing computed is lost
        why = err if isinstance(err, OSError) else err.__cause__
        raise EnvironmentFailure(f"{path} could not be written ({getattr(why, 'strerror', why)}); the results "
                                 f"are the JSON line above, so save them there once it can be written") from None
    print0(f"Wrote {path}" + (f"; the run's own, {kept}, stays, as this eval measured other data, or less"
                              if kept else ""))


def widest(run_dir, pattern):
    """The run's own result matching pattern that measured most, or None.
    Ties go to the one over most depths, then to the newest."""
    def breadth(path):
        depths = (read_json(path) or {}).get("T")
        return amount(path), len(depths) if isinstance(depths, list) else 0, path.stat().st_mtime, path.name
    found = sorted(run_dir.glob(pattern), key=breadth)
    return found[-1] if found else None
