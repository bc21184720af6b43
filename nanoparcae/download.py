"""
nanoparcae/download.py: one streamed, resumable, retried HTTP download.
Every download uses it: the FineWeb-Edu shards, the eval bundle, the authors' release.

    download_file(url, path)    # path appears only once every byte is there
"""

import os
import time
from pathlib import Path

import requests


def download_file(url, path, max_attempts=5, retry_delay=1.0, timeout=60):
    """Stream url into <path>.part, renamed to path once complete.
    So a broken download never has the final name.

    - A .part left by an earlier try resumes with a Range header.
      206: append. 200: the server ignored Range, start over. 416: it already holds every byte.
    - Connection errors and 5xx retry with exponential backoff; 4xx are final.
    - Raises FileNotFoundError for a 404, OSError for any other failure.
      Each message is one line naming the url; callers add the fix.
    """
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
                if status == 404:
                    raise FileNotFoundError(f"{url} answered HTTP 404 (no such file)")
                if 400 <= status < 500:  # permanent: retrying will not help
                    raise OSError(f"{url} answered HTTP {status}")
                response.raise_for_status()
                resumable = status == 206 or response.headers.get("Accept-Ranges") == "bytes"
                with open(part, "ab" if status == 206 else "wb") as f:
                    for block in response.iter_content(chunk_size=1 << 20):
                        f.write(block)
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
