"""
nanoparcae/dataset.py: the text and the data check, everything before the loader (METHOD.md §2).

- the FineWeb-Edu download.
- the three kinds of source, read in chunks.
- each source's tokenizer, trained once and cached.
- the tokens a run needs, against those on disk.

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
Library functions raise FileNotFoundError, ValueError or OSError.
Only the command line turns them into one line and an exit status.
"""

import argparse
import glob
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import sys
import sysconfig
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import NamedTuple

import pyarrow.parquet as pq

from model import PAPER_TOKENS
from nanoparcae.common import EnvironmentFailure, cannot_write, check_writable, fail, get_base_dir, print0
from nanoparcae.download import download_file
from nanoparcae.flags import positive
from nanoparcae.tokenizer import Tokenizer, vocab_size_flag

FINEWEB_URL = "https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main"
# The mirror's setting, named as each caller names it: download's flag, the recipe's variable
BASE_URL = "--base_url (runs/speedrun.sh: FINEWEB_URL)"
FINEWEB_VAL_SHARD = 1822  # METHOD.md §5: shards 0..1822, the last one held out, as nanochat does
FINEWEB_SHARD_TOKENS = 50e6  # about 250M characters a shard: what a download is sized by, before any is read
# Best-fit packing crops about 35% of FineWeb-Edu's tokens at 2,048 a row (nanochat/dataloader.py's docstring):
# what a download is sized by, before any shard is there to measure. A run measures its own (data.packing).
PACKING_CROP = 0.35
VAL_EVERY = 20  # stdlib and user files: a document is validation iff crc32(text) % 20 == 0 (~5%)
FILES_PER_CHUNK = 64  # text files are read (and shared across ranks) in groups of this many


def fineweb_dir():
    path = get_base_dir() / "fineweb-edu"
    path.mkdir(parents=True, exist_ok=True)
    return path

# -----------------------------------------------------------------------------
# FineWeb-Edu shards: a download, a parquet check, then the final name

def shard_name(index):
    return f"shard_{index:05d}.parquet"


def download_shard(index, base_url=FINEWEB_URL, max_attempts=5, retry_delay=1.0):
    """-> (the shard's path, whether it was fetched now: False when it was there)."""
    path = fineweb_dir() / shard_name(index)
    if path.exists():  # only complete, checked shards ever get the final name
        return path, False
    url = f"{base_url.rstrip('/')}/{path.name}"
    unchecked = path.with_name(path.name + ".tmp")  # the parquet check comes before the final name
    try:
        download_file(url, unchecked, max_attempts, retry_delay)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}: check {BASE_URL} and that the shard index is in 0..{FINEWEB_VAL_SHARD}") \
            from None
    except OSError as e:
        raise OSError(f"{e}; check the network or {BASE_URL}") from None
    try:
        columns = pq.read_metadata(unchecked).schema.names
    except Exception as e:
        unchecked.unlink()
        raise ValueError(f"{url} is not a valid parquet file ({e}); deleted it, check {BASE_URL} and download "
                         f"again") from None
    if "text" not in columns:
        unchecked.unlink()
        raise ValueError(f"{url} has no 'text' column (columns: {columns}); deleted it, check {BASE_URL}")
    unchecked.rename(path)
    return path, True


def download_shards(indices, base_url=FINEWEB_URL, num_workers=4, max_attempts=5, retry_delay=1.0):
    """-> the shards' paths. A line per shard says how many are done and, from those fetched, the time left."""
    print(f"Downloading {len(indices)} shards from {base_url} to {fineweb_dir()} with {num_workers} workers")
    start, fetched = time.time(), 0
    with ThreadPoolExecutor(num_workers) as pool:
        shards = [pool.submit(download_shard, i, base_url, max_attempts, retry_delay) for i in indices]
        for done, shard in enumerate(as_completed(shards), 1):
            path, new = shard.result()
            fetched += new
            left = (time.time() - start) / fetched * (len(indices) - done) if fetched else 0
            print(f"{'Downloaded' if new else 'Skipping'} {path.name}{'' if new else ' (already there)'} "
                  f"[{done}/{len(indices)}, about {left / 60:.0f} min left]", flush=True)
    return [shard.result()[0] for shard in shards]

