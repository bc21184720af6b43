"""
sample.py: text from a trained Parcae checkpoint, at any recurrence depth, streamed as it is made.

    python sample.py --T=32 --prompt="The first law of thermodynamics"   # latest checkpoint of the latest run
    python sample.py --run=d12 --T=auto --num_samples=3 --seed=7          # adaptive depth, three samples
    python sample.py                                                      # interactive when stdin is a terminal
    echo "def fibonacci(n):" | python sample.py --temperature=0           # the prompt from a pipe, greedy
    python sample.py --benchmark --T=8                                    # tokens/s with and without the KV cache

--T is any positive integer, independent of the mu_rec the model trained with (METHOD.md §3: test-time scaling);
it defaults to mu_rec. The prompt is prefilled in one pass into a KV cache with a slot per prelude/coda
layer and per (recurrent layer, loop step); each new token then costs one position per layer and step.

--T=auto (beyond the paper) stops each new token's recurrence once the next-token distribution settles:
after step t >= 2, when KL(p_t || p_{t-1}) < --exit_threshold, or at --T_max. The cache slots of the steps a
token skipped hold its last computed step's keys and values, so later tokens still see it at every depth.

Sample i uses its own generator, seeded --seed + i, for its h0 draws and its sampling: a sample does not
depend on how many others are drawn, or on whether generate() runs them in one batch.
"""

import argparse
import codecs
import sys
import time
import warnings
from pathlib import Path

import torch

from common import find_checkpoint, get_base_dir, load_checkpoint
from data import Tokenizer
from hub import load_pretrained
from model import KVCache

# -----------------------------------------------------------------------------
# One token from the logits; h0 for every position up front

