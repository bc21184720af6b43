"""
Everything between raw text and the (x, y) batches that train.py consumes (METHOD.md §2).

The steps, each one command:

    python data.py download -n 8                        # FineWeb-Edu: 7 train shards + the last shard (validation)
    python data.py tokenizer --data=fineweb-edu         # train the 32,768-token BPE on ~2B characters, cache it
    python data.py loader --data=stdlib --vocab_size=4096 --seq_len=2048   # loader throughput and cropped share

A data source (`--data`) is one of
    fineweb-edu   the 100b-shuffle parquet shards nanochat uses, under $NANOPARCAE_BASE_DIR/fineweb-edu;
                  the highest-numbered shard on disk is the validation split
    stdlib        this interpreter's standard-library .py files, a document per top-level or method block
    PATH or GLOB  your own .txt (one document per blank-line-separated paragraph), .jsonl (field "text")
                  or .parquet (column "text") files, or a folder holding them
For stdlib and your own files, a fixed ~5% of documents (chosen by a hash of their text) is validation.

Everything is cached under $NANOPARCAE_BASE_DIR (default ~/.cache/nanoparcae). The library functions raise
FileNotFoundError, ValueError or OSError; only the command line turns them into one line and an exit status.
"""

import argparse
import bisect
import collections
import glob
import hashlib
import itertools
import json
import math
import os
import queue
import random
import re
import sys
import sysconfig
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pyarrow.parquet as pq
import torch

from common import get_base_dir
from download import download_file
from tokenizer import Tokenizer

FINEWEB_URL = "https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main"
FINEWEB_LAST_SHARD = 1822  # METHOD.md §5: shards 0..1822
VAL_EVERY = 20  # stdlib and user files: a document is validation iff crc32(text) % 20 == 0 (~5%)
FILES_PER_CHUNK = 64  # text files are read (and shared across ranks) in groups of this many
NOT_UTF8 = set()  # the files already reported to hold bytes that are not UTF-8 (each is read once per epoch)


def fineweb_dir():
    path = get_base_dir() / "fineweb-edu"
    path.mkdir(parents=True, exist_ok=True)
    return path

# -----------------------------------------------------------------------------
# The tokenizer of a data source: trained on its train split on first use, then cached

def tokenizer_key(source, vocab_size):
    """What identifies a source's tokenizer and corpus, whatever the base folder: the name of its cache folder."""
    if source == "fineweb-edu":
        name = source
    elif source == "stdlib":  # another Python version has another standard library; where it lives does not count
        name = f"stdlib-py{sys.version_info.major}{sys.version_info.minor}"
    else:  # the files' sizes and modification times are in the key: a changed corpus trains a new tokenizer
        files = [(str(Path(p).resolve()), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in user_files(source)]
        name = "files-" + hashlib.sha1(json.dumps(files).encode()).hexdigest()[:10]
    return f"{name}-{vocab_size}"


def tokenizer_dir(source, vocab_size):
    return get_base_dir() / "tokenizers" / tokenizer_key(source, vocab_size)


def get_tokenizer(source, vocab_size, max_chars=2_000_000_000, doc_cap=10_000):
    """The cached tokenizer for this source and vocab size, trained on the source's train split on first use."""
    directory = tokenizer_dir(source, vocab_size)
    if not (directory / "token_bytes.txt").exists():
        documents = iter_documents(source, "train")
        if (first := next(documents, None)) is None:  # a missing or empty source fails here, before the announcement
            raise DocumentStream(source, "train").no_documents()
        print(f"Training a {vocab_size}-token tokenizer on {source} (train split, <= {max_chars:,} chars) ...")
        t0 = time.time()
        tokenizer = Tokenizer.train(itertools.chain([first], documents), vocab_size, max_chars, doc_cap)
        # save under a private name and rename, so a crash or a concurrent rank never sees half a tokenizer
        scratch = directory.with_name(f"{directory.name}.{os.getpid()}.tmp")
        tokenizer.save(scratch)
        try:
            scratch.rename(directory)
        except OSError:  # another process finished first: keep its copy
            for path in scratch.iterdir():
                path.unlink()
            scratch.rmdir()
        print(f"Trained in {time.time() - t0:.1f}s, saved to {directory}")
    return Tokenizer.load(directory)

# -----------------------------------------------------------------------------
# FineWeb-Edu shards: a download, a parquet check, then the final name

def shard_name(index):
    return f"shard_{index:05d}.parquet"


def download_shard(index, base_url=FINEWEB_URL, max_attempts=5, retry_delay=1.0):
    path = fineweb_dir() / shard_name(index)
    if path.exists():  # only complete, checked shards ever get the final name
        print(f"Skipping {path.name} (already there)")
        return path
    url = f"{base_url.rstrip('/')}/{path.name}"
    unchecked = path.with_name(path.name + ".tmp")  # the parquet check comes before the final name
    try:
        download_file(url, unchecked, max_attempts, retry_delay)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}: check --base_url and that the shard index is in 0..{FINEWEB_LAST_SHARD}") \
            from None
    except OSError as e:
        raise OSError(f"{e}; check the network or --base_url") from None
    try:
        columns = pq.read_metadata(unchecked).schema.names
    except Exception as e:
        unchecked.unlink()
        raise ValueError(f"{url} is not a valid parquet file ({e}); deleted it, check --base_url and download again") \
            from None
    if "text" not in columns:
        unchecked.unlink()
        raise ValueError(f"{url} has no 'text' column (columns: {columns}); deleted it, check --base_url")
    unchecked.rename(path)
    print(f"Downloaded {path.name}")
    return path


