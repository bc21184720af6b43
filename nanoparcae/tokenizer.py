"""
nanoparcae/tokenizer.py: the tokenizer, a byte-level BPE (METHOD.md §2).
It uses the GPT-4 split pattern and the specials <|bos|>, <|eos|>, <|pad|>.
rustbpe trains it and tiktoken runs it. nanoparcae.dataset.get_tokenizer caches one per data source.

    tokenizer = Tokenizer.train(texts, vocab_size=4096)     # any iterator of strings
    ids = tokenizer.encode("def f(x):", prepend_bos=True)
    tokenizer.save(directory); tokenizer = Tokenizer.load(directory)
"""

import base64
import hashlib
import json
import warnings
from pathlib import Path

import rustbpe
import tiktoken
import torch

from nanoparcae.command import EnvironmentFailure, first_sentence, checked

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte a token of its own, then the specials
# 32 times the paper's 32,768; far beyond is a typo, whose tokenizer files alone would fill a disk
MAX_VOCAB_SIZE = 2**20
VOCAB_RANGE = (f"from {MIN_VOCAB_SIZE} to {MAX_VOCAB_SIZE} (256 byte tokens and {len(SPECIAL_TOKENS)} specials at "
               f"least, 2**20 at most: 32 times the paper's 32768); pass --vocab_size={MIN_VOCAB_SIZE} or more, "
               f"32768 for the paper's")


def vocab_size_ok(value):
    return MIN_VOCAB_SIZE <= value <= MAX_VOCAB_SIZE


# --vocab_size's type refuses one out of range before any tokenizer trains
vocab_size_flag = checked(int, VOCAB_RANGE, vocab_size_ok)
# METHOD.md §2 uses GPT-4's split, but digits group by 1-2 (GPT-4 by 1-3), as in nanochat.
# That wastes fewer tokens on numbers at small vocab sizes.
SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
                 r"""|\s*[\r\n]|\s+(?!\S)|\s+""")

# -----------------------------------------------------------------------------
# A saved tokenizer's files, each read in one place


def read_part(path, parse):
    """Return parse(the file's bytes) for one of a saved tokenizer's files.
    A permission error raises EnvironmentFailure, a torn or wrong file ValueError, each naming the file."""
    try:
        return parse(path.read_bytes())
    except PermissionError as err:
        raise unreadable(path, err) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise torn(path, first_sentence(err)) from None


def unreadable(path, err):
    """The EnvironmentFailure for a tokenizer file or folder that permissions keep from this user."""
    return EnvironmentFailure(f"the tokenizer at {path} cannot be read ({err.strerror}): make {path.parent} "
                              f"readable, then run the same command again")


def torn(path, cause):
    """The ValueError for a tokenizer file that is torn or not one save wrote, with the fix."""
    return ValueError(f"the tokenizer file {path} is torn or not ours ({cause}): remove {path.parent}, then "
                      f"recreate it with `python -m nanoparcae.dataset tokenizer` and the run's --data and "
                      f"--vocab_size")


def parse_ranks(raw):
    """tokenizer.tiktoken's lines, "base64(token) rank" -> {token: rank}."""
    ranks = {}
    for line in raw.decode().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token, validate=True)] = int(rank)
    return ranks


def parse_config(raw):
    """tokenizer.json -> (split pattern, {special token: id})."""
    config = json.loads(raw)
    pattern, specials = config["pattern"], config["special_tokens"]
    if not isinstance(pattern, str) or not all(isinstance(i, int) for i in specials.values()):
        raise TypeError("a pattern string and special tokens' ids are expected")
    return pattern, specials


def parse_counts(raw):
    """token_bytes.txt's lines, a byte count per id -> int32 tensor."""
    return torch.tensor([int(n) for n in raw.decode().split()], dtype=torch.int32)

# -----------------------------------------------------------------------------
# The tokenizer, trained with rustbpe, run with tiktoken

