"""Tests for data.py and the package's text (nanoparcae/dataset.py, nanoparcae/tokenizer.py and
nanoparcae/download.py): the tokenizer, shard downloads against a local
server, the data sources and the loader (METHOD.md §2).

Run: python -m pytest -q tests/test_data.py   (no network beyond 127.0.0.1, nothing written outside tmp_path)
"""

import errno
import glob
import http.server
import json
import os
import random
import re
import runpy
import shutil
import sys
import sysconfig
import tempfile
import threading
import types
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken.load
import torch

from conftest import carries, python, raises_naming, refused, run_here
import data
from nanoparcae import dataset
from nanoparcae import tokenizer as tokenizers
from nanoparcae.command import EnvironmentFailure, spans
from nanoparcae.download import download_file, download_shards
from nanoparcae.tokenizer import SPECIAL_TOKENS, Tokenizer, get_tokenizer, tokenizer_dir

REPO = Path(__file__).resolve().parent.parent
WORDS = ["the", "loop", "stable", "model", "données", "naïve", "日本", "語", "🎉", "def", "return", "x = 1;",
         "1234", "  ", "\t", "Ünïcödé", "Привет", "مرحبا", "\n", "spectral radius", "(a, b)"]


def make_documents(n, seed=0, max_words=120):
    rng = random.Random(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, max_words))) for i in range(n)]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Every test gets its own base dir, and local requests never go through a proxy."""
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(iter(make_documents(400)), vocab_size=400)


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def write_parquet(path, texts, row_group_size=None):
    path.parent.mkdir(parents=True, exist_ok=True)  # a read makes no folder, FineWeb-Edu's included
    pq.write_table(pa.table({"text": texts}), path, row_group_size=row_group_size)
    return path

# -----------------------------------------------------------------------------
# Tokenizer

WEIRD_STRINGS = [
    "", "hello world", "naïve café", "日本語のテキストです。", "emoji 🎉👩‍👩‍👧 and flags 🇫🇷🇯🇵",
    "\x00\x01\x7f\t\r\n\x0b\x0c",
    "".join(chr(i) for i in range(256)), "  leading and trailing  ", "ab" * 500, "1234567890" * 7, "\u200b\ufeff\ufffd",
    "<|bos|> written in text <|eos|><|pad|>", "Привет, мир! مرحبا بالعالم", "\U0010ffff\U0001f600",
]


def random_unicode(rng, length):
    # any code point but the surrogates, which a valid str cannot encode to UTF-8
    points = [rng.randrange(0x110000 - 0x800) for _ in range(length)]
    return "".join(chr(p + 0x800 if p >= 0xD800 else p) for p in points)


def test_round_trip_unicode_and_bytes(tokenizer):
    rng = random.Random(0)
    texts = WEIRD_STRINGS + [random_unicode(rng, 60) for _ in range(30)]
    for text in texts:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert tokenizer.enc.decode_bytes(ids) == text.encode("utf-8")
    assert tokenizer.encode(texts) == [tokenizer.encode(t) for t in texts]  # the threaded batch path agrees
    # byte-level: every byte value is a token of its own, so no input can fall outside the vocabulary
    single_bytes = {tokenizer.enc.decode_single_token_bytes(i) for i in range(tokenizer.vocab_size - 3)
                    if tokenizer.token_bytes[i] == 1}
    assert single_bytes == {bytes([b]) for b in range(256)}


def test_special_tokens(tokenizer):
    first_special = tokenizer.vocab_size - len(SPECIAL_TOKENS)
    assert tokenizer.vocab_size == 400
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tokenizer.enc.encode_single_token(name) == first_special + i
        assert tokenizer.decode([first_special + i]) == name
    assert tokenizer.bos_id == first_special
    assert tokenizer.encode("hi", prepend_bos=True) == [tokenizer.bos_id] + tokenizer.encode("hi")
    # ordinary text, even the specials' own spelling, never produces a special id
    texts = WEIRD_STRINGS + make_documents(50, seed=1) + ["".join(SPECIAL_TOKENS) * 3]
    assert max(max(ids, default=0) for ids in tokenizer.encode(texts)) < first_special


def test_save_load_identical(tokenizer, tmp_path, monkeypatch):
    tokenizer.save(tmp_path / "tok")
    loaded = Tokenizer.load(tmp_path / "tok")
    texts = WEIRD_STRINGS + make_documents(30, seed=2)
    assert loaded.encode(texts) == tokenizer.encode(texts)
    assert (loaded.vocab_size, loaded.bos_id) == (tokenizer.vocab_size, tokenizer.bos_id)
    assert torch.equal(loaded.token_bytes, tokenizer.token_bytes)
    # plain tiktoken text, which tiktoken's own reader loads (no pickle anywhere)
    lines = (tmp_path / "tok" / "tokenizer.tiktoken").read_text().splitlines()
    assert all(re.fullmatch(r"[A-Za-z0-9+/=]+ \d+", line) for line in lines)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # "" turns tiktoken's cache off
    loaded = tiktoken.load.load_tiktoken_bpe(str(tmp_path / "tok" / "tokenizer.tiktoken"))
    assert loaded == tokenizer.enc._mergeable_ranks


def cut_at_a_line(path):
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:len(lines) // 2]))


@pytest.mark.parametrize("name,cut", [
    ("tokenizer.json", lambda path: path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])),
    ("tokenizer.tiktoken", lambda path: path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2 + 3])),
    ("tokenizer.tiktoken", cut_at_a_line),  # whole lines: tokens missing, no line torn
    ("token_bytes.txt", cut_at_a_line),
])
def test_a_torn_tokenizer_file_is_named_with_the_command_that_recreates_it(tokenizer, tmp_path, name, cut):
    tokenizer.save(tmp_path / "tok")
    cut(tmp_path / "tok" / name)
    with raises_naming(ValueError, str(tmp_path / "tok" / name), "python -m nanoparcae.tokenizer") as torn:
        Tokenizer.load(tmp_path / "tok")
    assert "\n" not in str(torn.value)


def test_a_tokenizer_that_cannot_be_read_is_the_machines_named(tokenizer, tmp_path, monkeypatch):
    """Permission denied on the tokenizer's folder (a user's mode, or a read for root, whom modes do not stop)."""
    folder = tokenizer_dir("stdlib", 400)
    tokenizer.save(folder)
    real = Path.read_bytes

    def read_bytes(path):
        if path.is_relative_to(folder):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with raises_naming(EnvironmentFailure, str(folder), os.strerror(errno.EACCES)):
        get_tokenizer("stdlib", 400)


@pytest.mark.parametrize("command", [["-m", "nanoparcae.tokenizer"], ["train.py"]])
def test_an_unreasonable_vocabulary_is_refused_before_any_work(command, monkeypatch, capsys):
    line = refused(run_here([*command, "--vocab_size=2147483647"], monkeypatch, capsys))
    assert carries(line, "2147483647", "259", "1048576"), line
    assert not dataset.get_base_dir().joinpath("tokenizers").exists()


def test_token_bytes_sum_to_utf8_length(tokenizer):
    assert tokenizer.token_bytes.shape == (tokenizer.vocab_size,)
    assert tokenizer.token_bytes[-len(SPECIAL_TOKENS):].tolist() == [0, 0, 0]
    for text in WEIRD_STRINGS + make_documents(20, seed=3):
        ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
        assert tokenizer.token_bytes[ids].sum().item() == len(text.encode("utf-8"))


def test_train_rejects_tiny_vocab():
    with raises_naming(ValueError, "vocab_size", "100"):
        Tokenizer.train(iter(["abc"]), vocab_size=100)


def test_get_tokenizer_trains_once_then_loads(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", make_documents(200))
    first = get_tokenizer(str(corpus), 300)
    assert "Training" in capsys.readouterr().out
    second = get_tokenizer(str(corpus), 300)
    assert "Training" not in capsys.readouterr().out
    assert second.encode(WEIRD_STRINGS) == first.encode(WEIRD_STRINGS)
    assert tokenizer_dir(str(corpus), 300).is_relative_to(tmp_path / "base")


def test_a_changed_corpus_at_the_same_path_trains_its_own_tokenizer(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"alpha beta {i} alpha beta" for i in range(300)))
    before, before_dir = get_tokenizer(str(corpus), 300), tokenizer_dir(str(corpus), 300)
    corpus.write_text("\n\n".join(f"gamma delta {i} gamma delta" for i in range(300)))
    capsys.readouterr()
    after, after_dir = get_tokenizer(str(corpus), 300), tokenizer_dir(str(corpus), 300)
    assert "Training" in capsys.readouterr().out and after_dir != before_dir
    assert len(after.encode(" gamma delta")) < len(before.encode(" gamma delta"))  # learned from the new text
    assert get_tokenizer(str(corpus), 300).encode(" alpha beta gamma") == after.encode(" alpha beta gamma")


def test_bytes_that_are_not_utf8_are_counted_and_named_once(tmp_path, capsys):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 ol\xe9\n\nna\xefve".encode("latin-1") + "\n\nplain 日本".encode())
    reported = set()  # a ChunkReader's
    assert dataset.read_text_file(str(path), reported) == ["caf ol", "nave", "plain 日本"]
    warned = capsys.readouterr().err
    assert len(warned.splitlines()) == 1 and carries(warned, str(path), "3", "3"), warned  # the count, the first
    dataset.read_text_file(str(path), reported)  # read again (every epoch): said once
    assert capsys.readouterr().err == ""


def test_the_standard_library_is_read_without_warnings_and_a_users_file_with_one(tmp_path, monkeypatch, capsys):
    """The stdlib corpus holds a few files in other encodings (test/encoded_modules): expected, so quiet; the
    same file passed as --data is the user's and gets its warning."""
    path = (tmp_path / "module_koi8_r").with_suffix(".py")  # a name as in the standard library
    path.write_bytes("x = 1\n\n".encode() + "s = 'Привет'\n".encode("koi8_r"))
    monkeypatch.setattr(dataset, "stdlib_files", lambda: [str(path)])
    stdlib = [doc for split in ("train", "val") for doc in dataset.iter_documents("stdlib", split)]
    assert capsys.readouterr().err == ""
    assert [doc for split in ("train", "val") for doc in dataset.iter_documents(str(path), split)] == stdlib
    warned = capsys.readouterr().err
    assert carries(warned, str(path), "6"), warned  # the file, and the bytes left out


