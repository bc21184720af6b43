"""
sample.py: text from a trained Parcae checkpoint, at any recurrence depth, streamed as it is made.

    python sample.py --T=32 --prompt="The first law of thermodynamics"   # latest checkpoint of the latest run
    python sample.py --run=d12 --T=auto --num_samples=3 --seed=7          # adaptive depth, three samples
    python sample.py                                                      # interactive when stdin is a terminal
    echo "def fibonacci(n):" | python sample.py --temperature=0           # the prompt from a pipe, greedy
    python sample.py --benchmark                                          # tokens/s and loss: fixed T, auto, caches

--T is any positive integer, independent of the mu_rec the model trained with (METHOD.md §3: test-time scaling);
it defaults to mu_rec. --T=auto (beyond the paper) stops each new token's recurrence once it settles, after
step t >= 2 or at --T_max, by --exit's test under --exit_threshold. Sample i uses its own generator, seeded
--seed + i, for its h0 draws and its sampling. How decoding works (the KV cache, the exit tests): engine.py.

--benchmark times teacher-forced decoding of the stdlib's validation text: fixed T, T_max and --T=auto with
either exit test, and the KV cache against the first release's decoding and full recomputation (the rows
bench.py's row 5 prints for a checkpoint).
"""

import argparse
import codecs
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from common import find_checkpoint, get_base_dir, load_checkpoint, log, median_seconds, print_table
from data import iter_documents
from engine import EXIT_THRESHOLDS, EXITS, generate, teacher_forced
from hub import known_ids, load_pretrained
from tokenizer import Tokenizer

BENCHMARK_PROMPT = 16  # --benchmark: tokens of prompt before the max_new_tokens decoded

# -----------------------------------------------------------------------------
# The decoding benchmark (--benchmark, and bench.py's row 5): tokens/s and loss of teacher-forced decoding

class ConcatKVCache:
    """The first release's concatenating KV cache, the reference of row 5b: every new position concatenates,
    copying each slot's whole cache (engine.KVCache's claim and update, without its fixed size)."""

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
    """Row 5b's "before": decoding as the first release did it, teacher-forced like engine.teacher_forced: the
    prompt in one model() call into a ConcatKVCache, then model() on each position. -> mean loss."""
    generator = torch.Generator(ids.device).manual_seed(seed)
    h0 = model.initial_state((1, ids.size(1), model.config.d_model), ids.device, torch.float32, generator)
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
    (default mu_rec), T_max = 2 mu_rec, --T=auto with either exit test; then the KV cache against the old
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
        if name == "before":
            results[name] = (forward_per_token(model, ids[:, :length], prompt_len, T), T)
        else:
            results[name] = teacher_forced(model, ids[:, :length], prompt_len, **modes[name])

    for name in [*modes, "before"]:
        run(name, prompt_len + min(8, new))  # warm-up: the first calls of every kernel are slow
    log(f"decoding: {new} tokens after a {prompt_len}-token prompt, {', '.join(modes)}, before")
    seconds = median_seconds({name: lambda name=name: run(name, ids.size(1)) for name in [*modes, "before"]},
                             repeats, warmup=0)
    rate = {name: new / s for name, s in seconds.items()}

    def cell(name):
        loss, steps = results[name]
        return f"{name}: {rate[name]:.1f} tok/s, loss {loss:.4f}, {steps:.2f} steps/token"

    what = f"(engine.teacher_forced, {new} tokens after a {prompt_len}-token prompt)"
    cache_row = (f"{number}b", f"KV cache at T={T} {what}: preallocated vs the first release's decoding (model() per "
                 "token, concatenating cache) vs full recomputation",
                 f"{cell(f'T={T}')}; {cell('before')}; {cell(f'recompute T={T}')}",
                 f"{rate[f'T={T}'] / rate['before']:.2f}x before, {rate[f'T={T}'] / rate[f'recompute T={T}']:.2f}x "
                 "recompute", f">= 1.5x before: {'met' if rate[f'T={T}'] >= 1.5 * rate['before'] else 'not met'}")
    if model.injection is None:
        return [cache_row]
    auto = next(name for name in modes if name.startswith("auto (state"))
    # auto against T_max, signed: time -33% where it saves, +7% where its exit tests cost more than they save
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

def parse_depth(value):
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"--T must be a positive integer or 'auto', got {value!r}")
    return int(value)


def load(args, device):
    """-> (model, tokenizer, checkpoint path); FileNotFoundError / ValueError carry a one-line message."""
    if args.from_:  # the authors' release (hub.py)
        model, tokenizer = load_pretrained(args.from_, device, need_tokenizer=True)
        return model, tokenizer, args.from_
    path = Path(args.ckpt) if args.ckpt else find_checkpoint(get_base_dir() / "runs", args.run)
    model, ckpt = load_checkpoint(path, device)
    tokenizer_dir = Path(ckpt.get("tokenizer_dir", ""))
    if not (tokenizer_dir / "tokenizer.tiktoken").is_file():
        raise FileNotFoundError(f"the tokenizer of checkpoint {path} is not at {tokenizer_dir}; recreate it with "
                                f"`python data.py tokenizer` and the run's --data and --vocab_size")
    tokenizer = Tokenizer.load(tokenizer_dir)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer at {tokenizer_dir} has {tokenizer.vocab_size} tokens, the model "
                         f"{model.config.vocab_size}: they are not from the same run")
    return model, tokenizer, path


