"""What the tests share: every test gets its own empty base directory (no test reads or writes
~/.cache/nanoparcae); TINY, the flags of a train.py run that takes seconds on a CPU; the tiny corpus it trains on;
a command run as users run it, in a process of its own, forked from one that has imported torch already (Started,
python, train); what a message must carry (its flags, values and paths, not its sentence); a run folder's files,
to show a command left them as they were; a local HTTP server over a folder; and jobs started as the session
starts, on a thread of their own, whose results a test awaits."""

import contextlib
import functools
import http.server
import io
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import random
import re
import runpy
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

# One thread for torch and numpy in this process too, set before either is imported: the suite runs its commands and
# jobs beside its tests, and threads waiting for a core another process holds spin.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor's C++ kernels unvectorised: they stand in for a GPU's kernels (lowering, fusion, dynamic shapes, bf16),
# not for the CPU's vector units, and build in three quarters of the time.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
ROOT = Path(__file__).resolve().parent.parent
TINY = ["--depth=3", "--d_model=64", "--head_dim=32", "--mu_rec=3", "--vocab_size=320", "--seq_len=32",
        "--device_batch_size=4", "--total_batch_size=256", "--max_tokens=2048", "--eval_every=1000",
        "--eval_tokens=256", "--save_every=1000", "--log_every=1", "--dtype=float32", "--compile=0"]


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: starts a process, runs torchrun, compiles, trains more than a few steps or fits a law")
    config.addinivalue_line("markers", "beforehand(job): job(folder) starts as the session starts (awaited)")


# Whether the test being set up carries the slow mark: only such a test may start a process.
RUNNING = {"slow": True}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    RUNNING["slow"] = item.get_closest_marker("slow") is not None


