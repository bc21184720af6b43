"""
nanoparcae/tokenizer.py: the tokenizer, a byte-level BPE (METHOD.md §2) that rustbpe trains and tiktoken runs.
get_tokenizer trains one per data source on first use, and caches it under the base folder.

    tokenizer = get_tokenizer("stdlib", 4096)               # trained once, then loaded from its cache
    ids = tokenizer.encode("def f(x):", prepend_bos=True)

    python -m nanoparcae.tokenizer --data=fineweb-edu       # the 32,768-token BPE on ~2B characters, cached
"""

import base64
import itertools
import hashlib
import json
import os
import time
import warnings
from pathlib import Path

import rustbpe
import tiktoken
import torch

from nanoparcae.command import EnvironmentFailure, checked, command_parser, first_sentence, positive, run_command
from nanoparcae.dataset import ChunkReader, check_split, data_key, iter_documents
from nanoparcae.files import check_writable, get_base_dir, write_atomically

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
    """Return parse(the file's bytes) for one of a saved tokenizer's files, a failure naming the file."""
    try:
        return parse(path.read_bytes())
    except PermissionError as err:
        raise unreadable(path, err) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise torn(path, first_sentence(err)) from None


def unreadable(path, err):
    return EnvironmentFailure(f"the tokenizer at {path} cannot be read ({err.strerror}): make {path.parent} "
                              f"readable, then run the same command again")


RECREATE = "recreate it with `python -m nanoparcae.tokenizer` and the run's --data and --vocab_size"


def torn(path, cause):
    return ValueError(f"the tokenizer file {path} is torn or not ours ({cause}); remove {path.parent}, then {RECREATE}")


def parse_ranks(raw):  # tokenizer.tiktoken's lines, "base64(token) rank"
    lines = map(str.split, raw.decode().splitlines())
    return {base64.b64decode(token, validate=True): int(rank) for token, rank in lines}


def parse_config(raw):  # tokenizer.json
    pattern, specials = (config := json.loads(raw))["pattern"], config["special_tokens"]
    if not isinstance(pattern, str) or not all(isinstance(i, int) for i in specials.values()):
        raise TypeError("a pattern string and special tokens' ids are expected")
    return pattern, specials

# -----------------------------------------------------------------------------
# The tokenizer, trained with rustbpe, run with tiktoken

