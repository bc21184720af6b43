"""
nanoparcae/flags.py: the checked flag types of the commands' argparse parsers.
A bad value is one line, said one way.
"""

import argparse
import math

from nanoparcae.common import comma_list


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


def listed(each):
    """An argparse type: integers separated by commas, each read by `each` (1,2,4,8)."""
    def parse(text):
        try:
            return comma_list(text, each)
        except ValueError:  # a value out of each's range says so itself
            raise argparse.ArgumentTypeError(f"{text!r} must be integers separated by commas, "
                                             f"e.g. 1,2,4") from None
    return parse