def pytest_collection_modifyitems(items):
    """Tests marked @beforehand(job) run last: their jobs run while the others do."""
    items.sort(key=lambda item: item.get_closest_marker("beforehand") is not None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """A test marked @beforehand(job) runs once its jobs are done."""
    for marker in item.iter_markers("beforehand"):
        awaited(marker.args[0])


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
    """python's arguments: train.py for one process without torchrun flags; torchrun otherwise (standalone unless
    `torchrun` gives the launcher's rendezvous flags, as the two-node test does for one process per node). fault:
    run tests/faulty_train.py with that fault in place of train.py."""
    launcher = [] if nproc == 1 and torchrun is None else \
        ["-m", "torch.distributed.run", *(torchrun or ["--standalone"]), f"--nproc_per_node={nproc}", "--"]
    script = [str(ROOT / "tests" / "faulty_train.py"), fault] if fault else [str(ROOT / "train.py")]
    return launcher + script + [f"--data={corpus / 'corpus.txt'}", *TINY, *flags]


# The environment as the first test starts: a background thread's commands see it, not what a running test has set.
# It is taken after collection, whose imports set variables too (inductor's cache folder), as the fork server's is.
SESSION_ENV = {}


def environment():
    """os.environ in the main thread; SESSION_ENV in a thread that runs beside the tests."""
    return os.environ if threading.current_thread() is threading.main_thread() else SESSION_ENV


def train_env(corpus, base=None, **extra):
    return {**environment(), "NANOPARCAE_BASE_DIR": str(base or corpus / "base"), "OMP_NUM_THREADS": "1", **extra}


# A process that has imported these and run nothing: each command a test starts is a fork of it (`Started`), so it
# skips importing torch and dynamo, most of what a tiny run costs.
PRELOADED = ["torch", "torch._dynamo", "torch.distributed", "numpy", "tiktoken"]
FORKS = multiprocessing.get_context("forkserver")
FORKS.set_forkserver_preload(PRELOADED)


def _run_as_main(args, env, cwd, out_path, err_path, server=None):
    """In the forked process: what `python *args` does, with env, in cwd, its output to these files (or to these
    inherited descriptors, `Inherited`). server: the fork server's address, from which torchrun's workers fork."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        os.dup2(path.fd if isinstance(path, Inherited) else os.open(path, os.O_WRONLY), fd)
    module = args[0] == "-m"
    if module and args[1] == "torch.distributed.run" and server is not None:
        _fork_workers(server)
    sys.argv = [args[1], *args[2:]] if module else list(args)
    sys.path[:] = [cwd if module else os.path.dirname(os.path.abspath(args[0]))] + \
        [path for path in sys.path if path and Path(path).resolve() not in (ROOT, ROOT / "tests")]
    try:
        if module:
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(args[0], run_name="__main__")
    except Exception:  # what the interpreter does with an uncaught error: the script's sys.excepthook
        sys.excepthook(*sys.exc_info())
        sys.exit(1)


# What torchrun sets in its workers' environment: read as a worker joins its group, not as torch imports.
TORCHRUN_VARIABLES = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def changes_torch(env, base_env):
    """Whether env, against base_env, changes how torch imports or picks its kernels (threads, TORCH_* switches,
    ATEN_CPU_CAPABILITY, MKL_*), beyond torchrun's variables."""
    return any(env.get(key) != base_env.get(key) for key in {*env, *base_env}
               if (key == "OMP_NUM_THREADS" or key.startswith(("TORCH", "PYTORCH", "ATEN_", "MKL_")))
               and not key.startswith(TORCHRUN_VARIABLES))


class Inherited:
    """An open descriptor handed to a fork of the server: pickled as multiprocessing hands one to a child."""

    def __init__(self, fd):
        self.fd = fd

    def __reduce__(self):
        return _inherited, (multiprocessing.reduction.DupFd(self.fd),)


def _inherited(dup):
    return Inherited(dup.detach())


class _ForkedWorker:
    """torchrun's worker `python [-u] *args`, forked from the server as Started's commands are: what torchrun reads of
    its Popen (pid, poll, wait, returncode)."""

    def __init__(self, args, env, stdout, stderr):
        self.args, self.returncode = args, None
        outputs = [Inherited(file.fileno() if file else fd) for fd, file in ((1, stdout), (2, stderr))]
        self.process = FORKS.Process(target=_run_worker, args=(args, env, os.getcwd(), *outputs))
        # The fork imports this file to find _run_worker, and nothing of the launcher's __main__ (torchrun's).
        main, path = sys.modules["__main__"], list(sys.path)
        sys.modules["__main__"], sys.path[:0] = types.ModuleType("__main__"), [str(ROOT / "tests")]
        try:
            self.process.start()
        finally:
            sys.modules["__main__"], sys.path[:] = main, path
        self.pid = self.process.pid

    def poll(self):
        self.returncode = self.process.exitcode
        return self.returncode

    def wait(self, timeout=None):
        self.process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def _run_worker(args, env, cwd, out, err):
    """A worker as torchrun starts one: a session of its own (torchrun signals its process group), and output
    unbuffered (`python -u`), so that what a killed worker printed is in the files."""
    os.setsid()
    for fd in (1, 2):
        os.dup2((out, err)[fd - 1].fd, fd)
    sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), stream.encoding, stream.errors,
                                               write_through=True) for fd, stream in ((1, sys.stdout), (2, sys.stderr)))
    _run_as_main(args, env, cwd, Inherited(1), Inherited(2))


def _fork_workers(server):
    """In a launcher forked from the server: torchrun's `python [-u] ...` workers are forks of the server too, unless
    their environment changes how torch imports (changes_torch)."""
    from multiprocessing import forkserver
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler
    forkserver._forkserver._forkserver_address = server
    forkserver._forkserver.ensure_running = lambda: None  # the suite's server, whose alive pipe this process holds
    popen = SubprocessHandler._popen

    def fork_or_popen(handler, args, env):
        if args[0] != sys.executable or changes_torch(env, os.environ):  # os.environ: a fork's, as the server's
            return popen(handler, args, env)
        return _ForkedWorker(list(args[2:] if args[1] == "-u" else args[1:]), env, handler._stdout, handler._stderr)

    SubprocessHandler._popen = fork_or_popen


def fresh_interpreter(env):
    """Whether env changes how torch imports (changes_torch): then the fork server's import won't do."""
    return changes_torch(env, start_fork_server())