def sample_next(logits, temperature, top_k, generators):
    """logits (B, V) -> (B,) ids: argmax when temperature is 0, else a draw from the top_k most likely."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])


def draw_h0(model, length, generators, device):
    """METHOD.md §1's h0 for `length` positions, one row per generator: drawn before any sampling, so the
    initial states of a run do not depend on the tokens sampled (greedy and top-k 1 see the same h0)."""
    d = model.config.d_model
    return torch.cat([model.initial_state((1, length, d), device, torch.float32, generator=g) for g in generators])

# -----------------------------------------------------------------------------
# Adaptive depth: one new position, its recurrence stopped when the prediction settles

def adaptive_forward(model, idx, cache, h0, T_max, exit_threshold):
    """idx (B, 1), the next position after `cache` -> (logits (B, 1, V), steps (B,)).

    Row r stops after step t >= 2 once KL(p_t || p_{t-1}) < exit_threshold (its state then stays put), or at
    T_max. The coda reads each step's state through the cache but writes to it only at the last step, so
    the coda's slots hold exactly one position per token, computed from each row's final state.
    """
    e, (ves, cos, sin) = model.run_prelude(idx, cache)
    done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
    steps = torch.zeros(idx.size(0), dtype=torch.long, device=idx.device)
    h, prev_logp = h0.to(e.dtype), None
    for step in range(T_max):
        h = torch.where(done[:, None, None], h, model.recur_step(h, e, step, ves, cos, sin, cache))
        steps += ~done
        slots_before_coda = dict(cache.slots)  # KVCache.extend never writes in place: this is a snapshot
        logits = model.run_coda(h, ves, cos, sin, cache)
        logp = logits[:, -1].log_softmax(dim=-1)
        if prev_logp is not None:
            kl = (logp.exp() * (logp - prev_logp)).sum(dim=-1).clamp(min=0)  # rounding can dip below 0
            done |= kl < exit_threshold
        prev_logp = logp
        if bool(done.all()) or step == T_max - 1:
            break
        cache.slots = slots_before_coda
    fill_skipped_steps(cache, steps, T_max, model.config.n_recur)
    return logits, steps


def fill_skipped_steps(cache, steps, T_max, n_recur):
    """The newest position's recurrent slots at the steps a row skipped take its last computed step's keys
    and values (steps (B,): the steps each row ran)."""
    steps_per_row = steps.tolist()
    ran = max(steps_per_row)
    rows = torch.arange(len(steps_per_row), device=steps.device)
    for i in range(n_recur):
        computed = [cache.slots[("recur", s, i)] for s in range(ran)]
        last_k = torch.stack([k[:, :, -1] for k, _ in computed])[steps - 1, rows]  # (B, H, D)
        last_v = torch.stack([v[:, :, -1] for _, v in computed])[steps - 1, rows]
        for s in range(T_max):
            if s >= ran:  # no row ran this step: the slot has no entry for this position yet
                cache.extend(("recur", s, i), last_k[:, :, None], last_v[:, :, None])
            elif any(n <= s for n in steps_per_row):  # some rows ran it after they had stopped: overwrite
                skipped = steps <= s
                k, v = cache.slots[("recur", s, i)]
                k[skipped, :, -1], v[skipped, :, -1] = last_k[skipped], last_v[skipped]

# -----------------------------------------------------------------------------
# Generation

@torch.no_grad()
def generate(model, tokens, max_new_tokens, T=None, temperature=1.0, top_k=None, generator=None,
             exit_threshold=5e-4, T_max=None, use_cache=True):
    """Yield (ids (B,), steps (B,)) for each new token: the token of every row and the recurrent steps it took.

    tokens: a list of ids or a (B, S) tensor; prompts longer than seq_len are cropped from the left, with a
    warning. T: an int >= 1, None for mu_rec, or "auto" (adaptive depth up to T_max, default 2 * mu_rec).
    generator: a torch.Generator on the model's device, or one per row; None uses the global RNG.
    use_cache=False recomputes the whole sequence for every token (fixed T only: the reference, and the
    benchmark's baseline).
    """
    c = model.config
    device = model.wte.weight.device
    idx = torch.as_tensor(tokens, dtype=torch.long, device=device)
    idx = idx[None] if idx.dim() == 1 else idx
    if idx.size(1) > c.seq_len:
        warnings.warn(f"the prompt's {idx.size(1)} tokens exceed seq_len={c.seq_len}: "
                      f"cropped from the left to the last {c.seq_len}")
        idx = idx[:, -c.seq_len:]
    T = c.mu_rec if T is None else T
    adaptive = T == "auto"
    T_max = T_max or 2 * c.mu_rec
    if adaptive and not use_cache:
        raise ValueError("T='auto' decodes through the KV cache; use_cache=False needs a fixed T")
    if adaptive and c.injection == "none":
        raise ValueError("T='auto' needs a looped model; this is the fixed-depth Transformer baseline")
    num_positions = idx.size(1) + max_new_tokens
    if num_positions > model.rope_cos.size(1):
        raise ValueError(f"prompt + max_new_tokens = {num_positions} positions exceed the model's RoPE table of "
                         f"{model.rope_cos.size(1)}; lower max_new_tokens")
    generators = list(generator) if isinstance(generator, (list, tuple)) else [generator] * idx.size(0)
    h0 = draw_h0(model, num_positions, generators, device)
    cache = KVCache() if use_cache else None
    start = 0  # positions [start, end) are the next forward's input: one new token with the cache
    if adaptive and idx.size(1) > 1:  # the prompt but its last token at full depth; that token decodes like any
        model(idx[:, :-1], T=T_max, h0=h0[:, :idx.size(1) - 1], cache=cache)
        start = idx.size(1) - 1
    for _ in range(max_new_tokens):
        end = idx.size(1)
        if adaptive:
            logits, steps = adaptive_forward(model, idx[:, start:], cache, h0[:, start:end], T_max, exit_threshold)
        else:
            logits = model(idx[:, start:], T=T, h0=h0[:, start:end], cache=cache)
            steps = torch.full((idx.size(0),), T if c.injection != "none" else 1, device=device)
        next_ids = sample_next(logits[:, -1], temperature, top_k, generators)
        yield next_ids, steps
        idx = torch.cat([idx, next_ids[:, None]], dim=1)
        start = end if use_cache else 0

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
        model, tokenizer = load_pretrained(args.from_, device)
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


def stream_samples(model, tokenizer, prompt, args, device):
    """Sample after sample, each token printed as it is made; a sample ends early at <|bos|> (a new document)."""
    ids = tokenizer.encode(prompt, prepend_bos=True)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"\n--- sample {i + 1}/{args.num_samples}")
        print(prompt, end="", flush=True)
        generator = torch.Generator(device).manual_seed(args.seed + i)
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span tokens
        depths, t0 = [], time.perf_counter()
        for next_ids, steps in generate(model, ids, args.max_new_tokens, args.T, args.temperature, args.top_k,
                                        generator, args.exit_threshold, args.T_max):
            token = int(next_ids[0])
            if token == tokenizer.bos_id:
                break
            depths.append(int(steps[0]))
            print(utf8.decode(tokenizer.enc.decode_single_token_bytes(token)), end="", flush=True)
        print(utf8.decode(b"", final=True))
        seconds = time.perf_counter() - t0
        print(f"[{len(depths)} tokens, {len(depths) / seconds:.1f} tokens/s, "
              f"{sum(depths) / max(1, len(depths)):.2f} recurrent steps per token]", file=sys.stderr)


def benchmark(model, tokenizer, args, device):
    """Decoding speed of one sample with the KV cache and with full recomputation, same seed."""
    ids = tokenizer.encode(args.prompt or "", prepend_bos=True)
    list(generate(model, ids, 8, args.T))  # warm up: the first calls of every kernel are slow
    tokens, rates = {}, {}
    for use_cache in (True, False):
        generator = torch.Generator(device).manual_seed(args.seed)
        t0 = time.perf_counter()
        tokens[use_cache] = [int(next_ids[0]) for next_ids, _ in generate(
            model, ids, args.max_new_tokens, args.T, args.temperature, args.top_k, generator, use_cache=use_cache)]
        rates[use_cache] = args.max_new_tokens / (time.perf_counter() - t0)
    print(f"T={args.T or model.config.mu_rec}, prompt {len(ids)} tokens, {args.max_new_tokens} new tokens: "
          f"{rates[True]:.1f} tokens/s with the KV cache, {rates[False]:.1f} without, "
          f"ratio {rates[True] / rates[False]:.2f}x; same tokens: {tokens[True] == tokens[False]}")


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
    parser.add_argument("--exit_threshold", type=float, default=5e-4, help="--T=auto stops under this KL")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--benchmark", action="store_true", help="tokens/s with and without the KV cache")
    args = parser.parse_args(argv)
    if min(args.num_samples, args.max_new_tokens, args.T_max or 1) < 1 or args.temperature < 0 or args.top_k < 0:
        parser.error("--num_samples, --max_new_tokens and --T_max must be >= 1, --temperature and --top_k >= 0")
    if args.benchmark and args.T == "auto":
        parser.error("--benchmark compares a fixed depth with and without the cache; pass --T=<int>")
    args.top_k = args.top_k or None
    warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"
    device = torch.device(args.device)
    try:
        model, tokenizer, path = load(args, device)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"sample.py: {err}")
    c = model.config
    print(f"{path}: {model.num_params():,} parameters, mu_rec={c.mu_rec}, injection={c.injection}; "
          f"T={args.T or c.mu_rec}", file=sys.stderr)
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        try:
            if args.benchmark:
                benchmark(model, tokenizer, args, device)
            elif args.prompt is not None or not sys.stdin.isatty():
                text = sys.stdin.read() if args.prompt is None else args.prompt
                stream_samples(model, tokenizer, text, args, device)
            else:
                while True:
                    try:
                        prompt = input("\n> ")
                    except (EOFError, KeyboardInterrupt):
                        break
                    stream_samples(model, tokenizer, prompt, args, device)
        except ValueError as err:  # generate's checks: too many positions, T=auto on the Transformer
            sys.exit(f"\nsample.py: {err}")


if __name__ == "__main__":
    main()
