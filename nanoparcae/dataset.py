"""
nanoparcae/dataset.py: a data source's text, everything before the loader (METHOD.md §2).
It reads a source's documents in chunks, trains and caches its tokenizer, and sizes it against a run.

    python -m nanoparcae.dataset download -n 8                  # FineWeb-Edu: 7 train shards + the validation shard
    python -m nanoparcae.dataset download --depth=12            # the shards the paper's 370M run reads
    python -m nanoparcae.dataset tokenizer --data=fineweb-edu   # train the 32,768-token BPE on ~2B characters, cache it

A data source (`--data`) is one of these three.

    fineweb-edu   the 100b-shuffle parquet shards nanochat uses, under $NANOPARCAE_BASE_DIR/fineweb-edu;
                  shard 1822, the last, is the validation split and every other shard there trains
    stdlib        this interpreter's standard-library .py files, a document per top-level or method block
    PATH or GLOB  your own .txt (one document per blank-line-separated paragraph), .jsonl (field "text")
                  or .parquet (column "text") files, or a folder holding them

For stdlib and your own files, a hash of each document's text puts a fixed ~5% in validation.
Everything is cached under $NANOPARCAE_BASE_DIR (default ~/.cache/nanoparcae).
"""

import contextlib
import glob
import hashlib
import itertools
import json
import math
import os
import re
import sys
import sysconfig
import threading
import time
import zlib
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from nanoparcae.command import (EnvironmentFailure, command_parser, first_sentence, run_command, size, positive)
from nanoparcae.files import check_writable, get_base_dir, write_atomically
from nanoparcae.ranks import print0
from nanoparcae.fineweb import (FINEWEB_URL, FINEWEB_VAL_SHARD, download_shards, fineweb_dir,
                                fineweb_train_shards, shard_name, shards_for)
from nanoparcae.tokenizer import Tokenizer, vocab_size_flag

VAL_EVERY = 20  # a stdlib or user document is validation iff crc32(text) % 20 == 0 (~5%)
FILES_PER_CHUNK = 64  # text files are read (and shared across ranks) in groups of this many

# -----------------------------------------------------------------------------
# Data sources. A split is a list of chunks, each a list of documents.
# A chunk is a parquet row group, or a group of text files.

class Chunk(NamedTuple):
    paths: tuple  # the files read together
    row_group: int  # parquet row group, -1 for text files
    keep: str | None  # keep only documents of this split by the hash rule ("train"/"val"); None keeps all
    quiet: bool = False  # bytes that are not UTF-8 are expected (the standard library's test files in other encodings)


def is_val_document(text):
    return zlib.crc32(text.encode("utf-8", "ignore")) % VAL_EVERY == 0


def stdlib_files():
    root = sysconfig.get_paths()["stdlib"]
    return sorted(path for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                  if "site-packages" not in path and "dist-packages" not in path)


def user_files(pattern):
    path = Path(pattern).expanduser()
    found = glob.glob(str(path / "**" / "*"), recursive=True) if path.is_dir() else glob.glob(str(path), recursive=True)
    files = sorted(f for f in found if Path(f).suffix in (".txt", ".jsonl", ".parquet", ".py") and Path(f).is_file())
    if not files:
        raise FileNotFoundError(f"no .txt, .jsonl, .parquet or .py files match '{pattern}': pass --data=stdlib, "
                                f"--data=fineweb-edu, or a path, folder or glob of your own files")
    return files


@contextlib.contextmanager
def reading(path, where=""):
    """Name the data file `path` (and `where` in it, a row group) in what a failed read raises, with the fix.
    A permission error is the machine's (EnvironmentFailure); a file that is not whole data is the user's."""
    try:
        yield
    except PermissionError as err:
        raise EnvironmentFailure(f"{path} cannot be read ({err.strerror}): make it readable, then run the same "
                                 f"command again") from None
    except (OSError, pa.ArrowException) as err:  # ArrowInvalid is a ValueError too
        cause = "it is empty (0 bytes)" if os.path.isfile(path) and os.path.getsize(path) == 0 else \
            first_sentence(err)
        raise ValueError(f"{path}{where} cannot be read ({cause}): remove it or download it again") from None