class Tokenizer:
    """A tiktoken.Encoding built from its merges, plus each token's byte length, which bits per byte needs.
    A tokenizer loaded from a folder carries its files' digest, which names it across ranks and checkpoints."""

    def __init__(self, mergeable_ranks, pattern, specials=None, bos_token="<|bos|>", name="nanoparcae"):
        if specials is None:  # ours, with the ids after the learned tokens
            specials = {token: len(mergeable_ranks) + i for i, token in enumerate(SPECIAL_TOKENS)}
        self.enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=mergeable_ranks, special_tokens=specials)
        self.directory = self.digest = None  # the folder load read, and files_digest of it
        self.token_bytes = torch.zeros(self.enc.n_vocab, dtype=torch.int32)  # UTF-8 bytes of each id, 0 for specials
        for token, rank in mergeable_ranks.items():
            self.token_bytes[rank] = len(token)
        self.bos_id = self.enc.encode_single_token(bos_token)  # an imported tokenizer may name it its own way
        self.vocab_size = self.enc.n_vocab

    @classmethod
    def train(cls, text_iterator, vocab_size, max_chars=2_000_000_000, doc_cap=10_000):
        """Train on at most max_chars characters, each document cut to doc_cap (METHOD.md §2 uses ~2B and
        10k). vocab_size counts the special tokens."""
        if not vocab_size_ok(vocab_size):
            raise ValueError(f"vocab_size {vocab_size} must be {VOCAB_RANGE}")

        def capped():
            seen = 0
            for text in text_iterator:
                text = text[:doc_cap]
                yield text
                seen += len(text)
                if seen >= max_chars:
                    return

        bpe = rustbpe.Tokenizer()
        bpe.train_from_iterator(capped(), vocab_size - len(SPECIAL_TOKENS), pattern=SPLIT_PATTERN)
        return cls({bytes(token): rank for token, rank in bpe.get_mergeable_ranks()}, SPLIT_PATTERN)

    def save(self, directory):
        """tiktoken's own text format ("base64(token) rank" per line), no pickle."""
        (directory := Path(directory)).mkdir(parents=True, exist_ok=True)
        by_rank = sorted(self.enc._mergeable_ranks.items(), key=lambda kv: kv[1])
        lines = (f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in by_rank)
        (directory / "tokenizer.tiktoken").write_text("".join(lines))
        config = {"pattern": self.enc._pat_str, "special_tokens": self.enc._special_tokens}
        (directory / "tokenizer.json").write_text(json.dumps(config, indent=1))
        (directory / "token_bytes.txt").write_text("".join(f"{n}\n" for n in self.token_bytes.tolist()))

    FILES = ("tokenizer.tiktoken", "tokenizer.json", "token_bytes.txt")  # what save writes

    @classmethod
    def files_digest(cls, directory):
        """Hash the saved files' bytes, since any changed byte is another tokenizer (checkpoints record it)."""
        digest = hashlib.sha256()
        for name in cls.FILES:
            digest.update(name.encode() + b"\0" + read_part(Path(directory) / name, bytes))
        return digest.hexdigest()[:16]

    @classmethod
    def saved(cls, directory, recreate=RECREATE):
        """Whether save wrote a tokenizer in `directory`; an interrupted copy raises ValueError naming what it lacks."""
        try:
            there = [(Path(directory) / name).is_file() for name in cls.FILES]
        except PermissionError as err:
            raise unreadable(Path(directory) / cls.FILES[0], err) from None
        if any(there) and not all(there):
            missing = [name for name, here in zip(cls.FILES, there) if not here]
            raise ValueError(f"the tokenizer folder {directory} lacks {' and '.join(missing)}; copy it whole, or "
                             f"remove it and {recreate}")
        return all(there)

    @classmethod
    def load(cls, directory):
        directory = Path(directory)
        ranks = read_part(directory / "tokenizer.tiktoken", parse_ranks)
        pattern, specials = read_part(directory / "tokenizer.json", parse_config)
        ids = sorted([*ranks.values(), *specials.values()])
        if ids != list(range(len(ids))):  # a file cut short lacks its last tokens
            raise torn(directory / "tokenizer.tiktoken", f"its {len(ranks)} tokens and {len(specials)} specials leave "
                       "ids out")
        tokenizer = cls(ranks, pattern, specials)
        counts = read_part(directory / "token_bytes.txt", lambda raw: [int(n) for n in raw.decode().split()])
        if counts != tokenizer.token_bytes.tolist():
            raise torn(directory / "token_bytes.txt", f"its {len(counts)} counts are not its {len(ids)} tokens' bytes")
        tokenizer.directory, tokenizer.digest = directory, cls.files_digest(directory)
        return tokenizer

    def encode(self, text, prepend_bos=False, num_threads=8):
        """A string gives a list of ids, a list of strings a list of lists; text never yields a special token."""
        prefix = [self.bos_id] if prepend_bos else []
        if isinstance(text, str):
            return prefix + self.enc.encode_ordinary(text)
        return [prefix + ids for ids in self.enc.encode_ordinary_batch(text, num_threads=num_threads)]

    def decode(self, ids):
        return self.enc.decode(ids)

    def known_ids(self, vocab_size):
        """(vocab_size,) bool mask of the ids this tokenizer can decode, the only ones sampled; None for all."""
        ids = [i for i in (*self.enc._mergeable_ranks.values(), *self.enc._special_tokens.values()) if i < vocab_size]
        known = torch.zeros(vocab_size, dtype=torch.bool)
        known[ids] = True
        if bool(known.all()):
            return None
        warnings.warn(f"the model has {vocab_size} token ids, its tokenizer {len(ids)}: the "
                      f"{vocab_size - len(ids)} ids the tokenizer lacks are never sampled")
        return known


# -----------------------------------------------------------------------------
# The tokenizer of a data source, trained on its train split on first use, then cached

KEY_FILE = "key.txt"  # the folder name a cached tokenizer was trained as, beside the files it digests


def tokenizer_dir(source=None, vocab_size=None, key=None):
    """A tokenizer's cache folder in this base folder, named by its corpus and size (its key) whatever the base."""
    return get_base_dir() / "tokenizers" / (key or f"{data_key(source)}-{vocab_size}")