# -----------------------------------------------------------------------------
# Data sources: a split is a list of chunks, each a list of documents.
# A chunk is a parquet row group, or a group of text files.

class Chunk(NamedTuple):
    paths: tuple  # the files read together
    row_group: int  # parquet row group, -1 for text files
    keep: str | None  # keep only documents of this split by the hash rule ("train"/"val"), None: keep all
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


def parquet_chunks(path, keep):
    metadata = pq.read_metadata(path)
    if "text" not in metadata.schema.names:
        raise ValueError(f"{path} has no 'text' column (columns: {metadata.schema.names}); rename the column to 'text'")
    return [Chunk((path,), rg, keep) for rg in range(metadata.num_row_groups)]


def files_chunks(paths, keep, quiet=False):
    """Parquet files by row group, other files FILES_PER_CHUNK at a time."""
    texts = [p for p in paths if not p.endswith(".parquet")]
    chunks = [Chunk(tuple(texts[i:i + FILES_PER_CHUNK]), -1, keep, quiet)
              for i in range(0, len(texts), FILES_PER_CHUNK)]
    return chunks + [c for p in paths if p.endswith(".parquet") for c in parquet_chunks(p, keep)]


def fineweb_train_shards():
    """The indices of the FineWeb-Edu training shards on disk.
    FileNotFoundError naming the download if the validation shard or every training shard is missing."""
    found = sorted(int(p.name[6:11]) for p in fineweb_dir().glob("shard_*.parquet") if p.name[6:11].isdigit())
    train = [i for i in found if i != FINEWEB_VAL_SHARD]
    missing = [what for what, there in ((f"the validation shard {shard_name(FINEWEB_VAL_SHARD)}",
                                         FINEWEB_VAL_SHARD in found), ("any training shard", train)) if not there]
    if missing:
        raise FileNotFoundError(f"{fineweb_dir()} lacks {' and '.join(missing)} ({len(found)} shards there): run "
                                f"`python -m nanoparcae.dataset download -n N`, which fetches shards 0..N-2 and "
                                f"the validation shard")
    return train


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
    """The documents of a text file. Bytes that are not UTF-8 are left out, warned of once per file.
    reported: the set of files already named (a ChunkReader's); the warning adds to it.
    None warns of none: the standard library's few files in other encodings are expected."""
    with open(path, "rb") as f:
        raw = f.read()
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
        try:
            return [json.loads(line)["text"] for line in text.splitlines() if line.strip()]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: every line must be a JSON object with a 'text' field ({e!r})") from None
    # .py: a document per block of a module or class body: a blank line, then a line indented <= 4 spaces.
    # Whole stdlib files (median ~2k tokens) would lose most tokens to cropping at 256-token rows.
    return re.split(r"\n\s*\n(?=(?: {4})?\S)", text)


def read_units(chunk, reported):
    """The chunk's documents, grouped by what goes to one split together.
    A .py file's blocks share names and imports, so the whole file is train or val.
    Any other document goes by its own hash. reported: read_text_file's."""
    if chunk.row_group >= 0:
        table = pq.ParquetFile(chunk.paths[0]).read_row_group(chunk.row_group, columns=["text"])
        return [[doc] for doc in table.column("text").to_pylist()]
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
        """The chunk's documents, read now and not kept."""
        return read_chunk(chunk, self.reported)

    def documents(self, chunk, epoch, sharers):
        """The chunk's documents, shared by `sharers` loaders that each take it once.
        The list is shared: copy it before changing it."""
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
    """Every document of a split, in a fixed order: what the tokenizer trains on.
    reader: a ChunkReader; None: one of its own."""
    reader = reader or ChunkReader()
    for chunk in list_chunks(source, split):
        yield from reader.read(chunk)


