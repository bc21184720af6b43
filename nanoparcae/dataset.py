"""
nanoparcae/dataset.py: every data source's documents, read in one place before the loader (METHOD.md §2),
and the check that FineWeb-Edu's shards on disk cover a run. Its command line downloads those shards.

    python -m nanoparcae.dataset download -n 8                  # FineWeb-Edu: 7 train shards + the validation shard
    python -m nanoparcae.dataset download --depth=12            # the shards the paper's 370M run reads

A data source (`--data`) is one of these three.

    fineweb-edu   the 100b-shuffle parquet shards nanochat uses, under $NANOPARCAE_BASE_DIR/fineweb-edu;
                  shard 1822, the last, is the validation split and every other shard there trains
    stdlib        this interpreter's standard-library .py files, a document per top-level or method block
    PATH or GLOB  your own .txt (one document per blank-line-separated paragraph), .jsonl (field "text")
                  or .parquet (column "text") files, or a folder holding them

For stdlib and your own files, a hash of each document's text puts a fixed ~5% in validation.
"""

import contextlib
import glob
import hashlib
import json
import math
import os
import re
import sys
import sysconfig
import threading
import zlib
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from nanoparcae.command import (EnvironmentFailure, checked, command_parser, first_sentence, positive, run_command,
                                size)
from nanoparcae.download import FINEWEB_URL, PAPER_TOKENS, download_shards
from nanoparcae.files import check_writable, get_base_dir

VAL_EVERY = 20  # a stdlib or user document is validation iff crc32(text) % 20 == 0 (~5%)
FILES_PER_CHUNK = 64  # text files are read (and shared across ranks) in groups of this many
FINEWEB_VAL_SHARD = 1822  # shards 0..1822, the last one held out, as nanochat does (METHOD.md §5)
# A shard holds about 50M tokens, and best-fit packing crops about 35% of them at 2,048 a row
# (nanochat/dataloader.py's docstring). So a download is sized before any shard is there to measure.
SHARD_TOKENS = 32.5e6

# -----------------------------------------------------------------------------
# Data sources. A split is a list of chunks (a parquet row group, or a group of text files).

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
    found = walk(path) if path.is_dir() else glob.glob(str(path), recursive=True)
    files = sorted(f for f in found if Path(f).suffix in (".txt", ".jsonl", ".parquet", ".py") and Path(f).is_file())
    if not files:
        raise FileNotFoundError(f"no .txt, .jsonl, .parquet or .py files match '{pattern}': pass --data=stdlib, "
                                f"--data=fineweb-edu, or a path, folder or glob of your own files")
    return files


def walk(folder):
    """List the files under `folder` but hidden ones, as glob's "**/*" does, naming a subfolder glob cannot read."""
    def refuse(err):
        if isinstance(err, PermissionError):
            raise EnvironmentFailure(f"{err.filename} cannot be read ({err.strerror}), so --data={folder} would "
                                     f"train without it; make it readable or move it out, then run again")
    found = []
    for parent, folders, files in os.walk(folder, onerror=refuse, followlinks=True):
        folders[:] = [name for name in folders if not name.startswith(".")]
        found += [os.path.join(parent, name) for name in files if not name.startswith(".")]
    return found


def data_key(source):
    """Name a data source's content, so the same files give the same key, whatever the base folder."""
    if source == "fineweb-edu":
        return source
    if source == "stdlib":  # another Python version has another standard library; where it lives does not count
        return f"stdlib-py{sys.version_info.major}{sys.version_info.minor}"
    # the key holds the files' sizes and modification times, so a changed corpus trains a new tokenizer
    files = [(str(Path(p).resolve()), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in user_files(source)]
    return "files-" + hashlib.sha1(json.dumps(files).encode()).hexdigest()[:10]


def fineweb_dir(make=False):
    """Return the shards' folder, made (and checked writable) only for a download, so a read-only cache serves reads."""
    path = get_base_dir() / "fineweb-edu"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file where the FineWeb-Edu shards' folder belongs: move or remove it, then "
                         f"download the shards again")
    if make:
        check_writable(path, "the FineWeb-Edu shards")
        path.mkdir(parents=True, exist_ok=True)
    return path


def shard_name(index):
    return f"shard_{index:05d}.parquet"


def fineweb_train_shards(download="-n N"):
    """List the FineWeb-Edu training shards on disk; without the validation shard or a training one, name the
    download with `download`'s flags."""
    folder = fineweb_dir()
    found = [i for i in range(FINEWEB_VAL_SHARD + 1) if (folder / shard_name(i)).is_file()]
    train = [i for i in found if i != FINEWEB_VAL_SHARD]
    missing = [what for what, there in ((f"the validation shard {shard_name(FINEWEB_VAL_SHARD)}",
                                         FINEWEB_VAL_SHARD in found), ("any training shard", train)) if not there]
    if missing:
        raise FileNotFoundError(f"{folder} lacks {' and '.join(missing)} ({len(found)} shards there): run `python -m "
                                f"nanoparcae.dataset download {download}` first; without a GPU, `bash runs/cpu.sh` "
                                f"trains a small model on this Python's standard library, no download needed")
    return train