def test_the_tokenizer_key_names_the_content_not_the_place(tmp_path, monkeypatch):
    """The key of a tokenizer and its corpus: the same under a moved base folder and, for stdlib, under another
    installation of the same Python version; another file content is another key."""
    key = f"stdlib-py{sys.version_info.major}{sys.version_info.minor}-512"
    assert tokenizer_dir("stdlib", 512) == tmp_path / "base" / "tokenizers" / key
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one\n\ntwo")
    mine = tokenizer_dir(str(corpus), 512).name
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(tmp_path / "moved"))
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path / "reinstalled" / "lib")})
    assert tokenizer_dir("stdlib", 512).name == key and tokenizer_dir(str(corpus), 512).name == mine
    corpus.write_text("one\n\ntwo\n\nthree")
    assert tokenizer_dir(str(corpus), 512).name != mine


@pytest.mark.parametrize("copied", ["a 300-token one", "a 300-token one saved by hand", "another corpus's"])
def test_a_cached_tokenizer_other_than_its_folder_names_is_refused_in_one_line(copied, tmp_path):
    """A 300-token tokenizer where the 320-token one belongs, or another corpus's where this corpus's belongs: one
    line naming the folder and what it holds, and its fix (remove the folder) trains the right one. A save without
    the key a cached one records is checked by its size alone."""
    ours, theirs = (write_jsonl(tmp_path / f"{name}.jsonl", make_documents(200, seed=seed))
                    for name, seed in (("ours", 1), ("theirs", 2)))
    asked, trained = (300, theirs) if copied == "another corpus's" else (320, ours)
    folder = tokenizer_dir(str(ours), asked)
    if copied.endswith("by hand"):
        Tokenizer.train(iter(make_documents(200, seed=2)), 300).save(folder)
    else:
        get_tokenizer(str(trained), 300)
        shutil.copytree(tokenizer_dir(str(trained), 300), folder)
    with raises_naming(ValueError, str(folder), "300 tokens", folder.name, "remove") as refused:
        get_tokenizer(str(ours), asked)
    assert "\n" not in str(refused.value) and (copied.endswith("by hand") or str(dataset.data_key(str(trained)))
                                               in str(refused.value)), refused.value
    shutil.rmtree(folder)
    assert get_tokenizer(str(ours), asked).vocab_size == asked


