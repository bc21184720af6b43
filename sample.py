"""
sample.py: text from a trained Parcae checkpoint, at any recurrence depth, streamed as it is made.

    python sample.py --T=32 --prompt="The first law of thermodynamics"   # the latest run
    python sample.py --run=d12 --T=auto --num_samples=3 --seed=7   # adaptive depth, three samples
    python sample.py                                       # interactive when stdin is a terminal
    echo "def fibonacci(n):" | python sample.py --temperature=0    # prompt from a pipe, greedy

- --T is any depth from 1 up, whatever mu_rec the model trained with (METHOD.md §3).
  It defaults to mu_rec.
- --T=auto (beyond the paper) stops each token's recurrence once its state settles (engine.py).
- --kv=shared keeps T = 1's cache memory at any T, exact only at T = 1 (docs/sampling.md).
- Sample i draws its h0 and its tokens from a generator seeded --seed + i.
  So a sample does not depend on how many are drawn.
"""

import argparse
import codecs
import sys
import time
import warnings

import torch

from nanoparcae.checkpoint import load_run
from nanoparcae.common import REFUSED, fail, fail_with, parse_device
from nanoparcae.flags import positive, zero_or_more
from engine import EXIT_THRESHOLDS, EXITS, KV_CACHES, generate

# -----------------------------------------------------------------------------
# Streaming samples

def stream_samples(model, tokenizer, prompt, args, device, allowed=None):
    """Print each sample token by token; <|bos|> (a new document) ends one early.
    allowed: a mask of the ids that may be sampled, None for all."""
    ids = tokenizer.encode(prompt, prepend_bos=True)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"\n--- sample {i + 1}/{args.num_samples}")
        print(prompt, end="", flush=True)
        generator = torch.Generator(device).manual_seed(args.seed + i)
        # a character may span tokens
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        depths, t0 = [], time.perf_counter()
        for next_ids, steps in generate(model, ids, args.max_new_tokens, args.T, args.temperature,
                                        args.top_k, generator, args.exit, args.exit_threshold,
                                        args.T_max, allowed=allowed, kv=args.kv):
            token = int(next_ids[0])
            if token == tokenizer.bos_id:
                break
            depths.append(int(steps[0]))
            print(utf8.decode(tokenizer.enc.decode_single_token_bytes(token)), end="",
                  flush=True)
        print(utf8.decode(b"", final=True))
        seconds = time.perf_counter() - t0
        print(f"[{len(depths)} tokens, {len(depths) / seconds:.1f} tokens/s, "
              f"{sum(depths) / max(1, len(depths)):.2f} recurrent steps per token]",
              file=sys.stderr)


# -----------------------------------------------------------------------------
# Command line

def parse_depth(value):
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"--T must be a positive integer or 'auto', "
                                         f"got {value!r}")
    return int(value)


def add_sampling_flags(parser):
    """The flags of sampling, for any command that samples a loaded model."""
    parser.add_argument("--prompt", help="default: a loop when stdin is a terminal, else stdin")
    parser.add_argument("--num_samples", type=positive(int), default=1)
    parser.add_argument("--max_new_tokens", type=positive(int), default=256)
    parser.add_argument("--temperature", type=zero_or_more(float), default=0.8, help="0 is greedy")
    parser.add_argument("--top_k", type=zero_or_more(int), default=50, help="0 keeps every token")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--T", type=parse_depth, default=None,
                        help="recurrence depth, or auto (default mu_rec)")
    parser.add_argument("--T_max", type=positive(int), default=None,
                        help="the most steps of --T=auto (default 2 mu_rec)")
    parser.add_argument("--exit", choices=EXITS, default="state",
                        help="--T=auto's test: the state's change (cheap) or the predictions' KL")
    parser.add_argument("--exit_threshold", type=positive(float), default=None,
                        help=f"--T=auto stops under this (default {EXIT_THRESHOLDS})")
    parser.add_argument("--kv", choices=KV_CACHES, default="steps",
                        help="KV cache: exact, a slot per loop step; or shared, T = 1's memory")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def parse_sampling_flags(parser, argv):
    """The flags, each checked before any work; a bad one ends in one line naming it."""
    parser.error = fail  # an unknown flag or a bad value: one line, status 2
    args = parser.parse_args(argv)
    try:
        parse_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    args.top_k = args.top_k or None
    warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"
    return args


def sample(model, tokenizer, args, label):
    """Samples of --prompt, of stdin when it is a pipe, else of each line typed.
    A prompt it cannot sample raises ValueError."""
    device = torch.device(args.device)
    c = model.config
    allowed = tokenizer.known_ids(c.vocab_size)
    allowed = None if allowed is None else allowed.to(device)
    print(f"{label}: {model.num_params():,} parameters, mu_rec={c.mu_rec}, "
          f"injection={c.injection}; T={args.T or c.mu_rec}", file=sys.stderr)
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        try:
            if args.prompt is not None or not sys.stdin.isatty():
                text = sys.stdin.read() if args.prompt is None else args.prompt
                stream_samples(model, tokenizer, text, args, device, allowed)
            else:
                while True:
                    try:
                        prompt = input("\n> ")
                    except (EOFError, KeyboardInterrupt):
                        break
                    stream_samples(model, tokenizer, prompt, args, device, allowed)
        except ValueError:  # too many positions, or T=auto on the Transformer: after a new line
            print(file=sys.stderr)
            raise


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--ckpt", help="a checkpoint file (default: the latest of --run)")
    which.add_argument("--run", help="a run under <base dir>/runs (default: the newest)")
    add_sampling_flags(parser)
    args = parse_sampling_flags(parser, argv)
    try:
        model, tokenizer, _, path = load_run(args.ckpt or args.run, torch.device(args.device))
        sample(model, tokenizer, args, path)
    except REFUSED as err:
        fail_with(err)


if __name__ == "__main__":
    main()