def download_shards(indices, base_url=FINEWEB_URL, num_workers=4, max_attempts=5, retry_delay=1.0):
    print(f"Downloading {len(indices)} shards from {base_url} to {fineweb_dir()} with {num_workers} workers")
    with ThreadPoolExecutor(num_workers) as pool:
        return list(pool.map(lambda i: download_shard(i, base_url, max_attempts, retry_delay), indices))

# -----------------------------------------------------------------------------
# Data sources: a split is a list of chunks (a parquet row group, or a group of text files), each a list of documents

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
        raise FileNotFoundError(f"no .txt, .jsonl or .parquet files match '{pattern}': pass --data=stdlib, "
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


def list_chunks(source, split):
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got '{split}'")
    if source == "fineweb-edu":
        shards = sorted(str(p) for p in fineweb_dir().glob("shard_*.parquet"))
        if len(shards) < 2:
            raise FileNotFoundError(f"found {len(shards)} FineWeb-Edu shards in {fineweb_dir()}, need at least 2 (the "
                                    f"last is validation): run `python data.py download -n 8`")
        # METHOD.md §5: the last shard is validation
        return [c for p in (shards[:-1] if split == "train" else shards[-1:]) for c in parquet_chunks(p, None)]
    if source == "stdlib":
        return files_chunks(stdlib_files(), split, quiet=True)
    return files_chunks(user_files(source), split)


def read_text_file(path, quiet=False):
    """The documents of a text file. Bytes that are not UTF-8 are left out, with a warning once per file unless
    quiet."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        text = raw.decode("utf-8", errors="ignore")
        if not quiet and path not in NOT_UTF8:
            NOT_UTF8.add(path)
            print(f"warning: {path}: {len(raw) - len(text.encode('utf-8')):,} bytes that are not UTF-8 (the first at "
                  f"byte {err.start}) are left out; convert the file to UTF-8 to keep them", file=sys.stderr)
    if path.endswith(".txt"):
        return re.split(r"\n\s*\n", text)
    if path.endswith(".jsonl"):
        try:
            return [json.loads(line)["text"] for line in text.splitlines() if line.strip()]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: every line must be a JSON object with a 'text' field ({e!r})") from None
    # .py: one document per block of a module or class body (a blank line, then a line indented by at most 4
    # spaces): whole stdlib files (median ~2k tokens) would lose most of their tokens to cropping at 256-token rows
    return re.split(r"\n\s*\n(?=(?: {4})?\S)", text)


def read_units(chunk):
    """The chunk's documents, grouped by what goes to one split together: a .py file's blocks share names
    and imports, so the whole file is train or val; any other document goes by its own hash."""
    if chunk.row_group >= 0:
        table = pq.ParquetFile(chunk.paths[0]).read_row_group(chunk.row_group, columns=["text"])
        return [[doc] for doc in table.column("text").to_pylist()]
    units = []
    for path in chunk.paths:
        docs = read_text_file(path, chunk.quiet)
        units += [docs] if path.endswith(".py") else [[doc] for doc in docs]
    return units


def read_chunk(chunk):
    docs = []
    for unit in read_units(chunk):
        if chunk.keep is None or is_val_document("".join(unit)) == (chunk.keep == "val"):
            docs += [doc for doc in unit if doc and not doc.isspace()]
    return docs


class ChunkReader:
    """Reads each chunk once for all the loaders of this process. train.py gives each micro-batch of a step
    its own loader (a virtual rank), and every one of them takes its own share of every chunk, so without
    this a process would read and decode each chunk once per micro-batch. A chunk is kept until all of its
    `sharers` loaders have taken it, then dropped; what a loader yields does not change. At most max_kept
    chunks are kept (the oldest go first, to be read again if asked for): loaders drift apart a little, and
    after a resume a loader already past a chunk never takes it."""

    def __init__(self, max_kept=64):
        self.kept, self.lock = {}, threading.Lock()  # (chunk, epoch) -> [documents, loaders still to take it]
        self.max_kept = max_kept
        self.reads = self.chars_read = 0  # chunks read from disk and their characters

    def documents(self, chunk, epoch, sharers):
        """The chunk's documents (a shared list: copy before changing it)."""
        with self.lock:  # the loaders' prefetch threads ask at once; the first one reads
            key = (chunk, epoch)
            if key not in self.kept:
                docs = read_chunk(chunk)
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


CHUNKS = ChunkReader()


def iter_documents(source, split):
    """Every document of a split, in a fixed order (what the tokenizer trains on)."""
    for chunk in list_chunks(source, split):
        yield from read_chunk(chunk)


class DocumentStream:
    """One rank's documents of a split. Epoch e visits the chunks in an order drawn from (seed, e), and each
    chunk's documents in an order drawn from (seed, e, position); rank r takes every world_size-th of them,
    so the ranks' shares are disjoint and together are the whole split. A document's id is
    (epoch, chunk position, index in this rank's share of that chunk)."""

    def __init__(self, source, split, seed=0, rank=0, world_size=1, sharers=1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.chunks = list_chunks(source, split)
        self.source, self.split, self.seed, self.rank, self.world_size = source, split, seed, rank, world_size
        self.sharers = sharers  # this process's streams of the same split that read every chunk (ChunkReader)
        self._order = (None, None)

    def order(self, epoch):
        cached_epoch, order = self._order  # one permutation per epoch, cached: it is asked for once per chunk
        if cached_epoch != epoch:
            order = list(range(len(self.chunks)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return order

    def share(self, epoch, position, shared=True):
        chunk = self.chunks[self.order(epoch)[position]]
        docs = list(CHUNKS.documents(chunk, epoch, self.sharers)) if shared else read_chunk(chunk)
        random.Random(f"{self.seed}:{epoch}:{position}").shuffle(docs)
        return docs[self.rank::self.world_size]

    def no_documents(self):
        """The error for a split, or this rank's share of it, with no documents, naming the cause: no text at all,
        too few documents for both splits, or fewer documents than ranks."""
        counts = {name: sum(1 for _ in iter_documents(self.source, name)) for name in ("train", "val")}
        if not any(counts.values()):
            return ValueError(f"{self.source} holds no text (empty or blank files): put documents in it, a blank "
                              f"line between two in a .txt file")
        if not counts[self.split]:
            return ValueError(f"the {self.split} split of {self.source} has no documents: a document goes to "
                              f"validation by a hash of its text (about 1 in {VAL_EVERY}) and {self.source} holds only "
                              f"{sum(counts.values())}; split the text into more documents (a blank line between two "
                              f"in a .txt file) or pass several files")
        return ValueError(f"rank {self.rank} of {self.world_size} has no documents in the {self.split} split of "
                          f"{self.source} ({counts[self.split]} in all): use more data or fewer ranks")

    def iterate(self, epoch=0, position=0, index=0, loop=True):
        """Yield (doc_id, text) from document id (epoch, position, index) on; epoch after epoch if loop."""
        while True:
            whole_epoch, found = position == 0 and index == 0, False
            for pos in range(position, len(self.chunks)):
                docs = self.share(epoch, pos)
                found = found or bool(docs)
                for i in range(index, len(docs)):
                    yield (epoch, pos, i), docs[i]
                index = 0
            if not loop:
                return
            if whole_epoch and not found:  # looping over nothing would hang the trainer
                raise self.no_documents()
            epoch, position, index = epoch + 1, 0, 0

# -----------------------------------------------------------------------------
# Loader: BOS-aligned best-fit packing (METHOD.md §2), tokenizing ahead in a thread, exactly resumable

def tokenize_ahead(tokenizer, stream, start, loop, batch_docs, num_threads):
    """Lists of (doc_id, tokens), every document BOS first, tokenized batch_docs at a time."""
    documents = stream.iterate(*start, loop=loop)
    while batch := list(itertools.islice(documents, batch_docs)):
        doc_ids, texts = zip(*batch)
        yield list(zip(doc_ids, tokenizer.encode(list(texts), prepend_bos=True, num_threads=num_threads)))


class Prefetcher:
    """Runs a generator in a daemon thread, at most `depth` items ahead of get() (tiktoken releases the GIL)."""

    def __init__(self, generator, depth=8):
        self.queue, self.stop = queue.Queue(depth), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(generator,), daemon=True)
        self.thread.start()

    def _run(self, generator):
        try:
            for item in generator:
                if not self._put(("item", item)):
                    return
            self._put(("end", None))
        except BaseException as e:  # handed over, so the consumer raises it
            self._put(("error", e))

    def _put(self, message):
        while not self.stop.is_set():
            try:
                self.queue.put(message, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def close(self):
        """Stop and wait for the thread: one still inside tiktoken or torch when the interpreter exits can
        abort the process ("terminate called without an active exception")."""
        self.stop.set()
        self.thread.join(timeout=60)

    def get(self):
        """The next item, None once the generator is done."""
        kind, item = self.queue.get()
        if kind != "item":  # stay finished: every later call sees the same end or error
            self.queue.put((kind, item))
        if kind == "error":
            raise item
        return item


class DataLoader:
    """Yields (x, y), LongTensors of shape (batch_size, seq_len) on `device`: rows of seq_len + 1 tokens that each
    start with BOS, packed best-fit from a buffer of about buffer_docs documents, overflow cropped, no padding
    (METHOD.md §2). The train split cycles over epochs forever; the val split is read once, then StopIteration.
    state_dict() is small (the ids of the buffered documents and of the next one to read), and a loader given it
    yields exactly the batches the saved one would have yielded next."""

    def __init__(self, tokenizer, source, split, batch_size, seq_len, rank=0, world_size=1, seed=0, device="cpu",
                 buffer_docs=1000, num_threads=4, tokenize_batch=128, sharers=1):
        self.tokenizer, self.batch_size, self.seq_len = tokenizer, batch_size, seq_len
        self.device = torch.device(device)
        self.buffer_docs, self.num_threads, self.tokenize_batch = buffer_docs, num_threads, tokenize_batch
        self.stream = DocumentStream(source, split, seed, rank, world_size, sharers)
        self.loop = split == "train"
        self.next_doc = (0, 0, 0)  # id of the next document to take into the buffer
        self.buffer = []  # (length, arrival, doc_id, tokens), sorted by length then arrival
        self.arrivals = self.batches = self.tokens_used = self.tokens_cropped = 0
        self.prefetcher, self.pending = None, collections.deque()

    def _next_document(self):
        if not self.pending:
            if self.prefetcher is None:
                self.prefetcher = Prefetcher(tokenize_ahead(self.tokenizer, self.stream, self.next_doc, self.loop,
                                                            self.tokenize_batch, self.num_threads))
            batch = self.prefetcher.get()
            if batch is None:
                return None
            self.pending.extend(batch)
        doc_id, tokens = self.pending.popleft()
        self.next_doc = (doc_id[0], doc_id[1], doc_id[2] + 1)
        return doc_id, tokens

    def _fill_buffer(self):
        while len(self.buffer) < self.buffer_docs:
            document = self._next_document()
            if document is None:  # the val split is read once
                return
            bisect.insort(self.buffer, (len(document[1]), self.arrivals, *document))
            self.arrivals += 1

    def _pack_row(self):
        """METHOD.md §2: take the longest buffered document that fits whole; when none fits, crop the shortest
        (the least waste) to fill the row exactly. The row starts with BOS because every document does."""
        row, capacity = [], self.seq_len + 1
        while len(row) < capacity:
            self._fill_buffer()
            if not self.buffer:
                return None
            room = capacity - len(row)
            longest_fitting = bisect.bisect_right(self.buffer, (room, math.inf)) - 1
            tokens = self.buffer.pop(max(longest_fitting, 0))[3]
            row.extend(tokens[:room])
            self.tokens_used += min(len(tokens), room)
            self.tokens_cropped += max(len(tokens) - room, 0)
        return row

    def __iter__(self):
        return self

    def __next__(self):
        rows = []
        for _ in range(self.batch_size):
            row = self._pack_row()
            if row is None:
                if self.batches == 0 and self.arrivals == 0:
                    raise self.stream.no_documents()
                if self.batches == 0:
                    raise ValueError(f"the {self.stream.split} split of {self.stream.source} holds less than one batch "
                                     f"({self.batch_size} x {self.seq_len + 1} tokens) for rank {self.stream.rank}: "
                                     f"use a smaller batch size or sequence length, or more data")
                raise StopIteration
            rows.append(row)
        self.batches += 1
        batch = torch.tensor(rows, dtype=torch.long)
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        if self.device.type == "cuda":  # pinned, so the copy runs alongside the GPU's work
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    @property
    def tokens_read(self):
        """Tokens of every document taken into the buffer so far, placed, cropped or still waiting."""
        return self.tokens_used + self.tokens_cropped + sum(entry[0] for entry in self.buffer)

    @property
    def cropped_fraction(self):
        """Share of the tokens of the documents packed so far that were cropped. The buffer keeps the longest
        documents waiting, so on a corpus not much larger than the buffer this reads low until many epochs
        have passed (data.py loader measures the settled share instead)."""
        return self.tokens_cropped / max(self.tokens_used + self.tokens_cropped, 1)

    def state_dict(self):
        s = self.stream
        return {"source": s.source, "split": s.split, "seed": s.seed, "rank": s.rank, "world_size": s.world_size,
                "next_doc": list(self.next_doc),
                "buffer": [[arrival, *doc_id] for _, arrival, doc_id, _ in self.buffer],
                "arrivals": self.arrivals, "batches": self.batches,
                "tokens_used": self.tokens_used, "tokens_cropped": self.tokens_cropped}

    def load_state_dict(self, state):
        s = self.stream
        mine = (s.split, s.seed, s.rank, s.world_size)
        theirs = (state["split"], state["seed"], state["rank"], state["world_size"])
        if mine != theirs:
            raise ValueError(f"loader state is for (split, seed, rank, world_size) = {theirs}, this loader is {mine}: "
                             f"each rank must save and restore its own loader state")
        self.close()
        self.pending.clear()
        self.next_doc = tuple(state["next_doc"])
        self.arrivals, self.batches = state["arrivals"], state["batches"]
        self.tokens_used, self.tokens_cropped = state["tokens_used"], state["tokens_cropped"]
        # re-read and re-tokenize the documents that were waiting in the buffer, a chunk at a time
        by_chunk = collections.defaultdict(list)
        for arrival, epoch, position, index in state["buffer"]:
            by_chunk[epoch, position].append((arrival, index))
        self.buffer = []
        for (epoch, position), entries in by_chunk.items():
            docs = s.share(epoch, position, shared=False)  # the other loaders are not resuming this chunk
            token_lists = self.tokenizer.encode([docs[i] for _, i in entries], prepend_bos=True,
                                                num_threads=self.num_threads)
            for (arrival, index), tokens in zip(entries, token_lists):
                bisect.insort(self.buffer, (len(tokens), arrival, (epoch, position, index), tokens))

    def close(self):
        """Stop tokenizing ahead (the thread would otherwise wait on a full queue)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

    def __del__(self):
        self.close()


def val_batches(tokenizer, source, batch_size, seq_len, num_tokens, rank=0, world_size=1, device="cpu"):
    """The same held-out batches every call: the val split in the order of seed 0, num_tokens in all across the
    ranks (at least one batch each). Fewer come if the split runs out first, so size num_tokens to the split."""
    loader = DataLoader(tokenizer, source, "val", batch_size, seq_len, rank, world_size, seed=0, device=device)
    yield from itertools.islice(loader, max(1, num_tokens // (batch_size * seq_len * world_size)))
    loader.close()

# -----------------------------------------------------------------------------
# Command line

def check_flags(args):
    """Counts and sizes below 1, and -n beyond the shards there are, are refused before any work."""
    if args.command == "download" and not 2 <= args.num_shards <= FINEWEB_LAST_SHARD + 1:
        raise ValueError(f"-n={args.num_shards} must be in 2..{FINEWEB_LAST_SHARD + 1} (at least one train shard and "
                         f"the validation shard)")
    for flag in ("workers", "vocab_size", "max_chars", "doc_cap", "batch_size", "seq_len", "tokens"):
        if getattr(args, flag, 1) < 1:
            raise ValueError(f"--{flag}={getattr(args, flag)} must be 1 or more")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("download", allow_abbrev=False,
                            help=f"FineWeb-Edu shards: N-1 for training, shard {FINEWEB_LAST_SHARD} for val")
    p.add_argument("-n", "--num_shards", type=int, default=8, help="shards in all, validation included (default 8)")
    p.add_argument("-w", "--workers", type=int, default=4, help="parallel downloads (default 4)")
    p.add_argument("--base_url", default=FINEWEB_URL, help="where the shard_XXXXX.parquet files live")
    p = commands.add_parser("tokenizer", allow_abbrev=False,
                            help="train (once) and cache the tokenizer of a data source")
    p.add_argument("--data", default="fineweb-edu", help="fineweb-edu, stdlib, or a path/folder/glob of your files")
    p.add_argument("--vocab_size", type=int, default=32768, help="special tokens included (default 32768)")
    p.add_argument("--max_chars", type=int, default=2_000_000_000, help="characters to train on (default 2B)")
    p.add_argument("--doc_cap", type=int, default=10_000, help="characters kept per document (default 10k)")
    p = commands.add_parser("loader", allow_abbrev=False,
                            help="measure the loader: tokens per second and the share cropped by packing")
    p.add_argument("--data", default="stdlib", help="fineweb-edu, stdlib, or a path/folder/glob of your files")
    p.add_argument("--vocab_size", type=int, default=4096)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=4_000_000, help="tokens to time after the first batch")
    args = parser.parse_args(argv)
    check_flags(args)
    print(f"Base directory: {get_base_dir()}")

    if args.command == "download":
        download_shards(list(range(args.num_shards - 1)) + [FINEWEB_LAST_SHARD], args.base_url, args.workers)
    elif args.command == "tokenizer":
        tokenizer = get_tokenizer(args.data, args.vocab_size, args.max_chars, args.doc_cap)
        texts = list(itertools.islice(iter_documents(args.data, "val"), 1000))
        num_tokens = sum(map(len, tokenizer.encode(texts)))
        num_bytes = sum(len(text.encode("utf-8")) for text in texts)
        print(f"Validation: {num_bytes / num_tokens:.2f} bytes per token over {len(texts)} documents")
    else:
        tokenizer = get_tokenizer(args.data, args.vocab_size)
        loader = DataLoader(tokenizer, args.data, "train", args.batch_size, args.seq_len)
        t0 = time.time()
        next(loader)
        t1 = time.time()
        steps = max(2, args.tokens // (args.batch_size * args.seq_len))
        for step in range(steps):
            if step == steps // 2:  # the crop share is measured over the second half, once the buffer has settled
                used, read = loader.tokens_used, loader.tokens_read
            next(loader)
        t2 = time.time()
        cropped = 1 - (loader.tokens_used - used) / (loader.tokens_read - read)
        print(f"First batch after {t1 - t0:.1f}s (tokenizing the first {loader.buffer_docs} documents), then "
              f"{steps * args.batch_size * args.seq_len / (t2 - t1):,.0f} tokens/s over {steps} batches of "
              f"{args.batch_size} x {args.seq_len}; packing cropped {100 * cropped:.1f}% of the tokens read over "
              f"the last {steps - steps // 2} batches")
        loader.close()


if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError) as err:  # bad flags or data, a failed download, a base folder that cannot be written
        sys.exit(f"data.py: {err}")