@pytest.mark.parametrize("kept", [["tokenizer.json"], ["tokenizer.tiktoken", "tokenizer.json"]])
def test_a_tokenizer_folder_copied_in_part_names_what_it_lacks_with_a_fix_that_works(kept, tmp_path, monkeypatch,
                                                                                      capsys):
    """An interrupted copy of a cached tokenizer. A run's load, a checkpoint's look for it (Tokenizer.saved) and the
    command that recreates it each end in one line naming the files it lacks. Its fix, the folder removed, then
    that command, recreates it."""
    corpus = write_jsonl(tmp_path / "corpus.jsonl", make_documents(200))
    folder, lacking = tokenizer_dir(str(corpus), 300), [name for name in Tokenizer.FILES if name not in kept]
    get_tokenizer(str(corpus), 300)
    for name in lacking:
        (folder / name).unlink()
    for read in (lambda: get_tokenizer(str(corpus), 300), lambda: Tokenizer.saved(folder)):
        with raises_naming(ValueError, str(folder), *lacking, "remove", "python -m nanoparcae.tokenizer"):
            read()
    command = [f"--data={corpus}", "--vocab_size=300"]
    assert run_cli(monkeypatch, "nanoparcae.tokenizer", *command) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1
    shutil.rmtree(folder)
    assert run_cli(monkeypatch, "nanoparcae.tokenizer", *command) == 0 and Tokenizer.saved(folder)


@pytest.mark.parametrize("spec", [[1, 2], {"model": "BPE"},
                                  {"model": {"type": "BPE", "vocab": ["a"]}, "pre_tokenizer": {"type": "ByteLevel"}}])
def test_a_tokenizer_json_of_another_shape_is_one_line_naming_it(spec, tokenizer, tmp_path):
    """A tokenizer.json that is a list, whose model is a string, or whose vocabulary is a list. Read as a saved
    tokenizer of ours or as the authors' (interop/hub.py), each is one ValueError naming the file."""
    from interop import hub
    tokenizer.save(tmp_path / "tok")
    path = tmp_path / "tok" / "tokenizer.json"
    path.write_text(json.dumps(spec))
    for read in (lambda: Tokenizer.load(tmp_path / "tok"), lambda: hub.tokenizer_from_json(path)):
        with raises_naming(ValueError, str(path)) as refused:
            read()
        assert "\n" not in str(refused.value)


@pytest.mark.parametrize("text,cause", [
    ("", "holds no text (empty or blank files)"),
    (" \n\n\t\n", "holds no text (empty or blank files)"),
    ("one long document with no blank line " * 200, "split of {path} has no documents: a document goes to validation"),
])
def test_a_source_without_documents_for_a_split_names_the_cause(tmp_path, text, cause):
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        tokenizer = get_tokenizer(str(path), 300)
        list(data.val_batches(tokenizer, str(path), batch_size=1, seq_len=8, num_tokens=8))
    message = str(err.value)
    assert cause.format(path=path) in message and "\n" not in message and "batch size" not in message
    assert "blank line between two in a .txt file" in message

# -----------------------------------------------------------------------------
# Downloads, against a server on 127.0.0.1 that this test starts

@pytest.fixture
def server(tmp_path):
    """Serves files from `root`; fails the first `fail_first` requests with 500; `truncate` cuts bodies in half."""
    state = SimpleNamespace(root=tmp_path / "remote", fail_first=0, truncate=False, requests=0)
    state.root.mkdir()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            state.requests += 1
            path = state.root / self.path.lstrip("/")
            if state.requests <= state.fail_first or not path.is_file():
                self.send_error(500 if state.requests <= state.fail_first else 404)
                return
            body = path.read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:len(body) // 2] if state.truncate else body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield state
    httpd.shutdown()
    httpd.server_close()


def shard_texts(index):
    return make_documents(40, seed=100 + index)


def serve_shards(server, indices):
    for i in indices:
        write_parquet(server.root / dataset.shard_name(i), shard_texts(i), row_group_size=16)


def local_files():
    return sorted(p.name for p in dataset.fineweb_dir().iterdir())


def fetch(indices, **kwargs):
    """The shards `indices` downloaded as the download command does, into FineWeb-Edu's folder."""
    return download_shards([dataset.shard_name(i) for i in indices], dataset.fineweb_dir(make=True), **kwargs)


def test_download_and_read_shards(server):
    indices = [0, 1, dataset.FINEWEB_VAL_SHARD]
    serve_shards(server, indices)
    paths = fetch(indices, base_url=server.url, num_workers=2)
    assert local_files() == [dataset.shard_name(i) for i in indices]
    for i, path in zip(indices, paths):
        assert path.read_bytes() == (server.root / dataset.shard_name(i)).read_bytes()
    seen = server.requests
    fetch(indices, base_url=server.url)  # complete shards are skipped
    assert server.requests == seen
    assert list(dataset.iter_documents("fineweb-edu", "val")) == shard_texts(dataset.FINEWEB_VAL_SHARD)
    assert list(dataset.iter_documents("fineweb-edu", "train")) == shard_texts(0) + shard_texts(1)


