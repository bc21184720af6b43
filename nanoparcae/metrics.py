"""
nanoparcae/metrics.py: what a run logs, metrics.jsonl and the step's log line, and a step's skip rule read.
"""

import json
import math
import sys

import torch
import torch.distributed as dist

from nanoparcae.command import EnvironmentFailure
from nanoparcae.files import disk_full, write_atomically
from nanoparcae.ranks import print0, rank_and_world

TEXT_FIELDS = ("warning", "reason", "stage")  # the fields of a record that hold text


def read_record(line, key):
    """A log's line -> its record, a JSON object holding `key` with numbers or null in all but TEXT_FIELDS, or None."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    typed = isinstance(record, dict) and key in record and (key != "step" or type(record[key]) is int) and all(
        name in TEXT_FIELDS or value is None or isinstance(value, (int, float)) for name, value in record.items())
    return record if typed else None


def read_metrics(path, key="step"):
    """A JSON-lines log, metrics.jsonl or the recipe's stages.jsonl (key "stage") -> its records, in order. A torn
    last line (a run killed while writing it) is skipped, any other line that holds no record counted in a warning."""
    try:
        lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
    except FileNotFoundError:
        return []
    except (IsADirectoryError, NotADirectoryError) as err:
        raise ValueError(f"{path} is not a file ({err.strerror}): move what is there away, then run again") from None
    except PermissionError as err:
        raise EnvironmentFailure(f"{path} cannot be read ({err.strerror}): make it readable, then run again") from None
    records = [read_record(line, key) for line in lines]
    bad = sum(record is None and bool(line.strip()) for line, record in zip(lines[:-1], records))  # last: torn
    if bad:
        print0(f"warning: {path}: {bad} line(s) that hold no record skipped", file=sys.stderr)
    return [record for record in records if record is not None]


class Metrics:
    """metrics.jsonl in the run folder, written by rank 0, and the step's log line. A run resumed from `step` keeps
    the records up to that step, so steps logged past its checkpoint stay once."""

    def __init__(self, run_dir, step, compiled=False):
        self.file, self.folder, self.start, self.compiled, self.tokens_per_s = None, run_dir, step, compiled, None
        self.graphs = self.counts().get("graphs")
        if rank_and_world()[0] != 0:
            return
        path = run_dir / "metrics.jsonl"
        kept = [json.dumps(record) + "\n" for record in read_metrics(path) if record.get("step", 0) <= step]
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            write_atomically(path, lambda partial: partial.write_text("".join(kept)))
            self.file = open(path, "a")
        except OSError as err:
            disk_full(run_dir, "metrics.jsonl cannot be written", err)

    def counts(self):
        """dynamo's graphs so far and the frames it ran eagerly past a recompile limit when compiled, else {}."""
        if not self.compiled:
            return {}
        from torch._dynamo.utils import counters
        hits = sum(n for why, n in counters["unimplemented"].items() if "Limit type:" in why and "recompile" in why)
        return {"graphs": counters["stats"]["unique_graphs"], "recompile_limits": hits}

    def record(self, entry):
        counts = self.counts()
        self.graphs = counts.get("graphs")  # so an eval's graphs are not the next step's
        if self.file:
            try:
                self.file.write(json.dumps({**entry, **counts}) + "\n")
                self.file.flush()
            except OSError as err:
                disk_full(self.folder, "metrics.jsonl cannot be written", err)

    def speed(self, step, tokens, seconds):
        """Tokens per second, smoothed over the steps past the first that compile no graph; None until one."""
        graphs = self.counts().get("graphs")
        if step > self.start + 1 and graphs == self.graphs:
            rate = tokens / seconds
            self.tokens_per_s = rate if self.tokens_per_s is None else 0.9 * self.tokens_per_s + 0.1 * rate
        self.graphs = graphs
        return self.tokens_per_s

    def log_step(self, entry, num_steps, total_batch_size, device):
        """Record a step and print its log line, without the fields that are None."""
        if device.type == "cuda":
            entry["peak_memory"] = torch.cuda.max_memory_allocated(device)
        fields = [("loss", "loss {:.4f}"), ("lr_mult", "lrm {:.2f}"), ("tokens_per_s", "{:,.0f} tok/s"), ("mfu",
                  "mfu {:.1%}"), ("rho", "rho {:.4f}"), ("h_norm", "|h_T| {:.2f}"), ("update_ratio", "dh/h {:.4f}")]
        eta = (num_steps - entry["step"]) * total_batch_size / (entry["tokens_per_s"] or math.nan)
        print0(" | ".join([f"step {entry['step']}/{num_steps}"]
                          + [form.format(entry[key]) for key, form in fields if entry.get(key) is not None]
                          + [f"eta {eta / 60:.1f} min"]))
        self.record(entry)


def read_step(grad_norm, loss_sum, stats):
    """The step's skip rule and log values read from the device in one wait -> each a float or None. non_finite
    and worst_h_norm are any rank's, so every rank skips alike."""
    h_norm = stats["h_norm"]
    worst = torch.stack([(~torch.isfinite(grad_norm)).float(),
                         torch.zeros((), device=grad_norm.device) if h_norm is None else h_norm.float()])
    if dist.is_initialized():
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
    values = {"non_finite": worst[0], "worst_h_norm": None if h_norm is None else worst[1], "loss": loss_sum,
              "grad_norm": grad_norm, **stats}
    present = [name for name, value in values.items() if value is not None]
    floats = dict(zip(present, torch.stack([values[name].float() for name in present]).tolist()))
    return {name: floats.get(name) for name in values}
