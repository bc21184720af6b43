"""
nanoparcae/results.py: where an evaluation's results are kept, and which kept result is read back.
The run's own result sits beside its checkpoint as <stem>_<kind>_T<Ts>.json; the report card reads it.
"""

from nanoparcae.common import check_writable, print0, rank_and_world, read_json, write_json
from nanoparcae.dataset import data_key


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


def check_results_folder(ckpt_path):
    """Refuse before any work when rank 0 could not keep results beside ckpt_path."""
    if rank_and_world()[0] == 0:
        check_writable(ckpt_path.parent, "the results")


def keep_results(out, args, ckpt, ckpt_path, Ts, kind):
    """Write the results as JSON where result_path says, from rank 0."""
    if rank_and_world()[0] != 0:
        return
    # the harness's results say nothing of what they measured: they replace as before
    path, kept = result_path(ckpt, ckpt_path, kind, Ts, out.get("measured", {"data": None, "amount": 0}))
    path.parent.mkdir(exist_ok=True)
    write_json(path, {"ckpt": str(ckpt_path), "step": ckpt.get("step"), "args": vars(args), **out})
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