def write_shards(indices, docs=40):
    for i in indices:
        write_parquet(dataset.fineweb_dir() / dataset.shard_name(i), make_documents(docs, seed=100 + i),
                      row_group_size=16)


def test_the_validation_shard_is_shard_1822_whatever_else_is_on_disk():
    """Shard 1822 is validation by name: a folder without it is refused for either split, naming the download;
    its highest training shard never takes its place."""
    write_shards([0, 1, 7, dataset.FINEWEB_VAL_SHARD])
    assert list(dataset.iter_documents("fineweb-edu", "val")) == make_documents(40, seed=1922)
    assert dataset.fineweb_train_shards() == [0, 1, 7]
    assert list(dataset.iter_documents("fineweb-edu", "train")) == sum(
        (make_documents(40, seed=100 + i) for i in (0, 1, 7)), [])
    (dataset.fineweb_dir() / dataset.shard_name(dataset.FINEWEB_VAL_SHARD)).unlink()
    for split in ("train", "val"):
        with pytest.raises(FileNotFoundError) as refused:
            dataset.list_chunks("fineweb-edu", split)
        assert carries(str(refused.value), str(dataset.fineweb_dir()), "shard_01822.parquet",
                       "python -m nanoparcae.dataset download -n")
    assert spans([0, 1, 2, 5, 7, 8], ",") == "0-2,5,7-8"  # what a run records of its shards


# -----------------------------------------------------------------------------
# A run's horizon against the FineWeb-Edu shards on disk, by the download's own rule

def touch_shards(names, *args, **kwargs):
    """A download that only makes its shards' files, since check_horizon counts them and never reads them."""
    for name in names:
        (dataset.fineweb_dir(make=True) / name).touch()


@pytest.mark.parametrize("tokens", [1, 3 * 32.5e6, 3 * 32.5e6 + 1, 2e10, 1e12])
def test_a_horizon_passes_exactly_where_its_own_download_leaves_enough_shards(tokens, monkeypatch, capsys):
    """Three training shards on disk. A horizon passes when the download for it fetches at most three, else it is
    refused naming that download, after which it passes. Past the 1,822 shards there are, all of them pass."""
    monkeypatch.setattr(dataset, "download_shards", touch_shards)
    touch_shards([dataset.shard_name(i) for i in (0, 1, 2, dataset.FINEWEB_VAL_SHARD)])
    if len(dataset.shards_for(tokens=tokens)) - 1 <= 3:
        assert dataset.check_horizon("fineweb-edu", tokens) == [0, 1, 2]
        return
    with pytest.raises(ValueError) as refused:
        dataset.check_horizon("fineweb-edu", tokens)
    command = re.search(r"`python -m nanoparcae.dataset (download --tokens=\d+)`", str(refused.value))
    assert command and carries(str(refused.value), "3 are on disk", "--max_tokens"), refused.value
    dataset.main(command[1].split())
    assert len(dataset.check_horizon("fineweb-edu", tokens)) == len(dataset.shards_for(tokens=tokens)) - 1


def test_only_fineweb_edu_is_checked_and_its_missing_shards_name_the_runs_download():
    """Other sources repeat as often as a run needs (the loader announces each epoch), so any horizon passes."""
    assert dataset.check_horizon("stdlib", 1e15) is None
    with raises_naming(FileNotFoundError, str(dataset.fineweb_dir()), "download --tokens=1000", "bash runs/cpu.sh"):
        dataset.check_horizon("fineweb-edu", 1000)