def get_tokenizer(source, vocab_size, max_chars=2_000_000_000, doc_cap=10_000, train=True):
    """Load the cached tokenizer for this source and vocab size, checked to be what its folder's name says.
    It trains on the source's train split on first use; with train=False it returns None instead."""
    directory = tokenizer_dir(source, vocab_size)
    if not Tokenizer.saved(directory):
        if not train:
            return None
        reader = ChunkReader()  # one reader names a file with bytes that are not UTF-8 once
        check_split(source, "train", reader)  # a missing or empty source fails here, before the announcement
        # its files hold a line of under 64 bytes per token
        check_writable(directory.parent, f"the {vocab_size}-token tokenizer", needs=3 * 64 * vocab_size,
                       fix="make it writable, free space on its disk, or set NANOPARCAE_BASE_DIR to another folder")
        print(f"Training a {vocab_size}-token tokenizer on {source} (train split, <= {max_chars:,} chars) ...")
        t0 = time.time()
        trained = Tokenizer.train(iter_documents(source, "train", reader), vocab_size, max_chars, doc_cap)

        def save(partial):
            trained.save(partial)
            (partial / KEY_FILE).write_text(directory.name + "\n")

        # A private name per process keeps half a tokenizer from a crash or a concurrent process
        try:
            write_atomically(directory, save, directory.with_name(f"{directory.name}.{os.getpid()}.tmp"))
        except OSError as err:
            if not Tokenizer.saved(directory):  # else another process finished first, and its copy is kept
                raise ValueError(f"{directory} is in the way of the trained tokenizer ({err.strerror}); move it "
                                 f"aside, then run the same command again") from None
        print(f"Trained in {time.time() - t0:.1f}s, saved to {directory}")
    tokenizer = Tokenizer.load(directory)
    recorded = directory / KEY_FILE  # older saves lack it, so they must hold as many tokens as asked
    trained_as = read_part(recorded, lambda raw: raw.decode().strip()) if recorded.is_file() else None
    if trained_as not in (None, directory.name) or (trained_as is None and tokenizer.vocab_size != vocab_size):
        raise ValueError(f"the tokenizer at {directory} has {tokenizer.vocab_size} tokens"
                         + (f" and was trained as {trained_as}" if trained_as else "")
                         + f", not the {directory.name} its name promises; remove it, and the same command trains it")
    return tokenizer


def checkpoint_tokenizer(ckpt, path):
    """The tokenizer checkpoint `path` (read as ckpt) trained with, from the folder it recorded or the same-named one
    here (the base folder moved), checked against the checkpoint (check_tokenizer)."""
    if not isinstance(recorded := ckpt.get("tokenizer_dir"), str):
        raise ValueError(f"checkpoint {path} is not a nanoparcae checkpoint (it names no tokenizer_dir); pass one "
                         f"that train.py wrote")
    places = list(dict.fromkeys((Path(recorded), tokenizer_dir(key=Path(recorded).name))))
    run = ckpt["args"] if isinstance(ckpt.get("args"), dict) else {}
    flags = " ".join(f"--{flag}={run.get(flag, '...')}" for flag in ("data", "vocab_size"))
    recreate = f"recreate it with `python -m nanoparcae.tokenizer {flags}`"  # the run's own tokenizer
    if (found := next((place for place in places if Tokenizer.saved(place, recreate)), None)) is None:
        raise FileNotFoundError(f"the tokenizer of checkpoint {path} is not at "
                                f"{' nor at '.join(map(str, places))}; {recreate}")
    # a torn file is named before the digest differs
    return check_tokenizer(ckpt, path, Tokenizer.load(found), "or load a checkpoint trained with this one")


def check_tokenizer(ckpt, path, tokenizer, remedy):
    """Refuse a loaded tokenizer other than the one checkpoint `path` trained with: its digest, or its size."""
    if (trained_with := ckpt.get("tokenizer_digest")) and tokenizer.digest != trained_with:
        raise ValueError(f"the tokenizer at {tokenizer.directory} (digest {tokenizer.digest}) is not the one {path} "
                         f"was trained with (digest {trained_with}); put that tokenizer back, {remedy}")
    if type(vocab := ckpt["config"].get("vocab_size")) is int and tokenizer.vocab_size > vocab:
        raise ValueError(f"the tokenizer at {tokenizer.directory} has {tokenizer.vocab_size} tokens, the model "
                         f"{vocab}: they are not from the same run")
    return tokenizer


# -----------------------------------------------------------------------------
# Command line: train (once) and cache the tokenizer of a data source

def main(argv=None):
    parser = command_parser(__doc__)
    flag = parser.add_argument
    flag("--data", default="fineweb-edu", help="fineweb-edu, stdlib, or a path/folder/glob of your files")
    flag("--vocab_size", type=vocab_size_flag, default=32768, help="special tokens included (default 32768)")
    flag("--max_chars", type=positive(int), default=2_000_000_000, help="characters to train on (default 2B)")
    flag("--doc_cap", type=positive(int), default=10_000, help="characters kept per document (default 10k)")
    args = parser.parse_args(argv)
    print(f"Base directory: {get_base_dir()}")
    tokenizer = get_tokenizer(args.data, args.vocab_size, args.max_chars, args.doc_cap)
    texts = list(itertools.islice(iter_documents(args.data, "val"), 1000))
    num_tokens, num_bytes = sum(map(len, tokenizer.encode(texts))), sum(len(text.encode("utf-8")) for text in texts)
    print(f"Validation: {num_bytes / num_tokens:.2f} bytes per token over {len(texts)} documents")


if __name__ == "__main__":
    run_command(main)
