"""
nanoparcae/download.py: files fetched over HTTP (FineWeb-Edu's shards, CORE's eval bundle, the authors' release),
each streamed, resumed and retried, and the paper's horizons that size a FineWeb-Edu download.

    download_file(url, path)                      # path appears only once every byte is there
    bundle_dir, why = shared_eval_bundle()        # the bundle on every rank, or why no rank has it
"""

import os
import shutil
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import pyarrow.parquet as pq
import requests

from nanoparcae.command import EnvironmentFailure
from nanoparcae.files import get_base_dir
from nanoparcae.ranks import local_rank, rank_and_world, wait_for_rank0, gather

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"  # METHOD.md §5
FINEWEB_URL = "https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main"
BASE_URL = "--base_url (runs/speedrun.sh: FINEWEB_URL)"  # the mirror's flag, and the recipe's variable
PAPER_TOKENS = {6: 11.2e9, 12: 29.6e9, 18: 61.6e9, 24: 104e9}  # METHOD.md §1: tokens per depth


def download_file(url, path, max_attempts=5, retry_delay=1.0, timeout=60):
    """Stream url into <path>.part, renamed to path once complete, so a broken download never has the final name.
    A .part left by an earlier try resumes (206 appends, 200 starts over, 416 means complete). Connection errors
    and 5xx retry with exponential backoff. A 404 raises FileNotFoundError, any other failure OSError."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    resumable = False  # does the server honour Range? Only then is a partial file worth keeping
    for attempt in range(1, max_attempts + 1):
        have = part.stat().st_size if part.exists() else 0
        try:
            with requests.get(url, headers={"Range": f"bytes={have}-"} if have else {}, stream=True,
                              timeout=timeout) as response:
                status = response.status_code
                if status == 416:
                    total = response.headers.get("Content-Range", f"bytes */{have}").rpartition("/")[2]
                    if total == str(have):  # the part file already holds every byte
                        break
                    part.unlink()
                    raise requests.HTTPError(f"HTTP 416: the partial file is no prefix of the {total} bytes served")
                if 400 <= status < 500:  # permanent, so retrying will not help; a 404 is the url's fault
                    raise (FileNotFoundError if status == 404 else OSError)(f"{url} answered HTTP {status}")
                response.raise_for_status()
                resumable = status == 206 or response.headers.get("Accept-Ranges") == "bytes"
                with open(part, "ab" if status == 206 else "wb") as f:
                    f.writelines(response.iter_content(chunk_size=1 << 20))
            break
        except requests.RequestException as e:
            reason = str(e).split(" for url:")[0] if isinstance(e, requests.HTTPError) else type(e).__name__
            if attempt == max_attempts:
                if not resumable:
                    part.unlink(missing_ok=True)
                raise OSError(f"could not download {url} after {max_attempts} attempts ({reason})") from None
            delay = retry_delay * 2 ** (attempt - 1)
            print(f"{path.name}: attempt {attempt}/{max_attempts} failed ({reason}), retrying in {delay:.1f}s")
            time.sleep(delay)
    os.replace(part, path)
    return path


def fetch(url, path, flag, fix="", **retries):
    """download_file, whose 404 is the url's (FileNotFoundError) and any other failure the network's."""
    try:
        download_file(url, path, **retries)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{err}; check {flag}{fix}") from None
    except OSError as err:  # retried already
        raise EnvironmentFailure(f"{err}; check the network or {flag}{fix}") from None

# -----------------------------------------------------------------------------
# FineWeb-Edu's shards. Each is fetched, checked as parquet, then given its final name.

def download_shard(path, base_url=FINEWEB_URL, **retries):
    """Fetch one shard to `path`; return whether it was fetched now (False when it was there)."""
    if path.exists():  # only complete, checked shards ever get the final name
        return False
    url = f"{base_url.rstrip('/')}/{path.name}"
    unchecked = path.with_name(path.name + ".tmp")  # the parquet check comes before the final name
    fetch(url, unchecked, BASE_URL, ", which serves shards 0 to 1822", **retries)
    try:
        columns = pq.read_metadata(unchecked).schema.names
        bad = None if "text" in columns else f"has no 'text' column (columns: {columns}); deleted it, check {BASE_URL}"
    except Exception as e:
        bad = f"is not a valid parquet file ({e}); deleted it, check {BASE_URL} and download again"
    if bad:
        unchecked.unlink()
        raise ValueError(f"{url} {bad}")
    unchecked.rename(path)
    return True


def download_shards(names, folder, base_url=FINEWEB_URL, num_workers=4, **retries):
    """Fetch the shards named into `folder` and return their paths, printing a line per shard with the time left."""
    print(f"Downloading {len(names)} shards from {base_url} to {folder} with {num_workers} workers")
    paths, start, fetched = [Path(folder) / name for name in names], time.time(), 0
    with ThreadPoolExecutor(num_workers) as pool:
        shards = {pool.submit(download_shard, path, base_url, **retries): path for path in paths}
        for done, shard in enumerate(as_completed(shards), 1):
            fetched += (new := shard.result())
            left = (time.time() - start) / fetched * (len(names) - done) if fetched else 0
            print(f"{'Downloaded' if new else 'Skipping'} {shards[shard].name}{'' if new else ' (already there)'} "
                  f"[{done}/{len(names)}, about {left / 60:.0f} min left]", flush=True)
    return paths

# -----------------------------------------------------------------------------
# CORE's eval bundle, downloaded once and extracted only where it belongs

def extract_zip_safely(zip_path, target):
    """Extract every member under target, refusing the whole archive first if one would land outside ("../x")."""
    target = Path(target).resolve()
    with zipfile.ZipFile(zip_path) as archive:
        for name in archive.namelist():
            if not (target / name).resolve().is_relative_to(target):
                raise ValueError(f"{zip_path} holds a member {name!r} that would land outside {target}; "
                                 f"refusing to extract it (delete the file and check --bundle_url)")
        archive.extractall(target)


def eval_bundle_dir():
    """Return the base folder's eval_bundle if a bundle is extracted there, else None."""
    bundle_dir = get_base_dir() / "eval_bundle"
    return bundle_dir if (bundle_dir / "eval_meta_data.csv").is_file() else None