class Tokenizer:
    """A tiktoken.Encoding plus each token's byte length, which bits per byte needs.
    A tokenizer loaded from a folder carries its files' digest, which names it across ranks and checkpoints."""

    def __init__(self, enc, token_bytes, bos_token="<|bos|>", digest=None):
        self.enc = enc
        self.digest = digest  # files_digest of the folder it was loaded from; None if not loaded
        self.token_bytes = token_bytes  # int32 (vocab_size,), the UTF-8 bytes each id decodes to, 0 for specials
        self.bos_id = enc.encode_single_token(bos_token)  # an imported tokenizer may name it its own way
        self.vocab_size = enc.n_vocab

    @classmethod
    def from_ranks(cls, mergeable_ranks, pattern, specials=None, bos_token="<|bos|>", name="nanoparcae"):
        """Build a tokenizer from its merges; `specials` maps each special token to its id.
        By default the specials are ours, with the ids after the learned tokens."""
        if specials is None:
            specials = {token: len(mergeable_ranks) + i for i, token in enumerate(SPECIAL_TOKENS)}
        enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=mergeable_ranks, special_tokens=specials)
        token_bytes = torch.zeros(enc.n_vocab, dtype=torch.int32)
        for token, rank in mergeable_ranks.items():
            token_bytes[rank] = len(token)
        return cls(enc, token_bytes, bos_token)

    @classmethod
    def train(cls, text_iterator, vocab_size, max_chars=2_000_000_000, doc_cap=10_000):
        """Train on at most max_chars characters, each document cut to doc_cap.
        METHOD.md §2 trains on ~2B characters with a 10k cap. vocab_size counts the special tokens."""
        if not vocab_size_ok(vocab_size):
            raise ValueError(f"vocab_size {vocab_size} must be {VOCAB_RANGE}")
        num_merged = vocab_size - len(SPECIAL_TOKENS)

        def capped():
            seen = 0
            for text in text_iterator:
                text = text[:doc_cap]
                yield text
                seen += len(text)
                if seen >= max_chars:
                    return

        bpe = rustbpe.Tokenizer()
        bpe.train_from_iterator(capped(), num_merged, pattern=SPLIT_PATTERN)
        return cls.from_ranks({bytes(token): rank for token, rank in bpe.get_mergeable_ranks()}, SPLIT_PATTERN)

    def save(self, directory):
        """tiktoken's own text format ("base64(token) rank" per line), no pickle."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        ranks = self.enc._mergeable_ranks
        by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
        lines = (f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in by_rank)
        (directory / "tokenizer.tiktoken").write_text("".join(lines))
        config = {"pattern": self.enc._pat_str, "special_tokens": self.enc._special_tokens}
        (directory / "tokenizer.json").write_text(json.dumps(config, indent=1))
        (directory / "token_bytes.txt").write_text("".join(f"{n}\n" for n in self.token_bytes.tolist()))

    FILES = ("tokenizer.tiktoken", "tokenizer.json", "token_bytes.txt")  # what save writes

    @classmethod
    def files_digest(cls, directory):
        """Hash the saved files' bytes with sha256, to 16 hex digits.
        Checkpoints record it, and ranks compare it, since any changed byte is another tokenizer."""
        digest = hashlib.sha256()
        for name in cls.FILES:
            digest.update(name.encode() + b"\0" + read_part(Path(directory) / name, bytes))
        return digest.hexdigest()[:16]

    @classmethod
    def saved(cls, directory):
        """Whether save wrote a tokenizer in `directory`; one that cannot be looked into raises EnvironmentFailure."""
        path = Path(directory) / cls.FILES[-1]  # save writes it last
        try:
            return path.is_file()
        except PermissionError as err:
            raise unreadable(path, err) from None

    @classmethod
    def load(cls, directory):
        """The tokenizer save wrote there; a torn or unreadable file raises one line naming it."""
        directory = Path(directory)
        ranks = read_part(directory / "tokenizer.tiktoken", parse_ranks)
        pattern, specials = read_part(directory / "tokenizer.json", parse_config)
        ids = sorted([*ranks.values(), *specials.values()])
        if ids != list(range(len(ids))):  # a file cut short lacks its last tokens
            raise torn(directory / "tokenizer.tiktoken", f"its {len(ranks)} tokens and {len(specials)} specials "
                                                         f"leave ids out")
        token_bytes = read_part(directory / "token_bytes.txt", parse_counts)
        if len(token_bytes) != len(ids):
            raise torn(directory / "token_bytes.txt", f"{len(token_bytes)} counts for {len(ids)} tokens")
        enc = tiktoken.Encoding("nanoparcae", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
        return cls(enc, token_bytes, digest=cls.files_digest(directory))

    def encode(self, text, prepend_bos=False, num_threads=8):
        """A string gives a list of ids; a list of strings, a list of lists (on num_threads threads).
        Text never yields special tokens, so "<|bos|>" in a document is ordinary characters."""
        prefix = [self.bos_id] if prepend_bos else []
        if isinstance(text, str):
            return prefix + self.enc.encode_ordinary(text)
        return [prefix + ids for ids in self.enc.encode_ordinary_batch(text, num_threads=num_threads)]

    def decode(self, ids):
        return self.enc.decode(ids)

    def known_ids(self, vocab_size):
        """(vocab_size,) bool mask of the ids this tokenizer can decode, or None if it has them all.
        A model with more ids must never sample the others. Warns, naming both sizes."""
        ids = [i for i in (*self.enc._mergeable_ranks.values(), *self.enc._special_tokens.values()) if i < vocab_size]
        known = torch.zeros(vocab_size, dtype=torch.bool)
        known[ids] = True
        if bool(known.all()):
            return None
        warnings.warn(f"the model has {vocab_size} token ids, its tokenizer {len(ids)}: the "
                      f"{vocab_size - len(ids)} ids the tokenizer lacks are never sampled")
        return known


# TEMP shim: helper "data" moves these here; drop this block at merge
def get_tokenizer(*args, **kwargs):
    from nanoparcae import dataset
    return dataset.get_tokenizer(*args, **kwargs)


def tokenizer_dir(*args, **kwargs):
    from nanoparcae import dataset
    return dataset.tokenizer_dir(*args, **kwargs)
