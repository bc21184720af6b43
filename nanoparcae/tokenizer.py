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

from nanoparcae.flags import checked

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte a token of its own, then the specials
# --vocab_size's type refuses a smaller one before any tokenizer trains
vocab_size_flag = checked(int, f"at least {MIN_VOCAB_SIZE} (256 byte tokens and {len(SPECIAL_TOKENS)} "
                                f"specials); pass --vocab_size={MIN_VOCAB_SIZE} or more",
                          lambda value: MIN_VOCAB_SIZE <= value < 2**31)
# METHOD.md §2 uses GPT-4's split, but digits group by 1-2 (GPT-4 by 1-3), as in nanochat.
# That wastes fewer tokens on numbers at small vocab sizes.
SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
                 r"""|\s*[\r\n]|\s+(?!\S)|\s+""")

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
        if vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"vocab_size {vocab_size} is too small: it needs 256 byte tokens "
                             f"+ {len(SPECIAL_TOKENS)} specials")
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
            digest.update(name.encode() + b"\0" + (Path(directory) / name).read_bytes())
        return digest.hexdigest()[:16]

    @classmethod
    def load(cls, directory):
        directory = Path(directory)
        ranks = {}
        for line in (directory / "tokenizer.tiktoken").read_text().splitlines():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        config = json.loads((directory / "tokenizer.json").read_text())
        enc = tiktoken.Encoding("nanoparcae", pat_str=config["pattern"], mergeable_ranks=ranks,
                                special_tokens=config["special_tokens"])
        byte_counts = (directory / "token_bytes.txt").read_text().split()
        token_bytes = torch.tensor([int(n) for n in byte_counts], dtype=torch.int32)
        if len(token_bytes) != enc.n_vocab:
            raise ValueError(f"{directory}/token_bytes.txt does not match the vocabulary: "
                             f"delete {directory} to retrain")
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
