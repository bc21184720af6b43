"""
nanoparcae/fineweb.py: FineWeb-Edu's shards, fetched and counted (METHOD.md §5).
They are the 100b-shuffle parquet shards nanochat uses, kept under $NANOPARCAE_BASE_DIR/fineweb-edu.
Shard 1822, the last, is the validation split, and every other shard there trains.

    download_shards(shards_for(tokens=2.9e9))    # what a run of 2.9B tokens reads, and the validation shard
    fineweb_train_shards()                       # the training shards on disk
"""

import math
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import pyarrow.parquet as pq

from model import PAPER_TOKENS
from nanoparcae.command import EnvironmentFailure
from nanoparcae.files import check_writable, get_base_dir
from nanoparcae.download import download_file

FINEWEB_URL = "https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main"
# The mirror's setting, named as download's flag and as the recipe's variable
BASE_URL = "--base_url (runs/speedrun.sh: FINEWEB_URL)"
FINEWEB_VAL_SHARD = 1822  # shards 0..1822, the last one held out, as nanochat does (METHOD.md §5)
FINEWEB_SHARD_TOKENS = 50e6  # about 250M characters a shard, which sizes a download before any is read
# Best-fit packing crops about 35% of FineWeb-Edu's tokens at 2,048 a row (nanochat/dataloader.py's docstring).
# A download is sized by it before any shard is there to measure; a run measures its own (data.packing).
PACKING_CROP = 0.35


def fineweb_dir(make=False):
    """The shards' folder, made if `make` (a download); a read makes nothing, so a read-only cache serves.
    A file in its place raises ValueError naming it, and a folder a download cannot write EnvironmentFailure."""
    path = get_base_dir() / "fineweb-edu"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file where the FineWeb-Edu shards' folder belongs: move or remove it, then "
                         f"download the shards again")
    if make:
        check_writable(path, "the FineWeb-Edu shards")
        path.mkdir(parents=True, exist_ok=True)
    return path


def shard_name(index):
    """Name shard `index`'s file; the one place that spells it."""
    return f"shard_{index:05d}.parquet"

# -----------------------------------------------------------------------------
# The download. Each shard is fetched, checked as parquet, then given its final name.


def download_shard(index, base_url=FINEWEB_URL, max_attempts=5, retry_delay=1.0):
    """Fetch one shard; return its path and whether it was fetched now (False when it was there).
    A 404 raises FileNotFoundError, a failed fetch EnvironmentFailure, a file that is no shard ValueError."""
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
    except OSError as e:  # retried already, so the network failed
        raise EnvironmentFailure(f"{e}; check the network or {BASE_URL}") from None
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
    """Fetch the shards and return their paths.
    A line per shard says how many are done and, from those fetched, the time left."""
    print(f"Downloading {len(indices)} shards from {base_url} to {fineweb_dir(make=True)} with {num_workers} workers")
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


def shards_for(num_shards=None, depth=None, tokens=None):
    """List the shards a download fetches, the validation shard always among them.

    - num_shards: that many in all.
    - tokens: as many as it needs, at about FINEWEB_SHARD_TOKENS a shard less PACKING_CROP.
    - depth: as many as the paper's horizon at that depth needs, the same way.

    Training shards are capped at the 1,822 there are."""
    tokens = None if num_shards else tokens or PAPER_TOKENS.get(depth)
    if tokens is None and depth is not None:
        raise ValueError(f"--depth={depth} has no paper horizon (depths {', '.join(map(str, PAPER_TOKENS))}); "
                         f"pass --tokens or -n")
    per_shard = FINEWEB_SHARD_TOKENS * (1 - PACKING_CROP)  # the tokens a run trains on, of a shard's
    num_train = num_shards - 1 if tokens is None else math.ceil(tokens / per_shard)
    if tokens is not None:
        print(f"{tokens / 1e9:.1f}B tokens at about {per_shard / 1e6:.1f}M a shard ({FINEWEB_SHARD_TOKENS / 1e6:.0f}M "
              f"less the ~{PACKING_CROP:.0%} packing crops): {min(num_train, FINEWEB_VAL_SHARD)} training shards"
              + (f", all there are: the run reads them {tokens / (FINEWEB_VAL_SHARD * per_shard):.2f} times"
                 if num_train > FINEWEB_VAL_SHARD else ""))
    return list(range(min(num_train, FINEWEB_VAL_SHARD))) + [FINEWEB_VAL_SHARD]

# -----------------------------------------------------------------------------
# The shards on disk


def fineweb_train_shards(download=None):
    """List the indices of the FineWeb-Edu training shards on disk.
    A missing validation shard, or no training shard, raises FileNotFoundError naming the download.
    `download` names the flags that size a run's own download ("--depth=12"); None names -n."""
    folder = fineweb_dir()
    found = [i for i in range(FINEWEB_VAL_SHARD + 1) if (folder / shard_name(i)).is_file()]
    train = [i for i in found if i != FINEWEB_VAL_SHARD]
    missing = [what for what, there in ((f"the validation shard {shard_name(FINEWEB_VAL_SHARD)}",
                                         FINEWEB_VAL_SHARD in found), ("any training shard", train)) if not there]
    if not missing:
        return train
    fetch = ("run `python -m nanoparcae.dataset download -n N`, which fetches shards 0..N-2 and the validation "
             "shard" if download is None else
             f"`python -m nanoparcae.dataset download {download}` fetches what this run reads; without a GPU, "
             f"`bash runs/cpu.sh` trains a small model on this Python's standard library, no download needed")
    raise FileNotFoundError(f"{folder} lacks {' and '.join(missing)} ({len(found)} shards there): {fetch}")
