"""What the tests share: every test gets its own empty base directory (no test reads or writes
~/.cache/nanoparcae); TINY, the flags of a train.py run that takes seconds on a CPU; the tiny corpus it trains on;
train.py run as users run it, in a subprocess; what a message must carry (its flags, values and paths, not its
sentence); a run folder's files, to show a command left them as they were; and a local HTTP server over a folder."""

import functools
import http.server
import os
import random
import re
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--depth=3", "--d_model=64", "--head_dim=32", "--mu_rec=3", "--vocab_size=320", "--seq_len=32",
        "--device_batch_size=4", "--total_batch_size=256", "--max_tokens=2048", "--eval_every=1000",
        "--eval_tokens=256", "--save_every=1000", "--log_every=1", "--core_every=-1", "--dtype=float32", "--compile=0"]


@pytest.fixture(autouse=True)
def private_base_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(tmp_path / "nanoparcae_base"))


def write_corpus(path):
    """A small text corpus at `path`: 400 paragraphs (each a document) of 20 words drawn at seed 0."""
    rng = random.Random(0)
    words = ["loop", "state", "depth", "token", "model", "stable", "radius", "prelude", "coda", "sample", "the",
             "a", "of", "is", "and", "runs", "learns", "every", "step", "with"]
    paragraphs = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 80))) + "." for _ in range(400)]
    path.write_text("\n\n".join(paragraphs))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder holding corpus.txt (write_corpus) and, under base/, the base dir shared by the module's runs."""
    root = tmp_path_factory.mktemp("train")
    write_corpus(root / "corpus.txt")
    return root


def train_command(corpus, *flags, nproc=1, torchrun=None, fault=None):
    """Plain python for one process without torchrun flags; torchrun otherwise (standalone unless `torchrun`
    gives the launcher's rendezvous flags, as the two-node test does for one process per node). fault: run
    tests/faulty_train.py with that fault in place of train.py."""
    launcher = [sys.executable] if nproc == 1 and torchrun is None else \
        [sys.executable, "-m", "torch.distributed.run", *(torchrun or ["--standalone"]), f"--nproc_per_node={nproc}",
         "--"]
    script = [str(ROOT / "tests" / "faulty_train.py"), fault] if fault else [str(ROOT / "train.py")]
    return launcher + script + [f"--data={corpus / 'corpus.txt'}", *TINY, *flags]


def train_env(corpus, base=None, **extra):
    return {**os.environ, "NANOPARCAE_BASE_DIR": str(base or corpus / "base"), "OMP_NUM_THREADS": "1", **extra}


def train(corpus, *flags, nproc=1, torchrun=None, env=None, expect_ok=True, fault=None, base=None):
    """train.py on the tiny corpus with TINY and `flags` -> the finished subprocess (status 0 asserted unless
    expect_ok=False)."""
    result = subprocess.run(train_command(corpus, *flags, nproc=nproc, torchrun=torchrun, fault=fault),
                            capture_output=True, text=True, env=train_env(corpus, base, **(env or {})), timeout=300)
    if expect_ok:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def refused(result):
    """The one line of a refused command, after checking that it is one line with status 2."""
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result.stderr


def carries(message, *words):
    """Whether message names each of words (a flag, a value, a path) as a word of its own, in this order: a flag
    before its values, old before new. The words a test asks for, not the sentence around them, so that rewording
    a message fails no test."""
    position = 0
    for word in words:
        found = re.compile(r"(?<![\w.])" + re.escape(word) + r"(?![\w-]|\.\w)").search(message, position)
        if found is None:
            return False
        position = found.end()
    return True


def untouched(run_dir):
    """{file name: (bytes, mtime)} of a run folder, to show that a refused command wrote nothing there."""
    return {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in sorted(run_dir.iterdir())}


@pytest.fixture
def server(tmp_path):
    """A local HTTP server over tmp_path/www (root), at url, with the path of every GET it answered (requests)."""
    root = tmp_path / "www"
    root.mkdir()
    requests_seen = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            requests_seen.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield SimpleNamespace(root=root, url=f"http://127.0.0.1:{httpd.server_address[1]}", requests=requests_seen)
    httpd.shutdown()
    httpd.server_close()
