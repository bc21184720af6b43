"""
sample.py: text from a trained Parcae checkpoint, at any recurrence depth, streamed as it is made.

    python sample.py --T=32 --prompt="The first law of thermodynamics"   # the latest run
    python sample.py --run=d12 --T=auto --num_samples=3 --seed=7   # adaptive depth, three samples
    python sample.py                                       # interactive when stdin is a terminal
    echo "def fibonacci(n):" | python sample.py --temperature=0    # prompt from a pipe, greedy

It reads top to bottom: the flags, the run loaded, the draft chosen, then the samples streamed.
--T is any depth from 1 up, whatever mu_rec the model trained with (METHOD.md §3). --T=auto,
--kv=shared and --draft go beyond the paper (docs/sampling.md). A draft is verified at T, so
every token is distributed as at T, and greedy decoding gives the same tokens. Sample i draws
from a generator seeded --seed + i, so it does not depend on how many are drawn.
"""

import argparse
import codecs
import sys
import time
import warnings

import torch

from nanoparcae.checkpoint import load_run
from model import from_weights
from nanoparcae.command import (checked, command_parser, comma_list, positive, run_command,
                                zero_or_more)
from nanoparcae.ranks import parse_device
from engine import EXIT_THRESHOLDS, EXITS, KV_CACHES, Draft, auto_draft, check_draft, generate

# -----------------------------------------------------------------------------
# The flags

def parse_depth(value):
    if value != "auto" and not (value.isdigit() and int(value) >= 1):
        raise argparse.ArgumentTypeError(f"--T must be a positive integer or 'auto', got {value!r}")
    return value if value == "auto" else int(value)


def parse_draft(value):
    if value in ("auto", "off"):
        return value
    numbers = comma_list(value)
    if len(numbers) != 2 or min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"--draft takes auto, off or two positive integers "
                                         f"depth,length (e.g. 4,8), got {value!r}")
    return Draft(*numbers)


# Signed 64-bit seeds reach every generator state (negative ones wrap) and leave --seed + i room
SEED = checked(int, "an integer from -2**63 to 2**63 - 1", lambda seed: -2**63 <= seed < 2**63)


def add_sampling_flags(parser):
    """The flags of sampling, for any command that samples a loaded model."""
    parser.add_argument("--prompt", help="default: a loop when stdin is a terminal, else stdin")
    parser.add_argument("--num_samples", type=positive(int), default=1)
    parser.add_argument("--max_new_tokens", type=positive(int), default=256)
    parser.add_argument("--temperature", type=zero_or_more(float), default=0.8, help="0 is greedy")
    parser.add_argument("--top_k", type=zero_or_more(int), default=50, help="0 keeps every token")
    parser.add_argument("--seed", type=SEED, default=42)
    parser.add_argument("--T", type=parse_depth, default=None,
                        help="recurrence depth, or auto (default mu_rec)")
    parser.add_argument("--T_max", type=positive(int), default=None,
                        help="the most steps of --T=auto (default 2 mu_rec)")
    parser.add_argument("--exit", choices=EXITS, default="state",
                        help="--T=auto's test, the state's change (cheap) or the predictions' KL")
    parser.add_argument("--exit_threshold", type=positive(float), default=None,
                        help=f"--T=auto stops under this (default {EXIT_THRESHOLDS})")
    parser.add_argument("--kv", choices=KV_CACHES, default="steps",
                        help="KV cache, exact with a slot per loop step, or shared (T = 1's)")
    parser.add_argument("--draft", type=parse_draft, default="auto",
                        help="drafts at a shallow depth verified at T: auto, off, or depth,length")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def parse_sampling_flags(parser, argv):
    """The flags, each checked before any work, so a bad one ends in one line naming it."""
    args = parser.parse_args(argv)
    parse_device(args.device)
    args.top_k = args.top_k or None
    warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"
    return args

# -----------------------------------------------------------------------------
# The draft, then the samples streamed

def chosen_draft(model, args):
    """The Draft that --draft asks for, or None to decode one position at a time.
    auto drafts where it is exact and pays, and depth,length is refused where it is not exact."""
    if args.draft in ("auto", "off"):
        return auto_draft(model, args.T, args.kv) if args.draft == "auto" else None
    check_draft(model, args.T, args.kv, True, args.draft)
    return args.draft


def sample(model, tokenizer, args, label):
    """Samples of --prompt, of stdin when it is a pipe, else of each line typed.
    A prompt it cannot sample raises ValueError."""
    device, c = torch.device(args.device), model.config
    allowed = None if (known := tokenizer.known_ids(c.vocab_size)) is None else known.to(device)
    draft = chosen_draft(model, args)
    print(f"{label}: {model.num_params():,} parameters, mu_rec={c.mu_rec}, "
          f"injection={c.injection}; T={args.T or c.mu_rec}"
          f"{f', drafts up to {draft.length} at depth {draft.depth}' if draft else ''}",
          file=sys.stderr)
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        try:
            if args.prompt is not None or not sys.stdin.isatty():
                text = sys.stdin.read() if args.prompt is None else args.prompt
                stream(model, tokenizer, text, args, device, allowed, draft)
            else:
                while True:
                    try:
                        prompt = input("\n> ")
                    except (EOFError, KeyboardInterrupt):
                        break
                    stream(model, tokenizer, prompt, args, device, allowed, draft)
        except ValueError:  # too many positions, or T=auto on the Transformer, after a new line
            print(file=sys.stderr)
            raise


def stream(model, tokenizer, prompt, args, device, allowed, draft):
    """Print each sample token by token, then its speed. <|bos|> (a new document) ends it."""
    ids = tokenizer.encode(prompt, prepend_bos=True)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"\n--- sample {i + 1}/{args.num_samples}")
        print(prompt, end="", flush=True)
        generator = torch.Generator(device).manual_seed(args.seed + i)
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # a character may span tokens
        depths, counts, t0 = [], {}, time.perf_counter()
        for next_ids, steps in generate(model, ids, args.max_new_tokens, args.T, args.temperature,
                                        args.top_k, generator, args.exit, args.exit_threshold,
                                        args.T_max, allowed=allowed, kv=args.kv, draft=draft,
                                        counts=counts):
            if int(next_ids[0]) == tokenizer.bos_id:
                break
            depths.append(int(steps[0]))
            print(utf8.decode(tokenizer.enc.decode_single_token_bytes(int(next_ids[0]))), end="",
                  flush=True)
        print(utf8.decode(b"", final=True))
        drafts = (f", drafted at depth {draft.depth}: {counts['agreed'] / counts['drafted']:.0%} "
                  f"accepted, {counts.get('plain', 0)} tokens plain" if counts.get("drafted")
                  else "")
        print(f"[{len(depths)} tokens, {len(depths) / (time.perf_counter() - t0):.1f} tokens/s, "
              f"{sum(depths) / max(1, len(depths)):.2f} recurrent steps per token{drafts}]",
              file=sys.stderr)


def main(argv=None):
    parser = command_parser(__doc__)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--ckpt", help="a checkpoint file (default: the latest of --run)")
    which.add_argument("--run", help="a run under <base dir>/runs (default: the newest)")
    add_sampling_flags(parser)
    args = parse_sampling_flags(parser, argv)
    ckpt, tokenizer, path = load_run(args.run, args.ckpt)
    model = from_weights(ckpt["config"], ckpt["model"], torch.device(args.device))
    sample(model, tokenizer, args, path)


if __name__ == "__main__":
    run_command(main)
