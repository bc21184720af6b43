"""
nanoparcae/flags.py: the flag types every command's argparse uses, and train.py's operational flags.
A bad value is one line, said one way.
"""

import argparse
import math


def checked(kind, rule, holds):
    """An argparse type: the text read as `kind`, refused unless holds(value), naming `rule`."""
    def parse(text):
        value = kind(text)
        if not holds(value):
            raise argparse.ArgumentTypeError(f"{text} must be {rule}")
        return value
    parse.__name__ = kind.__name__  # argparse's "invalid int value: 'x'" for text that is no number
    return parse


def positive(kind):
    return checked(kind, "a positive number", lambda value: 0 < value < math.inf)


def zero_or_more(kind):
    return checked(kind, "zero or more", lambda value: 0 <= value < math.inf)


unit_fraction = checked(float, "between 0 and 1", lambda value: 0 <= value <= 1)
steps_or_never = checked(int, "a number of steps, or -1 for never", lambda value: value > 0 or value == -1)


def listed(each):
    """An argparse type: integers separated by commas, each read by `each` (1,2,4,8)."""
    def parse(text):
        try:
            values = [each(value) for value in text.split(",") if value.strip()]
        except ValueError:  # not a number; a number out of range says so itself
            values = []
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r} must be integers separated by commas, e.g. 1,2,4")
        return values
    return parse


def add_operational(parser):
    """train.py's knobs of how a run operates, not what it trains: a later group of --help."""
    group = parser.add_argument_group("operational")
    flag = group.add_argument
    flag("--compile_backend", default="inductor", choices=["inductor", "eager"],
         help="eager: dynamo's tracing and guards without code generation")
    flag("--rho_every", type=positive(int), default=None,
         help="steps between concat's rho, computed on the host (None: --eval_every)")
    flag("--diverge_steps", type=zero_or_more(int), default=5,
         help="bad steps in a row that declare the run diverged (0: never)")
    flag("--diverge_h_norm", type=positive(float), default=None,
         help="a state norm ||h_T|| that is a bad step in any dtype (None: 1e4 in bf16 only)")
    flag("--collective_timeout", type=positive(float), default=600,
         help="seconds a collective waits for every rank before the run fails (torch's NCCL default)")
    flag("--rank0_timeout", type=positive(float), default=3600,
         help="seconds ranks wait for lone work: rank 0's save, tokenizer, CORE fetch; a resume's read")