def stored_text_bytes(chunks):
    """The bytes of the chunks' text as stored, from parquet metadata or file sizes, not the text.

    - a parquet row group: its 'text' column, less its 4-byte length prefixes.
      Also less the min and max strings its page statistics repeat.
    - text files: the hash rule's share of their sizes.
    """
    total, footers = 0, {}
    for chunk in chunks:
        if chunk.row_group >= 0:
            path = chunk.paths[0]
            footers[path] = footers.get(path) or pq.read_metadata(path)  # one read of each file's footer
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
    """-> (the tokens the train split holds, bytes per token).
    Tokens: the stored text's bytes over bytes per token.
    Bytes per token: of the first sample_docs validation documents, BOS included.
    An estimate within a few percent, read in seconds at any size.
    No validation document: ValueError naming the cause."""
    texts = list(itertools.islice(iter_documents(source, "val"), sample_docs))
    if not texts:  # the run's evals need them too: refused here rather than measured another way
        raise no_documents(source, "val")
    tokens = sum(len(ids) for ids in tokenizer.encode(texts, prepend_bos=True))
    bytes_per_token = sum(len(text.encode("utf-8")) for text in texts) / tokens
    return stored_text_bytes(list_chunks(source, "train")) / bytes_per_token, bytes_per_token


def count(number):
    """104.0B, 12.3M or 47,370: a count of tokens as a person reads it."""
    return next((f"{number / size:.1f}{unit}" for unit, size in (("B", 1e9), ("M", 1e6)) if number >= size),
                f"{number:,.0f}")


def data_refusal(err, args, tokens, paper_horizon):
    """A data error as one line.
    A missing FineWeb-Edu shard also names the download this run needs, and a small run needing none."""
    if args.data == "fineweb-edu" and isinstance(err, FileNotFoundError):
        sized = f"--depth={args.depth}" if paper_horizon else f"--tokens={tokens:.4g}"
        return (f"{err} (`python -m nanoparcae.dataset download {sized}` fetches what this run reads); without a "
                f"GPU, `bash runs/cpu.sh` trains a small model on this Python's standard library, no download needed")
    return str(err)


def check_data(source, held, tokens, packed, seq_len, world_size=1):
    """The passes the run makes over its train split, as its world_size loaders pack it (data.packing's).
    held: train_tokens' (tokens, bytes per token).
    A pass: the tokens trained before a loader reads the second epoch.

    - where the loaders were packed through one: their rows.
    - else: those held, less the long documents their buffers hold back at its end
      (held_back), less the share packing crops; a row's seq_len + 1 tokens train seq_len.

    A FineWeb-Edu run that would pass its first pass while shards remain to download: ValueError
    naming the download. Another source repeats as it must, and says how often."""
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
        still = (f"; all {FINEWEB_VAL_SHARD:,} training shards hold about {count(FINEWEB_VAL_SHARD * per_shard)} "
                 f"usable tokens, which the run would read {tokens / (FINEWEB_VAL_SHARD * per_shard):.2f} times"
                 if needed > FINEWEB_VAL_SHARD else "")
        raise ValueError(f"the run's {count(tokens)} tokens would pass the {len(shards)} FineWeb-Edu training "
                         f"shards on disk (about {count(one_pass)} tokens a pass once {packs}) {passes:.1f} "
                         f"times: run `python -m nanoparcae.dataset download -n "
                         f"{min(needed, FINEWEB_VAL_SHARD) + 1}` first{still}, or give a smaller --max_tokens")
    print0(f"data: {source}, about {count(held)} training tokens ({bytes_per_token:.2f} bytes a token"
           + (f", {len(shards)} shards" if shards else "") + f"), {count(one_pass)} a pass once {packs}: the run "
           + (f"trains on {passes:.1%} of them" if passes <= 1 else
              f"trains on them about {max(tokens / trained, 1):.2f} times"))
    return passes