@pytest.mark.parametrize("world_size", [1, 3])
def test_four_shards_of_200_documents_train_a_small_run(world_size):
    """A 5,120-token run on four FineWeb-Edu shards of 200 documents, a split smaller than one loader's buffer:
    the horizon passes, and each virtual rank's loader yields its share of the run's rows."""
    write_shards([0, 1, 2, dataset.FINEWEB_VAL_SHARD], docs=200)
    assert dataset.check_horizon("fineweb-edu", 5120) == [0, 1, 2]
    tokenizer, seq_len = get_tokenizer("fineweb-edu", 320), 64
    loaders = [data.DataLoader(tokenizer, "fineweb-edu", "train", 1, seq_len, rank=r, world_size=world_size)
               for r in range(world_size)]
    rows = [next(loader)[0] for _ in range(-(-5120 // (seq_len * world_size))) for loader in loaders]
    assert len(rows) * seq_len >= 5120 and all(row[0, 0] == tokenizer.bos_id for row in rows)
    for loader in loaders:
        loader.close()


@pytest.mark.parametrize("flags,shards", [
    (["-n", "4"], [0, 1, 2]),
    (["--tokens", "1.2e8"], [0, 1, 2, 3]),  # 32.5M tokens a shard: 50M less a 35% crop
    (["--depth", "6"], list(range(345))),  # 11.2B tokens at 50M a shard less a 35% crop
    (["--depth", "24"], list(range(1822))),  # 104B tokens: more than all of them hold
])
def test_a_download_is_sized_by_count_by_tokens_or_by_the_paper_run_at_a_depth(flags, shards, monkeypatch, capsys):
    fetched = []
    monkeypatch.setattr(dataset, "download_shards", lambda names, *args: fetched.extend(names))
    assert dataset.main(["download", *flags]) is None
    assert fetched == [dataset.shard_name(i) for i in shards + [dataset.FINEWEB_VAL_SHARD]]
    if flags[0] == "--depth" and flags[1] == "24":
        assert carries(capsys.readouterr().out, "1.76")


def test_download_retries_server_errors(server):
    serve_shards(server, [0])
    server.fail_first = 2
    fetch([0], base_url=server.url, retry_delay=0.01)
    assert server.requests == 3
    assert local_files() == [dataset.shard_name(0)]


def test_failed_download_leaves_no_partial_file(server):
    serve_shards(server, [0])
    server.truncate = True
    with raises_naming(EnvironmentFailure, "shard_00000.parquet", "2", "--base_url"):
        fetch([0], base_url=server.url, max_attempts=2, retry_delay=0.01)
    assert local_files() == []


def test_corrupt_shard_is_deleted_and_named(server):
    (server.root / dataset.shard_name(0)).write_bytes(b"<html>not parquet</html>" * 10)
    with raises_naming(ValueError, "shard_00000.parquet", "--base_url"):
        fetch([0], base_url=server.url, retry_delay=0.01)
    assert local_files() == []


def test_a_corrupt_shard_is_advised_away_and_the_download_then_fetches_it_whole(server):
    """A download skips a shard that is there, so a corrupt shard's line advises its removal, not a download alone.
    Removed, the same download fetches it whole."""
    serve_shards(server, [0, dataset.FINEWEB_VAL_SHARD])
    fetch([0, dataset.FINEWEB_VAL_SHARD], base_url=server.url)
    shard = corrupt(dataset.fineweb_dir() / dataset.shard_name(0), "footer")
    for _ in range(2):  # before and after a download without the removal
        with raises_naming(ValueError, str(shard), "remove") as refused:
            list(dataset.iter_documents("fineweb-edu", "train"))
        assert "or download it again" not in str(refused.value), refused.value
        fetch([0], base_url=server.url)
    shard.unlink()
    fetch([0], base_url=server.url)
    assert list(dataset.iter_documents("fineweb-edu", "train")) == shard_texts(0)


def test_missing_shard_fails_fast(server):
    with raises_naming(FileNotFoundError, "shard_00007.parquet", "404", "--base_url") as missing:
        fetch([7], base_url=server.url)
    assert server.requests == 1
    assert carries(str(missing.value), "--base_url", "FINEWEB_URL"), missing.value  # the flag, the recipe's


def test_download_file_resumes_with_range(tmp_path):
    """A .part left by an earlier run is resumed, and so is a response cut off mid-way: each try asks only
    for the missing bytes, and the final name appears only once every byte is there."""
    body = random.Random(0).randbytes(3 << 20)  # a few of download_file's 1 MiB blocks
    ranges = []

    class RangeHandler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            start = int(self.headers.get("Range", "bytes=0-").removeprefix("bytes=").rstrip("-"))
            ranges.append(start)
            if start == len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.end_headers()
                return
            self.send_response(206 if start else 200)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(body) - start))
            self.end_headers()
            self.wfile.write(body[start:start + (3 << 19)] if len(ranges) == 1 else body[start:])  # first: cut off

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RangeHandler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/file.bin"
    try:
        path = tmp_path / "file.bin"
        (tmp_path / "file.bin.part").write_bytes(body[:1000])
        assert download_file(url, path, retry_delay=0.01) == path
        assert ranges[0] == 1000 and 1000 < ranges[1] < len(body) and len(ranges) == 2  # what the cut-off try kept
        assert path.read_bytes() == body and not (tmp_path / "file.bin.part").exists()
        # a .part already holding every byte: the server answers 416 and the file is complete as it is
        other = tmp_path / "other.bin"
        (tmp_path / "other.bin.part").write_bytes(body)
        download_file(url, other)
        assert ranges[-1] == len(body) and other.read_bytes() == body
    finally:
        httpd.shutdown()
        httpd.server_close()


# -----------------------------------------------------------------------------
# Data sources

def run_cli(monkeypatch, command, *argv):
    """`python FILE ARGV` or `python -m MODULE ARGV`, run in this process -> its exit status."""
    monkeypatch.setattr(sys, "argv", [command, *argv])
    monkeypatch.delitem(sys.modules, command, raising=False)  # run afresh as __main__, as python -m does
    with pytest.raises(SystemExit) as exit:
        if command.endswith(".py"):
            runpy.run_path(str(REPO / command), run_name="__main__")
        else:
            runpy.run_module(command, run_name="__main__")
    return exit.value.code


def test_the_tokenizer_command_without_shards_fails_before_announcing_training(monkeypatch, capsys):
    assert run_cli(monkeypatch, "nanoparcae.tokenizer", "--data=fineweb-edu") == 2
    out, err = capsys.readouterr()
    assert "Training" not in out and len(err.splitlines()) == 1, err  # the line's words: test_errors.py


@pytest.mark.parametrize("kind", ["read-only mount", "path under a file"])
def test_a_base_folder_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys, kind):
    """A read-only mount refuses the write probe with EROFS whoever runs it, root too: the machine's (status 1), at
    the tokenizer's folder, before training. A path under a file, which the user set, fails at mkdir (status 2)."""
    if kind == "read-only mount":
        base = tmp_path / "mounted"
        base.mkdir()

        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(base))

        monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    else:
        (tmp_path / "a_file").write_text("")
        base = tmp_path / "a_file" / "base"
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(base))
    status = run_cli(monkeypatch, "nanoparcae.tokenizer", "--data=stdlib")
    assert status == (1 if kind == "read-only mount" else 2)
    strerror = os.strerror(errno.EROFS if kind == "read-only mount" else errno.ENOTDIR)
    out, message = capsys.readouterr()
    assert len(message.splitlines()) == 1 and carries(message, str(base), strerror, "NANOPARCAE_BASE_DIR"), message
    assert "Training" not in out and list(base.iterdir() if base.is_dir() else []) == []


def read_only(monkeypatch, base):
    """Make `base` read-only as a read-only mount is, for root too: a folder made or a file probed there fails."""
    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(base))

    real_mkdir = os.mkdir
    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    monkeypatch.setattr(os, "mkdir", lambda path, *args, **kwargs: refuse() if Path(path).is_relative_to(base)
                        else real_mkdir(path, *args, **kwargs))