def list_chunks(source, split):
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got '{split}'")
    if source == "fineweb-edu":
        train = fineweb_train_shards()  # both splits need the validation shard there
        paths = [str(fineweb_dir() / shard_name(i)) for i in (train if split == "train" else [FINEWEB_VAL_SHARD])]
    else:
        paths = stdlib_files() if source == "stdlib" else user_files(source)
    keep = None if source == "fineweb-edu" else split
    texts = [p for p in paths if not p.endswith(".parquet")]  # read FILES_PER_CHUNK at a time
    chunks = [Chunk(tuple(texts[i:i + FILES_PER_CHUNK]), -1, keep, source == "stdlib")
              for i in range(0, len(texts), FILES_PER_CHUNK)]
    return chunks + [Chunk((p,), group, keep) for p in paths if p.endswith(".parquet")
                     for group in range(parquet_metadata(p).num_row_groups)]

# -----------------------------------------------------------------------------
# A chunk's documents, each failure naming its file

@contextlib.contextmanager
def reading(path, where=""):
    """Name the data file `path` (and `where` in it, a row group) in what a failed read raises, with the fix."""
    try:
        yield
    except PermissionError as err:
        raise EnvironmentFailure(f"{path} cannot be read ({err.strerror}): make it readable, then run the same "
                                 f"command again") from None
    except (OSError, pa.ArrowException) as err:  # ArrowInvalid is a ValueError too
        cause = "it is empty (0 bytes)" if os.path.isfile(path) and os.path.getsize(path) == 0 else \
            first_sentence(err)
        raise ValueError(f"{path}{where} cannot be read ({cause}); remove it, then download or copy it "
                         f"again") from None


def parquet_metadata(path):
    with reading(path):
        metadata = pq.read_metadata(path)
        schema = metadata.schema.to_arrow_schema()
    if "text" not in schema.names:
        raise ValueError(f"{path} has no 'text' column (columns: {schema.names}); rename the column to 'text'")
    if not pa.types.is_string(kind := schema.field("text").type) and not pa.types.is_large_string(kind):
        raise ValueError(f"{path}: its 'text' column holds {kind}, not strings; write the text as strings, or "
                         f"remove the file")
    return metadata


def parquet_texts(path, row_group):
    where = f" (row group {row_group})"
    with reading(path, where):
        column = pq.ParquetFile(path).read_row_group(row_group, columns=["text"]).column("text")
    if column.null_count:
        raise ValueError(f"{path}{where} holds {column.null_count:,} null text(s); remove those rows, or the file")
    return column.to_pylist()


def read_text_file(path, reported=None):
    """Return a text file's documents without its bytes that are not UTF-8, each file named once in `reported`.
    With reported None it checks nothing (stdlib's files in other encodings)."""
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
    # A .py file gives a document per block (after a blank line, indented at most 4 spaces), because whole
    # stdlib files (median ~2k tokens) would lose most tokens to cropping at 256-token rows.
    return re.split(r"\n\s*\n(?=(?: {4})?\S)", text)


def jsonl_text(path, number, line):
    try:
        text = json.loads(line)["text"]
    except (ValueError, KeyError, TypeError) as e:
        text = e
    if not isinstance(text, str):
        raise ValueError(f"{path}, line {number}: every line must be a JSON object with a 'text' field that is a "
                         f"string ({text!r}); fix the line, or remove the file")
    return text


class ChunkReader:
    """Reads chunks for the loaders that share it (one per micro-batch), each chunk once for all of them.
    A chunk is kept until all its `sharers` loaders have taken it. At most max_kept chunks are kept,
    the oldest going first, because loaders drift apart and a resumed loader never takes a chunk it is past."""
    max_kept = 64

    def __init__(self):
        self.kept, self.lock = {}, threading.Lock()  # (chunk, epoch) -> [documents, loaders still to take it]
        self.reads = self.chars_read = 0  # chunks read from disk and their characters
        self.reported = set()  # the files already named for bytes that are not UTF-8

    def read(self, chunk):
        """Return the chunk's documents of its split by their hash, keeping none; a .py file's blocks share names,
        so they go together."""
        if chunk.row_group >= 0:
            units = [[doc] for doc in parquet_texts(chunk.paths[0], chunk.row_group)]
        else:
            units = []
            for path in chunk.paths:
                docs = read_text_file(path, None if chunk.quiet else self.reported)
                units += [docs] if path.endswith(".py") else [[doc] for doc in docs]
        keep = [unit for unit in units if chunk.keep is None or is_val_document("".join(unit)) == (chunk.keep == "val")]
        return [doc for unit in keep for doc in unit if doc and not doc.isspace()]

    def documents(self, chunk, epoch, sharers):
        """Return the chunk's documents (copy before changing them) for one of the `sharers` loaders."""
        with self.lock:  # the loaders' prefetch threads ask at once; the first one reads
            key = (chunk, epoch)
            if key not in self.kept:
                docs = self.read(chunk)
                self.kept[key] = [docs, sharers]
                if len(self.kept) > self.max_kept:
                    del self.kept[next(iter(self.kept))]
                self.reads, self.chars_read = self.reads + 1, self.chars_read + sum(map(len, docs))
            entry = self.kept[key]
            entry[1] -= 1
            if entry[1] <= 0:
                del self.kept[key]
            return entry[0]


