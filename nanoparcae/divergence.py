"""
nanoparcae/divergence.py: the rule that stops a diverged run, which docs/troubleshooting.md states for users.
"""

import math

from nanoparcae.checkpoint import latest
from nanoparcae.ranks import print0

STATE_NORM_LIMIT = 1e4  # ~256 ||e|| (||e|| ~ sqrt(d)), where bf16's 8 significant bits no longer resolve e beside h
VAL_LOSS_MARGIN = 1.0  # nats below a uniform guess ln V that show a run has learned


class Divergence:
    """The divergence rule, checked step by step (patience 0 never stops a run). An unlearned run is not judged by
    its val loss, as initial weights can score far above ln V. The state-norm limit stops a run in bfloat16 or when
    given, since past it the input no longer registers in u = Abar h + Bbar e; float32 resolves 2^16 times finer,
    so there a state past 2^16 x the limit warns once."""

    def __init__(self, vocab_size, dtype, patience, h_norm_limit=None, lowest_val_loss=math.inf):
        self.vocab_size, self.uniform, self.patience, self.dtype = vocab_size, math.log(vocab_size), patience, dtype
        self.h_norm_stops = h_norm_limit is not None or dtype == "bfloat16"
        self.h_norm_limit = h_norm_limit or STATE_NORM_LIMIT * (1 if self.h_norm_stops else 2 ** 16)
        self.bad_steps, self.lowest_val_loss, self.warned = 0, lowest_val_loss, False

    def check(self, step, finite, h_norm=None, val_loss=None):
        """Judge `step` -> None, a verdict with diverged_at, reason and detail, or a warning."""
        past = h_norm is not None and h_norm > self.h_norm_limit
        reason = "non-finite loss or gradients" if not finite else \
            f"||h_T|| > {self.h_norm_limit:g}" if past and self.h_norm_stops else None
        self.bad_steps = self.bad_steps + 1 if reason else 0
        if 0 < self.patience <= self.bad_steps:
            return {"diverged_at": step - self.bad_steps + 1, "reason": reason,
                    "detail": f"{self.bad_steps} steps in a row (to step {step})"}
        if val_loss is not None and self.patience > 0:
            learned = self.lowest_val_loss < self.uniform - VAL_LOSS_MARGIN
            lost = "non-finite val loss" if not math.isfinite(val_loss) else \
                "val loss back above a uniform guess" if learned and val_loss >= self.uniform else None
            if lost:
                return {"diverged_at": step, "reason": lost, "detail": f"{val_loss:.4f} against ln {self.vocab_size} "
                        f"= {self.uniform:.4f}, lowest before {self.lowest_val_loss:.4f}"}
        if val_loss is not None:
            self.lowest_val_loss = min(self.lowest_val_loss, val_loss)
        if past and not self.h_norm_stops and not self.warned:
            self.warned = True
            return {"warning": "h_norm", "h_norm": h_norm, "limit": self.h_norm_limit}
        return None

    def announce(self, verdict, step, run_dir):
        """check's verdict said in a line, naming the last checkpoint (from before it) -> its metrics record."""
        if "warning" in verdict:
            print0(f"warning: step {step}: ||h_T|| {verdict['h_norm']:.3g} > {verdict['limit']:g}; this "
                   f"{self.dtype} run goes on")
            return {"step": step, **verdict}
        kept = latest(run_dir)
        print0(f"diverged at step {verdict['diverged_at']}: {verdict['reason']}, {verdict['detail']}; "
               + (f"the last checkpoint, {kept}, from before, is kept" if kept
                  else "no checkpoint was saved before it"))
        return {"step": step, "diverged_at": verdict["diverged_at"], "reason": verdict["reason"]}