def test_a_read_only_cache_serves_the_commands_that_only_read(tmp_path, monkeypatch, capsys):
    """A run, its tokenizer and FineWeb-Edu shards in a read-only base folder: sample.py samples, and the tokenizer
    and the validation batches (eval_core's) load, with nothing in it changed."""
    from test_load_run import run_with_tokenizer
    base = dataset.get_base_dir()
    Tokenizer.train(iter(make_documents(50)), vocab_size=260).save(tmp_path / "tok")
    run_with_tokenizer(base, tmp_path / "tok")
    write_shards([0, dataset.FINEWEB_VAL_SHARD])
    tokenizer = get_tokenizer("fineweb-edu", 300)
    before, _ = sorted(base.rglob("*")), capsys.readouterr()
    read_only(monkeypatch, base)
    result = run_here(["sample.py", "--run=tiny", "--prompt=doc", "--max_new_tokens=2"], monkeypatch, capsys)
    assert result.returncode == 0 and result.stdout.startswith("doc"), result.stderr[-3000:]
    assert get_tokenizer("fineweb-edu", 300).encode(WEIRD_STRINGS) == tokenizer.encode(WEIRD_STRINGS)
    assert len(list(data.val_batches(tokenizer, "fineweb-edu", 1, 16, 64))) == 4
    assert sorted(base.rglob("*")) == before


def test_a_flag_is_never_taken_for_a_prefix_of_another(monkeypatch, capsys):
    assert run_cli(monkeypatch, "nanoparcae.tokenizer", "--vocab=300") == 2
    assert carries(capsys.readouterr().err, "--vocab=300")


def test_user_files_txt_jsonl_parquet(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "a.txt").write_text("first paragraph\nstill first\n\n\nsecond paragraph\n  \nthird")
    write_jsonl(folder / "b.jsonl", ["json one", "json two"])
    write_parquet(folder / "c.parquet", ["parquet one", "parquet two", "parquet three"], row_group_size=2)
    docs = list(dataset.iter_documents(str(folder), "train")) + list(dataset.iter_documents(str(folder), "val"))
    assert sorted(docs) == sorted(["first paragraph\nstill first", "second paragraph", "third", "json one",
                                   "json two", "parquet one", "parquet two", "parquet three"])
    assert list(dataset.iter_documents(str(folder / "*.jsonl"), "train")) + list(
        dataset.iter_documents(str(folder / "*.jsonl"), "val")) == ["json one", "json two"]


def test_a_folder_is_listed_as_glob_listed_it_and_an_unreadable_subfolder_is_named(tmp_path, monkeypatch):
    """--data=FOLDER lists what glob's "**/*" listed (hidden names left out, a linked folder followed), so the
    data order stays. A subfolder this user cannot read is named, where glob left it out without a word."""
    folder = tmp_path / "mine"
    for name in ("a.txt", "sub/b.jsonl", "sub/deeper/c.txt", ".hidden.txt", ".git/d.txt", "sub/.e.txt", "f.csv"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(folder / name, ["some text"])
    (folder / "linked").symlink_to(folder / "sub")
    globbed = [f for f in glob.glob(str(folder / "**" / "*"), recursive=True)
               if Path(f).suffix in (".txt", ".jsonl", ".parquet", ".py") and Path(f).is_file()]
    assert dataset.user_files(str(folder)) == sorted(globbed) and len(globbed) == 5
    unreadable, real = folder / "sub" / "deeper", os.scandir

    def scandir(path="."):  # the mode for a user, the read itself for root, whom modes do not stop
        if Path(path) == unreadable:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with raises_naming(EnvironmentFailure, str(unreadable), os.strerror(errno.EACCES), "readable"):
        dataset.list_chunks(str(folder), "train")


def corrupt(path, where):
    """A parquet file of three row groups, then random bytes over its footer or over row group 1's pages."""
    write_parquet(path, make_documents(30, seed=8), row_group_size=10)
    data = bytearray(path.read_bytes())
    start = len(data) - 40 if where == "footer" else pq.read_metadata(path).row_group(1).column(0).data_page_offset
    data[start:start + 32] = random.Random(0).randbytes(32)
    path.write_bytes(bytes(data))
    return path


def not_readable(path, monkeypatch):
    """A shard that cannot be read: the mode for a user, the read itself for root, whom modes do not stop."""
    write_parquet(path, ["one", "two"])
    path.chmod(0)
    real = pq.read_metadata

    def read_metadata(where, *args, **kwargs):
        if Path(where) == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(where))
        return real(where, *args, **kwargs)

    monkeypatch.setattr(pq, "read_metadata", read_metadata)
    return path


BAD_FILES = {  # a file's name -> how it is made, the error, and the words after its path
    "footer.parquet": (lambda path, _: corrupt(path, "footer"), ValueError, ["remove"]),
    "pages.parquet": (lambda path, _: corrupt(path, "pages"), ValueError, ["row group 1", "remove"]),
    "empty.parquet": (lambda path, _: path.write_bytes(b""), ValueError, ["0 bytes", "remove"]),
    "number.jsonl": (lambda path, _: path.write_text('{"text": "fine"}\n{"text": 5}\n'), ValueError, ["line 2"]),
    "null.jsonl": (lambda path, _: path.write_text('{"text": null}\n'), ValueError, ["line 1"]),
    "number.parquet": (lambda path, _: pq.write_table(pa.table({"text": [1, 2]}), path), ValueError, ["int64"]),
    "null.parquet": (lambda path, _: write_parquet(path, ["fine", None]), ValueError, ["row group 0"]),
    "utf16.txt": (lambda path, _: path.write_bytes("one\n\ntwo".encode("utf-16")), ValueError, ["UTF-8"]),
    "unreadable.parquet": (not_readable, EnvironmentFailure, ["readable"]),
}


@pytest.mark.parametrize("name", BAD_FILES)
def test_a_bad_data_file_is_named_with_its_fix_wherever_it_is_read(name, tokenizer, tmp_path, monkeypatch):
    """Corrupt, empty, unreadable, not UTF-8, or a 'text' that is not a string: the listing, the tokenizer's read
    and the loader's thread (what train and eval_core read through) each end in one line naming the file."""
    make, error, words = BAD_FILES[name]
    path = tmp_path / "data" / name
    path.parent.mkdir()
    make(path, monkeypatch)
    write_jsonl(tmp_path / "data" / "fine.jsonl", make_documents(40))
    for read in (lambda: list(dataset.iter_documents(str(path.parent), "train")),
                 lambda: next(data.DataLoader(tokenizer, str(path.parent), "train", batch_size=1, seq_len=8))):
        with raises_naming(error, str(path), *words) as refused:
            read()
        assert "\n" not in str(refused.value)