def stream_samples(model, tokenizer, prompt, args, device, allowed=None):
    """Sample after sample, each token printed as it is made; a sample ends early at <|bos|> (a new document).
    allowed: the ids that may be sampled (hub.known_ids), None for all."""
    ids = tokenizer.encode(prompt, prepend_bos=True)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"\n--- sample {i + 1}/{args.num_samples}")
        print(prompt, end="", flush=True)
        generator = torch.Generator(device).manual_seed(args.seed + i)
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span tokens
        depths, t0 = [], time.perf_counter()
        for next_ids, steps in generate(model, ids, args.max_new_tokens, args.T, args.temperature, args.top_k,
                                        generator, args.exit, args.exit_threshold, args.T_max, allowed=allowed):
            token = int(next_ids[0])
            if token == tokenizer.bos_id:
                break
            depths.append(int(steps[0]))
            print(utf8.decode(tokenizer.enc.decode_single_token_bytes(token)), end="", flush=True)
        print(utf8.decode(b"", final=True))
        seconds = time.perf_counter() - t0
        print(f"[{len(depths)} tokens, {len(depths) / seconds:.1f} tokens/s, "
              f"{sum(depths) / max(1, len(depths)):.2f} recurrent steps per token]", file=sys.stderr)


def benchmark(model, tokenizer, args):
    """bench.py's decoding rows for this model: teacher-forced decoding of the stdlib's validation text."""
    ids = stdlib_tokens(tokenizer, BENCHMARK_PROMPT + args.max_new_tokens, model.wte.weight.device)
    print_table(decoding_rows(model, ids, BENCHMARK_PROMPT, args.T, args.exit_threshold, args.repeats),
                f"decoding on {ids.device}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--ckpt", help="a checkpoint file (default: the latest of --run)")
    which.add_argument("--run", help="a run under <base dir>/runs (default: the most recently written)")
    which.add_argument("--from", dest="from_", help="the authors' release: a Hub repo id (SandyResearch/parcae-140m) "
                                                    "or a folder with config.json, model.pt, tokenizer.json")
    parser.add_argument("--prompt", help="default: a loop when stdin is a terminal, else stdin")
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    parser.add_argument("--top_k", type=int, default=50, help="0 keeps every token")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--T", type=parse_depth, default=None, help="recurrence depth, or auto (default mu_rec)")
    parser.add_argument("--T_max", type=int, default=None, help="the most steps of --T=auto (default 2 mu_rec)")
    parser.add_argument("--exit", choices=EXITS, default="state", help="--T=auto's test: the relative change of "
                        "the recurrent state (cheap), or the KL between successive predictions (runs the head)")
    parser.add_argument("--exit_threshold", type=float, default=None,
                        help=f"--T=auto stops under this (default {EXIT_THRESHOLDS})")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--benchmark", action="store_true", help="tokens/s and teacher-forced loss at fixed T, "
                        "T_max and auto, and with the KV cache against the old one and full recomputation")
    parser.add_argument("--repeats", type=int, default=3, help="--benchmark: timed repeats, the median is shown")
    args = parser.parse_args(argv)
    if min(args.num_samples, args.max_new_tokens, args.T_max or 1) < 1 or args.temperature < 0 or args.top_k < 0:
        parser.error("--num_samples, --max_new_tokens and --T_max must be >= 1, --temperature and --top_k >= 0")
    if args.benchmark and args.T == "auto":
        parser.error("--benchmark measures --T=auto next to fixed depths by itself; pass --T=<int> or none")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    args.top_k = args.top_k or None
    warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"
    device = torch.device(args.device)
    try:
        model, tokenizer, path = load(args, device)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"sample.py: {err}")
    c = model.config
    allowed = known_ids(tokenizer, c.vocab_size)
    allowed = None if allowed is None else allowed.to(device)
    print(f"{path}: {model.num_params():,} parameters, mu_rec={c.mu_rec}, injection={c.injection}; "
          f"T={args.T or c.mu_rec}", file=sys.stderr)
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        try:
            if args.benchmark:
                benchmark(model, tokenizer, args)
            elif args.prompt is not None or not sys.stdin.isatty():
                text = sys.stdin.read() if args.prompt is None else args.prompt
                stream_samples(model, tokenizer, text, args, device, allowed)
            else:
                while True:
                    try:
                        prompt = input("\n> ")
                    except (EOFError, KeyboardInterrupt):
                        break
                    stream_samples(model, tokenizer, prompt, args, device, allowed)
        except ValueError as err:  # generate's checks: too many positions, T=auto on the Transformer
            sys.exit(f"\nsample.py: {err}")


if __name__ == "__main__":
    main()