def parquet_metadata(path):
    """Return a parquet file's footer, checked to hold a 'text' column of strings."""
    with reading(path):
        metadata = pq.read_metadata(path)
        schema = metadata.schema.to_arrow_schema()
    if "text" not in schema.names:
        raise ValueError(f"{path} has no 'text' column (columns: {schema.names}); rename the column to 'text'")
    if not pa.types.is_string(kind := schema.field("text").type) and not pa.types.is_large_string(kind):
        raise ValueError(f"{path}: its 'text' column holds {kind}, not strings; write the text as strings, or remove "
                         f"the file")
    return metadata


def parquet_texts(path, row_group):
    """Return the texts of one row group of a parquet file; a corrupt or null row is named."""
    where = f" (row group {row_group})"
    with reading(path, where):
        column = pq.ParquetFile(path).read_row_group(row_group, columns=["text"]).column("text")
    if column.null_count:
        raise ValueError(f"{path}{where} holds {column.null_count:,} null text(s); remove those rows, or the file")
    return column.to_pylist()


def parquet_chunks(path, keep):
    return [Chunk((path,), rg, keep) for rg in range(parquet_metadata(path).num_row_groups)]


def files_chunks(paths, keep, quiet=False):
    """Chunk parquet files by row group, and other files FILES_PER_CHUNK at a time."""
    texts = [p for p in paths if not p.endswith(".parquet")]
    chunks = [Chunk(tuple(texts[i:i + FILES_PER_CHUNK]), -1, keep, quiet)
              for i in range(0, len(texts), FILES_PER_CHUNK)]
    return chunks + [c for p in paths if p.endswith(".parquet") for c in parquet_chunks(p, keep)]


def list_chunks(source, split):
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got '{split}'")
    if source == "fineweb-edu":
        train = fineweb_train_shards()  # both splits need the validation shard there
        paths = [fineweb_dir() / shard_name(i) for i in (train if split == "train" else [FINEWEB_VAL_SHARD])]
        return [c for path in paths for c in parquet_chunks(str(path), None)]
    if source == "stdlib":
        return files_chunks(stdlib_files(), split, quiet=True)
    return files_chunks(user_files(source), split)