def held_back(held, packed, world_size):
    """The tokens world_size loaders hold unpacked in their buffers when a pass of `held` tokens ends.
    Long documents wait there (data.DataLoader packs the longest that fits), so a buffer holds at most
    a share's buffer_docs longest. Their sum, from the sample of lengths, scaled to a share: a bound."""
    lengths = sorted(packed.lengths, reverse=True)
    share_docs = held / world_size / (sum(lengths) / len(lengths))
    top = lengths[:math.ceil(packed.buffer_docs * len(lengths) / share_docs)]
    return min(world_size * sum(top) * share_docs / len(lengths), held)


def no_documents(source, split, rank=0, world_size=1):
    """The error for a split, or a rank's share of it, with no documents, naming the cause:

    - no text at all.
    - too few documents for both splits.
    - fewer documents than ranks.
    """
    counts = {name: sum(1 for _ in iter_documents(source, name)) for name in ("train", "val")}
    if not any(counts.values()):
        return ValueError(f"{source} holds no text (empty or blank files): put documents in it, a blank "
                          f"line between two in a .txt file")
    if not counts[split]:
        return ValueError(f"the {split} split of {source} has no documents: a document goes to "
                          f"validation by a hash of its text (about 1 in {VAL_EVERY}) and {source} holds only "
                          f"{sum(counts.values())}; split the text into more documents (a blank line between two "
                          f"in a .txt file) or pass several files")
    return ValueError(f"rank {rank} of {world_size} has no documents in the {split} split of "
                      f"{source} ({counts[split]} in all): use more data or fewer ranks")


# -----------------------------------------------------------------------------
# The tokenizer of a data source: trained on its train split on first use, then cached