def test_a_file_where_the_shards_folder_belongs_is_named():
    (dataset.get_base_dir() / "fineweb-edu").write_text("")
    with raises_naming(ValueError, str(dataset.get_base_dir() / "fineweb-edu")):
        dataset.list_chunks("fineweb-edu", "val")


def test_bad_user_sources_say_what_to_do(tmp_path):
    with raises_naming(FileNotFoundError, f"'{tmp_path / 'nothing*.txt'}'", "--data=stdlib"):
        dataset.list_chunks(str(tmp_path / "nothing*.txt"), "train")
    (tmp_path / "bad.jsonl").write_text('{"content": "no text field"}\n')
    with raises_naming(ValueError, str(tmp_path / "bad.jsonl"), "'text'"):
        list(dataset.iter_documents(str(tmp_path / "bad.jsonl"), "train"))
    loader = data.DataLoader(None, str(tmp_path / "bad.jsonl"), "train", batch_size=1, seq_len=8)
    for _ in range(2):  # raised from the tokenizing thread, and again on every later call rather than hanging
        with raises_naming(ValueError, str(tmp_path / "bad.jsonl"), "'text'"):
            next(loader)
    with raises_naming(ValueError, "'test'"):
        dataset.list_chunks("stdlib", "test")


def test_stdlib_source():
    files = dataset.stdlib_files()
    assert len(files) > 100 and not any("site-packages" in f for f in files)
    train = list(dataset.iter_documents("stdlib", "train"))
    val = list(dataset.iter_documents("stdlib", "val"))
    assert 0.02 < len(val) / (len(train) + len(val)) < 0.10  # a fixed ~5% held out (dataset.VAL_EVERY)
    assert len(train) > 5 * len(files)  # a document per top-level block, not per file
    train_set, val_set = set(train), set(val)
    for path in files[::10]:  # a file goes to one split whole: its blocks share names and imports
        blocks = [b for b in dataset.read_text_file(path) if b and not b.isspace()]
        assert set(blocks) <= (val_set if dataset.is_val_document("".join(blocks)) else train_set), path
    assert val == list(dataset.iter_documents("stdlib", "val"))  # the same every time

# -----------------------------------------------------------------------------
# Loader

@pytest.fixture
def corpus(tmp_path):
    return str(write_jsonl(tmp_path / "corpus.jsonl", make_documents(300, seed=7, max_words=60)))


def test_rows_start_with_bos_and_ids_in_vocab(tokenizer, corpus):
    loader = data.DataLoader(tokenizer, corpus, "train", batch_size=4, seq_len=64, buffer_docs=50)
    for _, (x, y) in zip(range(20), loader):
        assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.long
        assert (x[:, 0] == tokenizer.bos_id).all()
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert 0 <= x.min() and max(x.max(), y.max()) < tokenizer.vocab_size
        assert not (x == tokenizer.bos_id + 2).any()  # <|pad|>: rows are filled, never padded
    loader.close()


def test_rows_hold_whole_documents_when_they_fit(tokenizer, corpus):
    texts = list(dataset.iter_documents(corpus, "train"))
    loader = data.DataLoader(tokenizer, corpus, "train", batch_size=1, seq_len=1024)
    x, y = next(loader)
    row = torch.cat([x[0], y[0, -1:]]).tolist()
    starts = [i for i, t in enumerate(row) if t == tokenizer.bos_id] + [len(row)]
    pieces = [tokenizer.decode(row[a + 1:b]) for a, b in zip(starts, starts[1:])]
    assert all(piece in texts for piece in pieces[:-1])  # best fit places whole documents, only the last is cut
    assert any(text.startswith(pieces[-1]) for text in texts)


def test_ranks_share_documents_disjointly(corpus):
    everything = sorted(dataset.iter_documents(corpus, "train"))
    streams = [data.DocumentStream(corpus, "train", seed=3, rank=r, world_size=2) for r in range(2)]
    shares = [[text for _, text in stream.iterate(loop=False)] for stream in streams]
    assert not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == everything
    assert abs(len(shares[0]) - len(shares[1])) <= len(dataset.list_chunks(corpus, "train"))
    # the order is a function of (seed, epoch) only
    def order(seed, epoch):
        return [t for _, t in data.DocumentStream(corpus, "train", seed=seed).iterate(epoch=epoch, loop=False)]
    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(2, 0) and order(1, 0) != order(1, 1)
    assert sorted(order(1, 1)) == everything


def test_resumed_loader_yields_the_same_batches(tokenizer, tmp_path):
    # small documents in several files, a small buffer, so the saved state spans chunks and epochs
    for i in range(3):
        write_jsonl(tmp_path / f"part{i}.jsonl", make_documents(40, seed=20 + i, max_words=40))
    source = str(tmp_path / "part*.jsonl")
    kwargs = dict(batch_size=3, seq_len=48, rank=1, world_size=2, seed=5, buffer_docs=20, tokenize_batch=7)
    running = data.DataLoader(tokenizer, source, "train", **kwargs)
    for _ in range(6):
        next(running)
    state = json.loads(json.dumps(running.state_dict()))  # it must survive a checkpoint file
    expected = [next(running) for _ in range(15)]
    assert running.next_doc[0] >= 1, "the test should cross an epoch boundary"

    resumed = data.DataLoader(tokenizer, source, "train", **kwargs)
    resumed.load_state_dict(state)
    reused = data.DataLoader(tokenizer, source, "train", **kwargs)
    next(reused)  # a loader already running ahead, then rewound
    reused.load_state_dict(state)
    for loader in (resumed, reused):
        for (x, y), (ex, ey) in zip((next(loader) for _ in range(15)), expected):
            assert torch.equal(x, ex) and torch.equal(y, ey)
        assert loader.state_dict() == running.state_dict()
        loader.close()
    other_rank = data.DataLoader(tokenizer, source, "train", **{**kwargs, "rank": 0})
    with raises_naming(ValueError, "('train', 5, 1, 2)", "('train', 5, 0, 2)"):  # saved, then this loader's
        other_rank.load_state_dict(state)
    running.close()