def read_text_file(path, reported=None):
    """Return the documents of a text file, leaving out bytes that are not UTF-8.
    The warning names each file once, adding it to `reported` (a ChunkReader's set).
    A NUL byte says the file is not UTF-8 text at all (UTF-16, or binary): that raises ValueError.
    With reported None it checks none, since a few standard-library files use other encodings."""
    with reading(path), open(path, "rb") as f:
        raw = f.read()
    if reported is not None and (nul := raw.find(b"\0")) >= 0:
        raise ValueError(f"{path} is not UTF-8 text (byte {nul} is NUL: UTF-16, or not text); convert it to "
                         f"UTF-8, or remove it")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        text = raw.decode("utf-8", errors="ignore")
        if reported is not None and path not in reported:
            reported.add(path)
            print(f"warning: {path}: {len(raw) - len(text.encode('utf-8')):,} bytes that are not UTF-8 (the first at "
                  f"byte {err.start}) are left out; convert the file to UTF-8 to keep them", file=sys.stderr)
    if path.endswith(".txt"):
        return re.split(r"\n\s*\n", text)
    if path.endswith(".jsonl"):
        return [jsonl_text(path, number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    # A .py file gives a document per block of a module or class body.
    # A block starts after a blank line, at a line indented by at most 4 spaces.
    # Whole stdlib files (median ~2k tokens) would lose most tokens to cropping at 256-token rows.
    return re.split(r"\n\s*\n(?=(?: {4})?\S)", text)


def jsonl_text(path, number, line):
    """Return the 'text' string of line `number` of a .jsonl file; anything else raises ValueError naming it."""
    try:
        text = json.loads(line)["text"]
    except (ValueError, KeyError, TypeError) as e:
        text = e
    if not isinstance(text, str):
        raise ValueError(f"{path}, line {number}: every line must be a JSON object with a 'text' field that is a "
                         f"string ({text!r}); fix the line, or remove the file")
    return text


def read_units(chunk, reported):
    """Return the chunk's documents, grouped by what goes to one split together.
    A .py file's blocks share names and imports, so the whole file is train or val.
    Any other document goes by its own hash. `reported` is read_text_file's."""
    if chunk.row_group >= 0:
        return [[doc] for doc in parquet_texts(chunk.paths[0], chunk.row_group)]
    units = []
    for path in chunk.paths:
        docs = read_text_file(path, None if chunk.quiet else reported)
        units += [docs] if path.endswith(".py") else [[doc] for doc in docs]
    return units


def read_chunk(chunk, reported):
    docs = []
    for unit in read_units(chunk, reported):
        if chunk.keep is None or is_val_document("".join(unit)) == (chunk.keep == "val"):
            docs += [doc for doc in unit if doc and not doc.isspace()]
    return docs


class ChunkReader:
    """Reads chunks for the loaders that share it, each chunk once for all of them.

    - train.py builds one per process, and a loader per micro-batch (a virtual rank).
      Each loader takes its own share of every chunk.
      Without a shared reader, a process would read and decode each chunk once per micro-batch.
    - A chunk is kept until all its `sharers` loaders have taken it, then dropped.
      What a loader yields does not change.
    - At most max_kept chunks are kept; the oldest go first, read again if asked for.
      Loaders drift apart a little, and after a resume a loader past a chunk never takes it.
    - A file with bytes that are not UTF-8 is named once per reader (read_text_file).
    """

    def __init__(self, max_kept=64):
        self.kept, self.lock = {}, threading.Lock()  # (chunk, epoch) -> [documents, loaders still to take it]
        self.max_kept = max_kept
        self.reads = self.chars_read = 0  # chunks read from disk and their characters
        self.reported = set()  # the files already named for bytes that are not UTF-8

    def read(self, chunk):
        """Read the chunk's documents now, and keep none."""
        return read_chunk(chunk, self.reported)

    def documents(self, chunk, epoch, sharers):
        """Return the chunk's documents, shared by `sharers` loaders that each take it once.
        The list is shared, so copy it before changing it."""
        with self.lock:  # the loaders' prefetch threads ask at once; the first one reads
            key = (chunk, epoch)
            if key not in self.kept:
                docs = self.read(chunk)
                self.kept[key] = [docs, sharers]
                if len(self.kept) > self.max_kept:
                    del self.kept[next(iter(self.kept))]
                self.reads += 1
                self.chars_read += sum(map(len, docs))
            entry = self.kept[key]
            entry[1] -= 1
            if entry[1] <= 0:
                del self.kept[key]
            return entry[0]


def iter_documents(source, split, reader=None):
    """Yield every document of a split in a fixed order, the one the tokenizer trains on.
    It reads through `reader`, a ChunkReader, or one of its own."""
    reader = reader or ChunkReader()
    for chunk in list_chunks(source, split):
        yield from reader.read(chunk)


def check_split(source, split, reader=None):
    """Raise ValueError naming the cause when a source's split holds no documents.
    The source may hold no text at all, or too few documents for both splits.
    It reads through `reader`, as iter_documents does."""
    if next(iter_documents(source, split, reader), None) is not None:
        return
    counts = {name: sum(1 for _ in iter_documents(source, name)) for name in ("train", "val")}
    if not any(counts.values()):
        raise ValueError(f"{source} holds no text (empty or blank files): put documents in it, a blank "
                         f"line between two in a .txt file")
    raise ValueError(f"the {split} split of {source} has no documents: a document goes to "
                     f"validation by a hash of its text (about 1 in {VAL_EVERY}) and {source} holds only "
                     f"{sum(counts.values())}; split the text into more documents (a blank line between two "
                     f"in a .txt file) or pass several files")

# -----------------------------------------------------------------------------
# The tokens a split holds, against the tokens a run trains


def stored_text_bytes(chunks):
    """Count the bytes of the chunks' text as stored, from parquet metadata or file sizes, not the text.

    - a parquet row group: its 'text' column, less its 4-byte length prefixes.
      Also less the min and max strings its page statistics repeat.
    - text files: the hash rule's share of their sizes.
    """
    total, footers = 0, {}
    for chunk in chunks:
        if chunk.row_group >= 0:
            path = chunk.paths[0]
            footers[path] = footers.get(path) or parquet_metadata(path)  # one read of each file's footer
            group = footers[path].row_group(chunk.row_group)
            column = next(group.column(i) for i in range(group.num_columns)
                          if group.column(i).path_in_schema == "text")
            stats = column.statistics
            repeated = len(stats.min.encode()) + len(stats.max.encode()) if stats and stats.has_min_max else 0
            total += column.total_uncompressed_size - 4 * group.num_rows - repeated
        else:
            share = {None: 1.0, "train": 1 - 1 / VAL_EVERY, "val": 1 / VAL_EVERY}[chunk.keep]
            total += share * sum(os.path.getsize(path) for path in chunk.paths)
    return total


def train_tokens(source, tokenizer, sample_docs=1000):
    """Estimate the tokens the train split holds; return them and the bytes per token.
    The tokens are the stored text's bytes over bytes per token, within a few percent, read in seconds.
    Bytes per token come from the first sample_docs validation documents, BOS included.
    A split without validation documents raises ValueError, since the run's evals need them too."""
    check_split(source, "val")
    texts = list(itertools.islice(iter_documents(source, "val"), sample_docs))
    tokens = sum(len(ids) for ids in tokenizer.encode(texts, prepend_bos=True))
    bytes_per_token = sum(len(text.encode("utf-8")) for text in texts) / tokens
    return stored_text_bytes(list_chunks(source, "train")) / bytes_per_token, bytes_per_token


def check_data(source, held, tokens, packed, seq_len, world_size=1):
    """Return the passes a run makes over its train split, as its world_size loaders pack it (data.packing).
    `held` is train_tokens' pair of tokens and bytes per token.
    A pass is the tokens trained before a loader reads the second epoch. It is counted one of two ways:

    - the loaders' rows, where they were packed through one pass.
    - else, the tokens held, less what packing crops and what the buffers hold back at its end (held_back).
      A row's seq_len + 1 tokens train seq_len.

    A FineWeb-Edu run that would read a second pass while shards remain to download raises ValueError.
    It names the download. Another source repeats as it must, and says how often."""
    held, bytes_per_token = held
    crop, row_share = packed.crop, seq_len / (seq_len + 1)
    trained = held * (1 - crop) * row_share  # the tokens trained on, whoever holds them back
    if packed.rows is not None:
        one_pass = max(packed.rows * seq_len * world_size, 1)
    else:
        one_pass = max((held - held_back(held, packed, world_size)) * (1 - crop) * row_share, 1)
    packs = f"packing crops {crop:.1%} at --seq_len={seq_len} and {world_size} loader(s) hold a buffer back"
    shards = fineweb_train_shards() if source == "fineweb-edu" else None
    passes = tokens / one_pass
    if shards and passes > 1 and len(shards) < FINEWEB_VAL_SHARD:
        per_shard = trained / len(shards)
        needed = math.ceil((tokens + max(trained - one_pass, 0)) / per_shard)  # the buffers' too
        usable = FINEWEB_VAL_SHARD * per_shard
        still = (f"; all {FINEWEB_VAL_SHARD:,} training shards hold about {size(usable, '')} usable tokens, which "
                 f"the run would read {tokens / usable:.2f} times" if needed > FINEWEB_VAL_SHARD else "")
        raise ValueError(f"the run's {size(tokens, '')} tokens would pass the {len(shards)} FineWeb-Edu training "
                         f"shards on disk (about {size(one_pass, '')} tokens a pass once {packs}) {passes:.1f} "
                         f"times: run `python -m nanoparcae.dataset download -n "
                         f"{min(needed, FINEWEB_VAL_SHARD) + 1}` first{still}, or give a smaller --max_tokens")
    print0(f"data: {source}, about {size(held, '')} training tokens ({bytes_per_token:.2f} bytes a token"
           + (f", {len(shards)} shards" if shards else "") + f"), {size(one_pass, '')} a pass once {packs}: the "
           + (f"run trains on {passes:.1%} of them" if passes <= 1 else
              f"run trains on them about {max(tokens / trained, 1):.2f} times"))
    return passes


def held_back(held, packed, world_size):
    """Bound the tokens world_size loaders hold unpacked in their buffers when a pass of `held` tokens ends.
    Long documents wait there, since data.DataLoader packs the longest that fits. A buffer holds at most
    a share's buffer_docs longest. The bound is their sum, from the sample of lengths, scaled to a share."""
    lengths = sorted(packed.lengths, reverse=True)
    share_docs = held / world_size / (sum(lengths) / len(lengths))
    top = lengths[:math.ceil(packed.buffer_docs * len(lengths) / share_docs)]
    return min(world_size * sum(top) * share_docs / len(lengths), held)


# -----------------------------------------------------------------------------
# The tokenizer of a data source, trained on its train split on first use, then cached

def data_key(source):
    """Name a data source's content, so the same files give the same key, whatever the base folder."""
    if source == "fineweb-edu":
        return source
    if source == "stdlib":  # another Python version has another standard library; where it lives does not count
        return f"stdlib-py{sys.version_info.major}{sys.version_info.minor}"
    # the key holds the files' sizes and modification times, so a changed corpus trains a new tokenizer
    files = [(str(Path(p).resolve()), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in user_files(source)]
    return "files-" + hashlib.sha1(json.dumps(files).encode()).hexdigest()[:10]


def tokenizer_key(source, vocab_size):
    """Name a source's tokenizer cache folder by its tokenizer and corpus, whatever the base folder."""
    return f"{data_key(source)}-{vocab_size}"


def tokenizer_dir(source=None, vocab_size=None, key=None):
    """A tokenizer's cache folder in this base folder: of source at vocab_size, or by its key."""
    return get_base_dir() / "tokenizers" / (key or tokenizer_key(source, vocab_size))


def get_tokenizer(source, vocab_size, max_chars=2_000_000_000, doc_cap=10_000, train=True):
    """Load the cached tokenizer for this source and vocab size.
    It trains on the source's train split on first use; with train=False it returns None instead."""
    directory = tokenizer_dir(source, vocab_size)
    if not train and not Tokenizer.saved(directory):
        return None
    if not Tokenizer.saved(directory):
        reader = ChunkReader()  # one reader names a file with bytes that are not UTF-8 once
        check_split(source, "train", reader)  # a missing or empty source fails here, before the announcement
        # its three files hold a line of under 64 bytes per token
        check_writable(directory.parent, f"the {vocab_size}-token tokenizer", needs=3 * 64 * vocab_size,
                       fix="make it writable, free space on its disk, or set NANOPARCAE_BASE_DIR to another folder")
        print(f"Training a {vocab_size}-token tokenizer on {source} (train split, <= {max_chars:,} chars) ...")
        t0 = time.time()
        tokenizer = Tokenizer.train(iter_documents(source, "train", reader), vocab_size, max_chars, doc_cap)
        # A private name per process keeps half a tokenizer from a crash or a concurrent process
        try:
            write_atomically(directory, tokenizer.save, directory.with_name(f"{directory.name}.{os.getpid()}.tmp"))
        except OSError:
            if not Tokenizer.saved(directory):
                raise
            # another process finished first, and its copy is kept
        print(f"Trained in {time.time() - t0:.1f}s, saved to {directory}")
    return Tokenizer.load(directory)


# -----------------------------------------------------------------------------
# Command line


def check_flags(args):
    """Refuse before any work -n beyond the shards there are, and two ways of sizing a download."""
    if args.command == "download":
        sizings = [flag for flag, value in (("-n", args.num_shards), ("--depth", args.depth),
                                            ("--tokens", args.tokens)) if value is not None]
        if len(sizings) > 1:
            raise ValueError(f"pass one of -n, --depth and --tokens, not {' and '.join(sizings)}")
        if args.num_shards is not None and not 2 <= args.num_shards <= FINEWEB_VAL_SHARD + 1:
            raise ValueError(f"-n={args.num_shards} must be in 2..{FINEWEB_VAL_SHARD + 1} (at least one train shard "
                             f"and the validation shard)")
        if not sizings:
            args.num_shards = 8


def main(argv=None):
    parser = command_parser(__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("download", allow_abbrev=False,
                            help=f"FineWeb-Edu shards: N-1 for training, shard {FINEWEB_VAL_SHARD} for val")
    p.add_argument("-n", "--num_shards", type=int, default=None,
                   help="shards in all, validation included (default 8)")
    p.add_argument("--depth", type=positive(int), default=None, help="as many as train.py --depth=D reads")
    p.add_argument("--tokens", type=positive(float), default=None, help="as many as a run of this many tokens reads")
    p.add_argument("-w", "--workers", type=positive(int), default=4, help="parallel downloads (default 4)")
    p.add_argument("--base_url", default=FINEWEB_URL, help="where the shard_XXXXX.parquet files live")
    p = commands.add_parser("tokenizer", allow_abbrev=False,
                            help="train (once) and cache the tokenizer of a data source")
    p.add_argument("--data", default="fineweb-edu", help="fineweb-edu, stdlib, or a path/folder/glob of your files")
    p.add_argument("--vocab_size", type=vocab_size_flag, default=32768, help="special tokens included (default 32768)")
    p.add_argument("--max_chars", type=positive(int), default=2_000_000_000, help="characters to train on (default 2B)")
    p.add_argument("--doc_cap", type=positive(int), default=10_000, help="characters kept per document (default 10k)")
    args = parser.parse_args(argv)
    check_flags(args)
    print(f"Base directory: {get_base_dir()}")
    if args.command == "download":
        download_shards(shards_for(args.num_shards, args.depth, args.tokens), args.base_url, args.workers)
        return
    tokenizer = get_tokenizer(args.data, args.vocab_size, args.max_chars, args.doc_cap)
    texts = list(itertools.islice(iter_documents(args.data, "val"), 1000))
    num_tokens = sum(map(len, tokenizer.encode(texts)))
    num_bytes = sum(len(text.encode("utf-8")) for text in texts)
    print(f"Validation: {num_bytes / num_tokens:.2f} bytes per token over {len(texts)} documents")


if __name__ == "__main__":
    run_command(main)


# TEMP shim: helper "data" writes the real check_horizon; drop this block at merge
SHARD_TOKENS = 32.5e6


def check_horizon(source, tokens):
    if source != "fineweb-edu":
        return None
    download = f"--tokens={math.ceil(tokens)}"
    shards = fineweb_train_shards(download)
    if len(shards) < (needed := min(math.ceil(tokens / SHARD_TOKENS), FINEWEB_VAL_SHARD)):
        raise ValueError(f"a run of {size(tokens, '')} tokens reads about {needed} FineWeb-Edu training shards "
                         f"(about {SHARD_TOKENS / 1e6:.1f}M tokens each), and {len(shards)} are on disk; run "
                         f"`python -m nanoparcae.dataset download {download}` first, or give a smaller "
                         f"--max_tokens")
    return shards
