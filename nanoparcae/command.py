"""
A command's flags, and its one way to fail: library code raises, and run_command ends main() in one line.
"""

import argparse
import contextlib
import math
import os
import re
import sys
import time

import torch.distributed as dist

# -----------------------------------------------------------------------------
# Status 2 says the user gave something wrong (ValueError, FileNotFoundError), 1 that the machine lacks something
# (EnvironmentFailure). A command may return 3 (diverged).

class EnvironmentFailure(Exception):
    """The machine failed the command, not its input, with a full disk, a read-only folder or replicas apart."""


class CommandParser(argparse.ArgumentParser):
    """argparse that raises ValueError for a bad flag, so run_command says it in one line."""

    def error(self, message):
        raise ValueError(message)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's layout and shows every default."""


def local_rank():
    """This process's rank on its node, torchrun's LOCAL_RANK; 0 in a plain run."""
    return int(os.environ.get("LOCAL_RANK", 0))


def command_parser(description):
    """Build every command's parser, with its module docstring as --help, defaults shown, no abbreviations."""
    return CommandParser(description=description, formatter_class=HelpFormatter, allow_abbrev=False)


# gloo's error on a rank whose peer died: "[10.0.0.2]:4242: Connection reset by peer", or closed, or a broken pipe
LOST_PEER = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe")
PEER = re.compile(r"\[([^]\s]+)\]:(\d+)")


def run_command(main, argv=None):
    """Run main(argv) and exit with its status; a refusal is one line on stderr from local rank 0, anything else keeps
    its traceback. Every rank closes its process group first, so no rank aborts on the way out."""
    status = None
    try:
        status = main(argv) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        status = 130
    except Exception as err:
        if dist.is_initialized() and isinstance(err, RuntimeError) and LOST_PEER.search(str(err)):
            peer = f"the rank at {found[1]}:{found[2]}" if (found := PEER.search(str(err))) else "a peer rank"
            err = EnvironmentFailure(f"{peer} is gone (killed, or its machine failed), so this one stops too; the "
                                     f"same command resumes the run from its last checkpoint")
        status = (1 if isinstance(err, EnvironmentFailure)
                  else 2 if isinstance(err, (ValueError, FileNotFoundError)) else None)
        if status is None:
            raise
        sys.stdout.flush()
        if local_rank() == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        else:  # torchrun stops every worker once one exits: local rank 0 first says why
            time.sleep(2)
    finally:
        if dist.is_initialized():
            if status == 0:  # ranks that ended well meet first, so none closes a pair its peer reads
                with contextlib.suppress(RuntimeError):  # a peer that failed says why itself
                    dist.barrier()
            dist.destroy_process_group()
    sys.exit(status)

# -----------------------------------------------------------------------------
# Numbers and errors in a line of text, and a flag's list of values read from one

def size(number, unit="B"):
    """A number as a person reads it, 13.4 GB, 2.2 MB or 0.4 MB, or with unit "" a count, 104.0 G or 47,370."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if abs(number) >= scale or (unit and prefix == "M"):  # a unit's amount stays in M at least
            return f"{number / scale:.1f} {prefix}{unit}"
    return f"{number:,.0f}"


def comma_list(text, kind=int):
    """A flag's values separated by commas, each read by kind ("1,2,4" gives [1, 2, 4]); ValueError names the text."""
    try:
        values = [kind(value) for value in str(text).split(",") if value.strip()]
    except ValueError:
        values = []
    if not values:
        raise ValueError(f"{text!r} must be values separated by commas, e.g. 1,2,4")
    return values


def spans(numbers, separator=", "):
    """Write ascending numbers (64 ranks, 1,822 shards) in a line, so [0, 1, 2, 5] gives "0-2, 5"."""
    runs = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return separator.join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def first_sentence(err):
    """An exception as one line, its type and first sentence (torch's go on with advice that does not apply here)."""
    sentence = " ".join(str(err).split()).split(". ")[0].rstrip(".")
    if len(sentence) > 300:  # cut at a word
        sentence = sentence[:300].rsplit(" ", 1)[0] + " ..."
    return f"{type(err).__name__}: {sentence}"

# -----------------------------------------------------------------------------
# Checked flag types, so a bad value is one line, said one way

def checked(kind, rule, holds):
    """An argparse type that reads the text as `kind` and refuses it unless holds(value), naming `rule`."""
    def parse(text):
        value = kind(text)
        if not holds(value):
            raise argparse.ArgumentTypeError(f"{text} must be {rule}")
        return value
    parse.__name__ = kind.__name__  # so argparse names the kind for text that is no number
    return parse


def positive(kind):
    return checked(kind, "a positive number", lambda value: 0 < value < math.inf)


def zero_or_more(kind):
    return checked(kind, "zero or more", lambda value: 0 <= value < math.inf)


def listed(each):
    """An argparse type for integers separated by commas, each read by `each` (1,2,4,8)."""
    def parse(text):
        try:
            return comma_list(text, each)
        except ValueError:  # a value out of each's range says so itself
            raise argparse.ArgumentTypeError(f"{text!r} must be integers separated by commas, e.g. 1,2,4") from None
    return parse