def test_a_share_past_eight_buffers_is_packed_as_by_a_loader_that_never_drains(tokenizer, corpus, monkeypatch):
    """At an epoch's end a buffer drains to an eighth of its share: a share of at least eight buffers never drains,
    so it yields what a loader that never drains does (DRAIN = 1, for shares of a buffer or more), epochs on; a
    smaller share drains, and is packed otherwise."""
    def batches(buffer_docs, drain):
        monkeypatch.setattr(data, "DRAIN", drain)
        loader = data.DataLoader(tokenizer, corpus, "train", batch_size=2, seq_len=16, buffer_docs=buffer_docs)
        out = [next(loader)[0] for _ in range(400)]
        assert loader.next_doc[0] >= 2, "the test should cross two epoch boundaries"
        loader.close()
        return out

    share = len(list(dataset.iter_documents(corpus, "train")))
    assert share >= 8 * 30 and share < 8 * 60
    assert all(torch.equal(a, b) for a, b in zip(batches(30, 8), batches(30, 1)))
    assert not all(torch.equal(a, b) for a, b in zip(batches(60, 8), batches(60, 1)))


def test_val_batches_are_bounded_and_repeatable(tokenizer, corpus):
    first = list(data.val_batches(tokenizer, corpus, batch_size=2, seq_len=16, num_tokens=2 * 16 * 3))
    second = list(data.val_batches(tokenizer, corpus, batch_size=2, seq_len=16, num_tokens=2 * 16 * 3))
    assert len(first) == 3
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, second))
    # the val split is read once: the loader ends, and a split too small for one batch says so
    assert len(list(data.DataLoader(tokenizer, corpus, "val", batch_size=2, seq_len=16))) > 3
    with raises_naming(ValueError, "val", "64", "4097"):  # the split, and one batch: 64 rows of 4,096 + 1
        next(data.DataLoader(tokenizer, corpus, "val", batch_size=64, seq_len=4096))


@pytest.mark.slow
def test_cli_help_explains_the_steps():
    result = python(["-m", "nanoparcae.dataset", "--help"])
    assert result.returncode == 0
    assert "python -m nanoparcae.dataset download -n 8" in result.stdout and "stdlib" in result.stdout


def test_bytes_read_per_process_do_not_grow_with_gradient_accumulation(tokenizer, tmp_path):
    # train.py's loaders for one process: one per micro-batch, rank = micro of world = accum, the same rows per
    # step whatever the accumulation; 20 row groups, a few epochs
    write_parquet(tmp_path / "docs.parquet", make_documents(320, seed=9, max_words=40), row_group_size=16)
    source, rows_per_step, steps = str(tmp_path / "docs.parquet"), 8, 90

    def run(accum, sharers):
        """-> (characters the process read per document its loaders took in, every step's micro-batches).
        Per document taken, because packing smaller buffers crops more, so takes in more documents."""
        readers = [dataset.ChunkReader()] * accum if sharers > 1 else [dataset.ChunkReader() for _ in range(accum)]
        loaders = [data.DataLoader(tokenizer, source, "train", rows_per_step // accum, 32, rank=micro,
                                   world_size=accum, buffer_docs=4, tokenize_batch=1, reader=reader, sharers=sharers)
                   for micro, reader in enumerate(readers)]
        batches = [[next(loader)[0] for loader in loaders] for _ in range(steps)]
        for loader in loaders:
            loader.close()
        chars_read = sum(reader.chars_read for reader in set(readers))
        return chars_read / sum(loader.arrivals for loader in loaders), batches

    (one, _), (four, batches), (separate, separate_batches) = run(1, 1), run(4, 4), run(4, 1)
    # four loaders read up to where the furthest of them is (they drift apart a little), not four times
    assert four <= 1.25 * one, (four, one)
    assert separate >= 3.5 * one  # what one reader per loader would read
    assert all(torch.equal(a, b) for step, other in zip(batches, separate_batches) for a, b in zip(step, other))


def module_state(module):
    """What a module's globals hold, as text: a value's repr, or an object's attributes (a reader's cache)."""
    return {name: repr(vars(value)) if hasattr(value, "__dict__") else repr(value)
            for name, value in vars(module).items()
            if not name.startswith("__") and not isinstance(value, (types.ModuleType, types.FunctionType, type))}


def test_reading_a_corpus_leaves_no_state_in_the_modules(tokenizer, tmp_path, capsys):
    """The chunk cache and the set of files named for bytes that are not UTF-8 belong to a ChunkReader, which its
    loaders share: a corpus read by the tokenizer, by loaders that share a reader and by the val batches leaves
    the globals of data.py, nanoparcae/dataset.py and nanoparcae/tokenizer.py as they were."""
    write_jsonl(tmp_path / "docs.jsonl", make_documents(200, seed=4, max_words=40))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n\nna\xefve".encode("latin-1"))
    source = str(tmp_path / "*.*")
    before = {module: module_state(module) for module in (data, dataset, tokenizers)}
    get_tokenizer(source, 300)
    reader = dataset.ChunkReader()
    loaders = [data.DataLoader(tokenizer, source, "train", 2, 16, rank=micro, world_size=2, reader=reader, sharers=2)
               for micro in range(2)]
    for loader in loaders:
        next(loader)
        loader.close()
    list(data.val_batches(tokenizer, source, 1, 16, 16, reader=reader))
    assert reader.reads > 0 and reader.reported == {str(tmp_path / "latin1.txt")}
    assert capsys.readouterr().err.count("latin1.txt") == 2  # training the tokenizer, then the loaders' reader
    assert {module: module_state(module) for module in (data, dataset, tokenizers)} == before
