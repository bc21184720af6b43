"""
decoding.py: the decoding benchmark, teacher-forced decoding of the stdlib's validation text timed side by side:
fixed T, T_max = 2 mu_rec and --T=auto with either exit test; then the preallocated KV cache against a concatenating
one and full recomputation. These are bench.py's rows 5a and 5b, here for one checkpoint.

    python -m experiments.decoding                          # the latest checkpoint of the latest run
    python -m experiments.decoding --run=d12 --T=8 --max_new_tokens=512
"""

import argparse
import sys

import torch
import torch.nn.functional as F

from nanoparcae.checkpoint import load_run
from nanoparcae.common import parse_device
from nanoparcae.dataset import iter_documents
from engine import EXIT_THRESHOLDS, EXITS, teacher_forced
from experiments.timing import log, median_seconds, print_table
from model import decoding_initial_state

PROMPT = 16  # tokens of prompt before the max_new_tokens decoded

# -----------------------------------------------------------------------------
# The decoding rows: tokens/s and loss of teacher-forced decoding

class ConcatKVCache:
    """A KV cache that grows by concatenation, row 5b's reference: each new position copies every slot's whole cache
    (engine.KVCache's claim and update, without its preallocated size)."""

    def __init__(self):
        self.slots, self.pos = {}, 0

    def claim(self, length):
        self.pos += length

    def update(self, slot, k, v):
        if slot in self.slots:
            k_past, v_past = self.slots[slot]
            k, v = torch.cat([k_past, k], dim=2), torch.cat([v_past, v], dim=2)
        self.slots[slot] = (k, v)
        return k, v


def forward_per_token(model, ids, prompt_len, T, seed=0):
    """Row 5b's "concat": teacher-forced like engine.teacher_forced, but the prompt in one model() call into a
    ConcatKVCache, then model() on each position. -> mean loss."""
    generator = torch.Generator(ids.device).manual_seed(seed)
    h0 = decoding_initial_state((1, ids.size(1), model.config.d_model), ids.device, [generator])
    cache, losses = ConcatKVCache(), []
    with torch.no_grad():
        logits = model(ids[:, :prompt_len], T=T, h0=h0[:, :prompt_len], cache=cache)
        for p in range(prompt_len, ids.size(1)):
            losses.append(F.cross_entropy(logits[:, -1].float(), ids[:, p]))
            logits = model(ids[:, p:p + 1], T=T, h0=h0[:, p:p + 1], cache=cache)
    return torch.stack(losses).mean().item()


def stdlib_tokens(tokenizer, length, device):
    """(1, length) ids of the stdlib's validation split, documents joined by BOS: text every machine has."""
    ids = []
    for document in iter_documents("stdlib", "val"):
        ids += tokenizer.encode(document, prepend_bos=True)
        if len(ids) >= length:
            return torch.tensor([ids[:length]], device=device)
    raise ValueError(f"the stdlib's validation split has fewer than {length} tokens; lower max_new_tokens")