def download_eval_bundle(url=EVAL_BUNDLE_URL):
    """Return the base folder's eval_bundle, downloaded and extracted on first use."""
    if bundle_dir := eval_bundle_dir():
        return bundle_dir
    (base_dir := get_base_dir()).mkdir(parents=True, exist_ok=True)
    bundle_dir, zip_path = base_dir / "eval_bundle", base_dir / "eval_bundle.zip"
    if not zip_path.is_file():
        print(f"Downloading the eval bundle from {url} ...")
        fetch(url, zip_path, "--bundle_url", f", or download it by hand and unzip it in {base_dir}")
    scratch = base_dir / f"eval_bundle.{os.getpid()}.tmp"
    try:
        extract_zip_safely(zip_path, scratch)
        extracted = scratch / "eval_bundle"  # one top-level folder eval_bundle/ (METHOD.md §5)
        if not (extracted / "eval_meta_data.csv").is_file():
            raise ValueError(f"{url} is not an eval bundle (no eval_bundle/eval_meta_data.csv inside); "
                             f"check --bundle_url")
        extracted.rename(bundle_dir)
    except (ValueError, zipfile.BadZipFile) as err:
        zip_path.unlink(missing_ok=True)  # a bad archive would otherwise be reused on every later run
        raise ValueError(str(err) if isinstance(err, ValueError) else f"{url} is not a zip file ({err})") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    zip_path.unlink()
    return bundle_dir


def shared_eval_bundle(url=EVAL_BUNDLE_URL):
    """Return (the bundle's folder, None) on every rank, or (None, why) on every rank if any lacks it, since a
    rank without the tasks would never join CORE's per-task all_reduce. Rank 0 fetches first, then each other
    node's local rank 0 (which finds it on a shared filesystem)."""
    rank, why = rank_and_world()[0], None
    for fetching in (rank == 0, local_rank() == 0 and rank != 0):
        if fetching:
            try:
                download_eval_bundle(url)
            except (OSError, ValueError, EnvironmentFailure) as err:
                why = f"the eval bundle is not available ({err})"
        wait_for_rank0()  # a download with its retries outlasts a collective's timeout
    bundle_dir = eval_bundle_dir()
    if all(gather(bundle_dir is not None)):
        return bundle_dir, None
    return None, why or "a node has no eval bundle (its local rank 0 could not fetch it), so no rank runs CORE"