def iter_documents(source, split, reader=None):
    """Yield every document of a split in a fixed order, the tokenizer's."""
    reader = reader or ChunkReader()
    for chunk in list_chunks(source, split):
        yield from reader.read(chunk)

# -----------------------------------------------------------------------------
# What a run needs of its data, checked before it starts

def check_split(source, split, reader=None):
    """Refuse a split without documents, naming whether the source holds no text or too few documents."""
    if next(iter_documents(source, split, reader), None) is not None:
        return
    if not (count := sum(1 for name in ("train", "val") for _ in iter_documents(source, name))):
        raise ValueError(f"{source} holds no text (empty or blank files): put documents in it, a blank "
                         f"line between two in a .txt file")
    raise ValueError(f"the {split} split of {source} has no documents: a document goes to validation by a hash of its "
                     f"text (about 1 in {VAL_EVERY}) and {source} holds only {count}; split the text "
                     f"into more documents (a blank line between two in a .txt file) or pass several files")


def train_shards_needed(tokens):  # at most all 1,822
    return min(math.ceil(tokens / SHARD_TOKENS), FINEWEB_VAL_SHARD)


def check_horizon(source, tokens):
    """Refuse a FineWeb-Edu run that needs more training shards than are on disk, by the download's own estimate,
    and return those shards. Other sources repeat as often as the run needs, so they return None."""
    if source != "fineweb-edu":
        return None
    shards = fineweb_train_shards(download := f"--tokens={math.ceil(tokens)}")
    if len(shards) < (needed := train_shards_needed(tokens)):
        raise ValueError(f"a run of {size(tokens, '')} tokens reads about {needed} FineWeb-Edu training shards (about "
                         f"{SHARD_TOKENS / 1e6:.1f}M tokens each), and {len(shards)} are on disk; run `python -m "
                         f"nanoparcae.dataset download {download}` first, or give a smaller --max_tokens")
    return shards

# -----------------------------------------------------------------------------
# Command line

def shards_for(num_shards=None, depth=None, tokens=None):
    """List the shards a download fetches, the validation shard among them: num_shards (default 8) in all, or as
    many as `tokens` need, or as many as the paper's horizon at `depth` needs."""
    if num_shards or depth is None and tokens is None:
        return [*range((num_shards or 8) - 1), FINEWEB_VAL_SHARD]
    if (tokens := tokens or PAPER_TOKENS.get(depth)) is None:
        raise ValueError(f"--depth={depth} has no paper horizon (depths {', '.join(map(str, PAPER_TOKENS))}); "
                         f"pass --tokens or -n")
    num_train, reads = train_shards_needed(tokens), tokens / (FINEWEB_VAL_SHARD * SHARD_TOKENS)
    print(f"{tokens / 1e9:.1f}B tokens at about {SHARD_TOKENS / 1e6:.1f}M a shard (50M less the ~35% that packing "
          f"crops): {num_train} training shards" + (f", all there are, read {reads:.2f} times" if reads > 1 else ""))
    return [*range(num_train), FINEWEB_VAL_SHARD]


def main(argv=None):
    parser = command_parser(__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("download", allow_abbrev=False,
                            help=f"FineWeb-Edu shards: N-1 for training, shard {FINEWEB_VAL_SHARD} for val")
    p.add_argument("-n", "--num_shards", default=None, help="shards in all, validation included (default 8)",
                   type=checked(int, f"from 2 to {FINEWEB_VAL_SHARD + 1} (a training shard and the validation shard "
                                     f"at least)", lambda n: 2 <= n <= FINEWEB_VAL_SHARD + 1))
    p.add_argument("--depth", type=positive(int), default=None, help="as many as train.py --depth=D reads")
    p.add_argument("--tokens", type=positive(float), default=None, help="as many as a run of this many tokens reads")
    p.add_argument("-w", "--workers", type=positive(int), default=4, help="parallel downloads (default 4)")
    p.add_argument("--base_url", default=FINEWEB_URL, help="where the shard_XXXXX.parquet files live")
    args = parser.parse_args(argv)
    sizes = (("-n", args.num_shards), ("--depth", args.depth), ("--tokens", args.tokens))
    if len(sized := [flag for flag, value in sizes if value is not None]) > 1:
        raise ValueError(f"pass one of -n, --depth and --tokens, not {' and '.join(sized)}")
    print(f"Base directory: {get_base_dir()}")
    names = [shard_name(i) for i in shards_for(args.num_shards, args.depth, args.tokens)]
    download_shards(names, fineweb_dir(make=True), args.base_url, args.workers)


if __name__ == "__main__":
    run_command(main)