class Started:
    """`python *args` (a script and its flags, or -m and a module) started in cwd as a process of its own, read as
    a subprocess.Popen is: pid, poll(), send_signal(), kill(), communicate() -> (stdout, stderr), returncode. One
    thread (OMP_NUM_THREADS=1) unless env says otherwise: the suite runs its commands side by side. The process is
    a fork of one that imported PRELOADED with one thread, or a fresh interpreter where env needs one; so are the
    workers of a torchrun command forked so (_fork_workers)."""

    def __init__(self, args, env=None, cwd=ROOT):
        # a slow fixture's thread may start its runs while a later test runs
        assert RUNNING["slow"] or threading.current_thread() is not threading.main_thread(), \
            "a test that starts a process carries @pytest.mark.slow"
        env = {**environment(), "OMP_NUM_THREADS": "1", **(env or {})}
        self.args, self.returncode, self.folder = args, None, tempfile.TemporaryDirectory()
        self.out, self.err = Path(self.folder.name, "stdout"), Path(self.folder.name, "stderr")
        self.out.touch()
        self.err.touch()
        if fresh_interpreter(env):
            with self.out.open("w") as out, self.err.open("w") as err:
                self.process = subprocess.Popen([sys.executable, *args], stdout=out, stderr=err, env=env, cwd=cwd)
        else:
            server = multiprocessing.forkserver._forkserver._forkserver_address
            self.process = FORKS.Process(target=_run_as_main,
                                         args=(args, env, str(cwd), str(self.out), str(self.err), server))
            self.process.start()
        self.pid = self.process.pid

    def poll(self):
        if isinstance(self.process, subprocess.Popen):
            self.returncode = self.process.poll()
        else:
            self.returncode = self.process.exitcode
        return self.returncode

    def send_signal(self, signal_number):
        """As Popen's: a process that has ended, even one whose end is not yet seen, is left alone."""
        if self.poll() is None:
            try:
                os.kill(self.pid, signal_number)
            except ProcessLookupError:  # a fork of the server ends before the server reports its status
                pass

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout=300):
        deadline = time.time() + timeout
        while self.poll() is None:
            if time.time() > deadline:
                self.kill()
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.out.read_text(), self.err.read_text()


def python(args, env=None, cwd=ROOT, timeout=300):
    """`python *args` run to its end (Started) -> its returncode, stdout and stderr, as subprocess.run gives them."""
    started = Started(args, env, cwd)
    stdout, stderr = started.communicate(timeout)
    return subprocess.CompletedProcess(args, started.returncode, stdout, stderr)


def forked(module, monkeypatch):
    """module's subprocess.run, for the `sys.executable ...` commands it runs, forked as Started: its output goes to
    the stdout file given, stderr after it for stderr=subprocess.STDOUT."""
    def run(command, stdout=None, stderr=None, cwd=ROOT, env=None):
        assert command[0] == sys.executable, command
        result = python(command[1:], env, cwd)
        if stdout is not None:
            stdout.write(result.stdout + (result.stderr if stderr == subprocess.STDOUT else ""))
        return result

    monkeypatch.setattr(module, "subprocess", SimpleNamespace(run=run, STDOUT=subprocess.STDOUT))