def data_key(source):
    """A data source's content, as a name: the same files give the same key, whatever the base folder."""
    if source == "fineweb-edu":
        return source
    if source == "stdlib":  # another Python version has another standard library; where it lives does not count
        return f"stdlib-py{sys.version_info.major}{sys.version_info.minor}"
    # the files' sizes and modification times are in the key: a changed corpus trains a new tokenizer
    files = [(str(Path(p).resolve()), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in user_files(source)]
    return "files-" + hashlib.sha1(json.dumps(files).encode()).hexdigest()[:10]


def tokenizer_key(source, vocab_size):
    """The name of a source's tokenizer cache folder.
    It identifies the tokenizer and corpus, whatever the base folder."""
    return f"{data_key(source)}-{vocab_size}"


def tokenizer_dir(source=None, vocab_size=None, key=None):
    """A tokenizer's cache folder in this base folder: of source at vocab_size, or by its key."""
    return get_base_dir() / "tokenizers" / (key or tokenizer_key(source, vocab_size))


def get_tokenizer(source, vocab_size, max_chars=2_000_000_000, doc_cap=10_000, train=True):
    """The cached tokenizer for this source and vocab size.
    It trains on the source's train split on first use; train=False: None where it is not cached."""
    directory = tokenizer_dir(source, vocab_size)
    if not train and not (directory / "token_bytes.txt").exists():
        return None
    if not (directory / "token_bytes.txt").exists():
        documents = iter_documents(source, "train")
        if (first := next(documents, None)) is None:  # a missing or empty source fails here, before the announcement
            raise no_documents(source, "train")
        # its three files hold a line of under 64 bytes per token
        check_writable(directory.parent, f"the {vocab_size}-token tokenizer", needs=3 * 64 * vocab_size)
        print(f"Training a {vocab_size}-token tokenizer on {source} (train split, <= {max_chars:,} chars) ...")
        t0 = time.time()
        tokenizer = Tokenizer.train(itertools.chain([first], documents), vocab_size, max_chars, doc_cap)
        # save under a private name and rename, so a crash or a concurrent rank never sees half a tokenizer
        scratch = directory.with_name(f"{directory.name}.{os.getpid()}.tmp")
        try:
            tokenizer.save(scratch)
        except BaseException as err:  # a full disk: no half-written folder left behind
            shutil.rmtree(scratch, ignore_errors=True)
            cannot_write(directory, err)
            raise
        try:
            scratch.rename(directory)
        except OSError:  # another process finished first: keep its copy
            shutil.rmtree(scratch)
        print(f"Trained in {time.time() - t0:.1f}s, saved to {directory}")
    return Tokenizer.load(directory)


# -----------------------------------------------------------------------------
# Command line

def shards_for(args):
    """download's shards, the validation shard always among them.

    - -n: that many in all.
    - --tokens: as many as it needs, at about FINEWEB_SHARD_TOKENS a shard less PACKING_CROP.
    - --depth: as many as the paper's horizon at that depth needs, the same way.

    Training shards are capped at the 1,822 there are."""
    tokens = None if args.num_shards else args.tokens or PAPER_TOKENS.get(args.depth)
    if tokens is None and args.depth is not None:
        raise ValueError(f"--depth={args.depth} has no paper horizon (depths {', '.join(map(str, PAPER_TOKENS))}); "
                         f"pass --tokens or -n")
    per_shard = FINEWEB_SHARD_TOKENS * (1 - PACKING_CROP)  # the tokens a run trains on, of a shard's
    num_train = args.num_shards - 1 if tokens is None else math.ceil(tokens / per_shard)
    if tokens is not None:
        print(f"{tokens / 1e9:.1f}B tokens at about {per_shard / 1e6:.1f}M a shard ({FINEWEB_SHARD_TOKENS / 1e6:.0f}M "
              f"less the ~{PACKING_CROP:.0%} packing crops): {min(num_train, FINEWEB_VAL_SHARD)} training shards"
              + (f", all there are: the run reads them {tokens / (FINEWEB_VAL_SHARD * per_shard):.2f} times"
                 if num_train > FINEWEB_VAL_SHARD else ""))
    return list(range(min(num_train, FINEWEB_VAL_SHARD))) + [FINEWEB_VAL_SHARD]


def check_flags(args):
    """Refused before any work: -n beyond the shards there are, and two ways of sizing a download."""
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.error = fail  # an unknown flag or a bad value: one line, status 2
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("download", allow_abbrev=False,
                            help=f"FineWeb-Edu shards: N-1 for training, shard {FINEWEB_VAL_SHARD} for val")
    p.error = fail
    p.add_argument("-n", "--num_shards", type=int, default=None,
                   help="shards in all, validation included (default 8)")
    p.add_argument("--depth", type=positive(int), default=None, help="as many as train.py --depth=D reads")
    p.add_argument("--tokens", type=positive(float), default=None, help="as many as a run of this many tokens reads")
    p.add_argument("-w", "--workers", type=positive(int), default=4, help="parallel downloads (default 4)")
    p.add_argument("--base_url", default=FINEWEB_URL, help="where the shard_XXXXX.parquet files live")
    p = commands.add_parser("tokenizer", allow_abbrev=False,
                            help="train (once) and cache the tokenizer of a data source")
    p.error = fail
    p.add_argument("--data", default="fineweb-edu", help="fineweb-edu, stdlib, or a path/folder/glob of your files")
    p.add_argument("--vocab_size", type=vocab_size_flag, default=32768, help="special tokens included (default 32768)")
    p.add_argument("--max_chars", type=positive(int), default=2_000_000_000, help="characters to train on (default 2B)")
    p.add_argument("--doc_cap", type=positive(int), default=10_000, help="characters kept per document (default 10k)")
    args = parser.parse_args(argv)
    check_flags(args)
    print(f"Base directory: {get_base_dir()}")

    if args.command == "download":
        download_shards(shards_for(args), args.base_url, args.workers)
    else:
        tokenizer = get_tokenizer(args.data, args.vocab_size, args.max_chars, args.doc_cap)
        texts = list(itertools.islice(iter_documents(args.data, "val"), 1000))
        num_tokens = sum(map(len, tokenizer.encode(texts)))
        num_bytes = sum(len(text.encode("utf-8")) for text in texts)
        print(f"Validation: {num_bytes / num_tokens:.2f} bytes per token over {len(texts)} documents")


if __name__ == "__main__":
    try:
        main()
    except EnvironmentFailure as err:  # a full or read-only disk
        fail(err, 1)
    except (OSError, ValueError) as err:  # bad flags or data, a failed download, a base folder that cannot be written
        fail(err)