def decoding_rows(model, ids, prompt_len, T=None, exit_threshold=None, repeats=3, number="5"):
    """Teacher-forced decoding of ids[:, prompt_len:] (engine.teacher_forced), timed side by side: fixed T
    (default mu_rec), T_max = 2 mu_rec, --T=auto with either exit test; then the KV cache against a
    concatenating one and full recomputation, at T. -> two table rows (tokens/s, loss, steps per token)."""
    c = model.config
    T, T_max, new = T or c.mu_rec, 2 * c.mu_rec, ids.size(1) - prompt_len
    modes = {f"T={T}": dict(T=T), f"recompute T={T}": dict(T=T, use_cache=False)}
    if model.injection is not None:
        threshold = {exit: exit_threshold or EXIT_THRESHOLDS[exit] for exit in EXITS}
        modes.update({f"T={T_max}": dict(T=T_max), **{
            f"auto ({exit} < {threshold[exit]:g})": dict(T="auto", exit=exit, exit_threshold=threshold[exit])
            for exit in EXITS}})
    results = {}

    def run(name, length):
        if name == "concat":
            results[name] = (forward_per_token(model, ids[:, :length], prompt_len, T), T)
        else:
            results[name] = teacher_forced(model, ids[:, :length], prompt_len, **modes[name])

    for name in [*modes, "concat"]:
        run(name, prompt_len + min(8, new))  # warm-up: the first calls of every kernel are slow
    log(f"decoding: {new} tokens after a {prompt_len}-token prompt, {', '.join(modes)}, concat")
    seconds = median_seconds({name: lambda name=name: run(name, ids.size(1)) for name in [*modes, "concat"]},
                             repeats, warmup=0)
    rate = {name: new / s for name, s in seconds.items()}

    def cell(name):
        loss, steps = results[name]
        return f"{name}: {rate[name]:.1f} tok/s, loss {loss:.4f}, {steps:.2f} steps/token"

    what = f"(engine.teacher_forced, {new} tokens after a {prompt_len}-token prompt)"
    cache_row = (f"{number}b", f"KV cache at T={T} {what}: preallocated vs model() per token with a concatenating "
                 "cache vs full recomputation", f"{cell(f'T={T}')}; {cell('concat')}; {cell(f'recompute T={T}')}",
                 f"{rate[f'T={T}'] / rate['concat']:.2f}x concat, {rate[f'T={T}'] / rate[f'recompute T={T}']:.2f}x "
                 "recompute", f">= 1.5x concat: {'met' if rate[f'T={T}'] >= 1.5 * rate['concat'] else 'not met'}")
    if model.injection is None:
        return [cache_row]
    auto = next(name for name in modes if name.startswith("auto (state"))
    # auto against T_max, signed: negative where it saves time, positive where its exit tests cost more than they save
    time_change = rate[f"T={T_max}"] / rate[auto] - 1
    steps_change = results[auto][1] / T_max - 1
    loss_up = results[auto][0] / results[f"T={T}"][0] - 1
    met = time_change <= steps_change + 0.2 and loss_up <= 0.005  # time saved >= steps saved - 20 points
    depth_row = (f"{number}a", f"decoding depth {what}: fixed T = mu_rec and 2 mu_rec, --T=auto (state, the "
                 "default; KL)", "; ".join(cell(name) for name in modes if "recompute" not in name),
                 f"auto (state) vs T={T_max}: time {time_change:+.0%}, steps {steps_change:+.0%}; loss vs T={T} "
                 f"{loss_up:+.2%}{cost_split(rate, T, T_max, auto, results[auto][1])}",
                 f"time saved >= steps saved - 20%, loss <= +0.5%: {'met' if met else 'not met'}")
    return [depth_row, cache_row]


def cost_split(rate, T, T_max, auto, auto_steps):
    """Where a decoded token's time goes, from the two fixed depths: time(T) = fixed + T * step, the fixed
    part being the prelude, the coda, the head and the loop around them. In steps: the fixed part, and what
    --T=auto costs beyond its steps (the exit tests, the skipped slots' fill); then the most any exit test,
    however cheap, could save against T_max at auto's steps. Empty when T = T_max."""
    if T == T_max:
        return ""
    step = (1 / rate[f"T={T_max}"] - 1 / rate[f"T={T}"]) / (T_max - T)
    fixed = 1 / rate[f"T={T}"] - T * step
    exit_cost = 1 / rate[auto] - fixed - auto_steps * step
    return (f"; per token: fixed cost {fixed / step:.2f} steps, auto's exit cost {exit_cost / step:.2f} steps; "
            f"a free exit would save at most {(T_max - auto_steps) * step * rate[f'T={T_max}']:.0%}")


# -----------------------------------------------------------------------------
# Command line

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--ckpt", help="a checkpoint file (default: the latest of --run)")
    which.add_argument("--run", help="a run under <base dir>/runs (default: the most recently written)")
    parser.add_argument("--T", type=int, default=None, help="the fixed depth measured (default mu_rec)")
    parser.add_argument("--max_new_tokens", type=int, default=256, help="tokens decoded after the prompt")
    parser.add_argument("--exit_threshold", type=float, default=None,
                        help=f"--T=auto stops under this (default {EXIT_THRESHOLDS})")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats; the median is shown")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    for name in ("T", "max_new_tokens", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.exit_threshold is not None and args.exit_threshold <= 0:
        parser.error(f"--exit_threshold must be above 0, got {args.exit_threshold}")
    try:
        device = parse_device(args.device)
        model, tokenizer, _, path = load_run(args.ckpt or args.run, device)
        ids = stdlib_tokens(tokenizer, PROMPT + args.max_new_tokens, device)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"experiments.decoding: {err}")
    log(f"{path}: {model.num_params():,} parameters, mu_rec={model.config.mu_rec}, injection={model.config.injection}")
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        rows = decoding_rows(model, ids, PROMPT, args.T, args.exit_threshold, args.repeats)
    print_table(rows, f"decoding on {device}")


if __name__ == "__main__":
    main()