@functools.cache
def start_fork_server():
    """Starts the process `Started` forks from, with OMP_NUM_THREADS=1 before torch reads it -> its environment."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    multiprocessing.forkserver.ensure_running()
    server_env = dict(os.environ)
    if saved is None:
        del os.environ["OMP_NUM_THREADS"]
    else:
        os.environ["OMP_NUM_THREADS"] = saved
    return server_env


# job -> the future of its result, for each job a selected test marks @beforehand(job); job -> those tests
BEFOREHAND, AWAITING = {}, {}


@pytest.fixture(scope="session", autouse=True)
def fork_server(request, tmp_path_factory):
    """The fork server imports torch while the first tests run, where a slow test will need it. Then the jobs of the
    selected tests start, two at a time on two threads, each given a folder of its own: they run while the tests
    before theirs do."""
    SESSION_ENV.update((key, value) for key, value in os.environ.items() if key != "PYTEST_CURRENT_TEST")
    warming = "NANOPARCAE_TESTS_WARMING" in os.environ  # compile_cache's: a server only if a test starts a process
    if not warming and any(item.get_closest_marker("slow") for item in request.session.items):
        start_fork_server()
    for item in request.session.items:
        for marker in item.iter_markers("beforehand"):
            AWAITING.setdefault(marker.args[0], []).append(f"{item.path}::{item.name}")
    with ThreadPoolExecutor(2) as pool:
        for job in AWAITING if not warming else ():  # compile_cache's process starts none
            BEFOREHAND[job] = pool.submit(job, tmp_path_factory.mktemp(job.__name__))
        yield
        for future in BEFOREHAND.values():
            future.cancel()  # not started: no test that ran awaits it


def beforehand(job):
    """The mark of a test that awaits job(folder): it starts as the session starts, where the test is selected."""
    return pytest.mark.beforehand.with_args(job)


def awaited(job):
    """The result of a job the test marks @beforehand(job), once it is done (its error, if it raised)."""
    return BEFOREHAND[job].result() if job in BEFOREHAND else None  # None: in compile_cache's process


def compile_cache(folder):
    """Runs the tests that await it in a process of their own, which fills torch's compile cache (inductor's C++,
    seconds per kernel to build): those tests then find their kernels built. Their verdict is their own. The
    process has this one's threads, which inductor's code depends on."""
    import torch
    python(["-m", "pytest", "-q", "-p", "no:cacheprovider", *AWAITING[compile_cache]],
           {"NANOPARCAE_TESTS_WARMING": "1", "OMP_NUM_THREADS": str(torch.get_num_threads())}, timeout=900)


def train(corpus, *flags, nproc=1, torchrun=None, env=None, expect_ok=True, fault=None, base=None):
    """train.py on the tiny corpus with TINY and `flags` -> the finished process (status 0 asserted unless
    expect_ok=False)."""
    result = python(train_command(corpus, *flags, nproc=nproc, torchrun=torchrun, fault=fault),
                    train_env(corpus, base, **(env or {})))
    if expect_ok:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def run_here(args, monkeypatch, capsys):
    """`python *args` run in this process, for a command that stops before any work -> its CompletedProcess. A
    message given to sys.exit goes to stderr with status 1, as Python does."""
    module = args[0] == "-m"
    monkeypatch.setattr(sys, "argv", [args[1], *args[2:]] if module else [str(ROOT / args[0]), *args[1:]])
    if module:
        monkeypatch.delitem(sys.modules, args[1], raising=False)  # run afresh as __main__, as python -m does
    with pytest.raises(SystemExit) as exit_info:
        if module:
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(ROOT / args[0]), run_name="__main__")
    out, err = capsys.readouterr()
    status = exit_info.value.code
    if isinstance(status, str):
        err, status = err + status + "\n", 1
    return subprocess.CompletedProcess(args, status or 0, out, err)


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


@contextlib.contextmanager
def raises_naming(error, *words):
    """pytest.raises(error), whose message must name each of words (carries): the flag or value, not the sentence."""
    with pytest.raises(error) as info:
        yield info
    assert carries(str(info.value), *words), info.value


@contextlib.contextmanager
def warns_naming(category, *words):
    """pytest.warns(category), one of whose warnings must name each of words (carries)."""
    with pytest.warns(category) as record:
        yield record
    assert any(carries(str(warning.message), *words) for warning in record), [str(w.message) for w in record]


def corrupt_a_weight(path):
    """Flip one byte amid the largest tensor of the checkpoint at path, its size unchanged, as a disk or a copy may."""
    with zipfile.ZipFile(path) as archive:
        record = max((info for info in archive.infolist() if "/data/" in info.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as file:
        file.seek(record.header_offset + 26)  # a zip local header: 30 bytes, then its name and extra field
        name, extra = struct.unpack("<HH", file.read(4))
        file.seek(record.header_offset + 30 + name + extra + record.file_size // 2)
        byte = file.read(1)[0]
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte ^ 0x40]))


def untouched(run_dir):
    """{file name: (bytes, mtime)} of a run folder, to show that a refused command wrote nothing there."""
    return {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in sorted(run_dir.iterdir())}


@pytest.fixture
def server(tmp_path):
    """A local HTTP server over tmp_path/www (serving)."""
    with serving(tmp_path / "www") as served:
        yield served


@contextlib.contextmanager
def serving(root):
    """A local HTTP server over root, a new folder, at url, with the path of every GET it answered (requests)."""
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

