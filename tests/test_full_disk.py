"""A save that cannot finish (a full disk, weights that are not finite, a file that does not read back) stops the
run in one line, keeps the last checkpoint and leaves no partial file; a partial file a run left behind is removed by
the next start, which continues the run."""

import errno
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import (ROOT, TINY, awaited, beforehand, carries, python, raises_naming, train, train_env, untouched,
                      write_corpus)
from model import Parcae, ParcaeConfig
from nanoparcae import checkpoint, command, files, metrics
from nanoparcae.tokenizer import Tokenizer, get_tokenizer

CONFIG = ParcaeConfig(vocab_size=97, seq_len=16, n_prelude=1, n_recur=1, n_coda=1, d_model=64, head_dim=32)


def stopped_in_one_line(call, capsys):
    """call() must raise EnvironmentFailure, which a command ends with in one line, status 1 -> that line."""
    with pytest.raises(command.EnvironmentFailure):
        call()
    with pytest.raises(SystemExit) as stop:
        command.run_command(lambda argv: call())
    assert stop.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def saved(tmp_path):
    """A run folder holding one checkpoint, ckpt_000002.pt -> (its folder, a model to save next)."""
    model = Parcae(CONFIG)
    checkpoint.save_checkpoint(tmp_path / "ckpt_000002.pt", model, step=2)
    return tmp_path, model


def kept_as_it_was(folder):
    """The folder holds the step-2 checkpoint alone, whole, and no partial file."""
    assert sorted(path.name for path in folder.iterdir()) == ["ckpt_000002.pt"]
    return checkpoint.read_checkpoint(folder / "ckpt_000002.pt")["step"] == 2


def test_a_save_without_room_is_refused_before_it_writes(saved, monkeypatch, capsys):
    folder, model = saved
    need = checkpoint.saved_bytes({"model": model.state_dict()})
    free = need // 2
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: SimpleNamespace(free=free))
    writes = []
    monkeypatch.setattr(checkpoint.torch, "save", lambda *args: writes.append(args))
    line = stopped_in_one_line(lambda: checkpoint.save_checkpoint(folder / "ckpt_000004.pt", model, step=4),
                               capsys)
    assert writes == []
    assert carries(line, str(folder), "full", checkpoint.size(need), checkpoint.size(free)), line
    assert kept_as_it_was(folder)


def refusing_file(code):
    """A file whose every write raises OSError(code), as a full disk or a quota makes Python's file do."""
    class Refusing(io.BytesIO):
        def write(self, data):
            raise OSError(code, os.strerror(code))
    return Refusing()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_write_the_disk_or_a_quota_cuts_short_removes_its_partial_file_in_one_line(saved, monkeypatch, capsys,
                                                                                     code):
    """torch.save writes through Python's file, whose OSError carries the errno (/dev/full for a full disk), while
    the disk still shows room: one line naming the file and the OS's cause, the partial file gone."""
    folder, model = saved
    target = "/dev/full" if code == errno.ENOSPC and os.path.exists("/dev/full") else None

    def refusing_open(path, mode):
        Path(path).write_bytes(b"x" * 1000)  # the part written before the disk refused more
        return open(target, mode) if target else refusing_file(code)
    monkeypatch.setattr(checkpoint, "open", refusing_open, raising=False)
    line = stopped_in_one_line(lambda: checkpoint.save_checkpoint(folder / "ckpt_000004.pt", model, step=4),
                               capsys)
    assert carries(line, str(folder / "ckpt_000004.pt"), os.strerror(code)), line
    assert kept_as_it_was(folder)


def test_a_write_that_fails_with_room_left_is_not_called_a_full_disk(saved, monkeypatch):
    folder, model = saved

    def failing_save(state, file):
        file.write(b"x" * 1000)
        raise RuntimeError("some other fault")
    monkeypatch.setattr(checkpoint.torch, "save", failing_save)
    with pytest.raises(RuntimeError, match="some other fault"):
        checkpoint.save_checkpoint(folder / "ckpt_000004.pt", model, step=4)
    assert kept_as_it_was(folder)


# -----------------------------------------------------------------------------
# A diverged run, or a save that does not read back, keeps its last good checkpoint


def test_weights_that_are_not_finite_are_never_saved_and_the_last_checkpoint_stays(saved, monkeypatch, capsys):
    """Probes: a resume whose optimizer state held NaN, and --adamw_lr=3e38, made every weight NaN or inf. The
    save then pruned the run's good checkpoint for one that is not finite; here nothing is written, in one line."""
    folder, model = saved
    from nanoparcae.tokenizer import Tokenizer
    monkeypatch.setattr(Tokenizer, "files_digest", lambda directory: "0" * 16)
    with torch.no_grad():
        model.wte.weight.fill_(float("nan"))
        model.coda[0].mlp.c_fc.weight[0, 0] = float("inf")
    with pytest.raises(SystemExit) as stop:
        command.run_command(lambda argv: checkpoint.save_and_prune(folder, 3, model, [], tokenizer_dir=str(folder)))
    line = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "\n" not in line, line
    assert carries(line, "step", "3", "wte.weight", str(folder / "ckpt_000002.pt")), line
    assert kept_as_it_was(folder)


def test_a_save_that_does_not_read_back_whole_never_replaces_the_last_checkpoint(saved, monkeypatch):
    """A write that leaves another file than the one saved (a disk that drops a block, say): the new checkpoint is
    refused on reading back, before its rename, and the older one is kept."""
    folder, model = saved
    other = io.BytesIO()
    torch.save({"config": {}, "model": {}}, other)
    monkeypatch.setattr(checkpoint.torch, "save", lambda state, file: file.write(other.getvalue()))
    from nanoparcae.tokenizer import Tokenizer
    monkeypatch.setattr(Tokenizer, "files_digest", lambda directory: "0" * 16)
    with raises_naming(command.EnvironmentFailure, str(folder / "ckpt_000003.pt")):
        checkpoint.save_and_prune(folder, 3, model, [], tokenizer_dir=str(folder))
    assert kept_as_it_was(folder)


def test_the_estimate_covers_what_torch_writes(tmp_path):
    model = Parcae(ParcaeConfig.from_depth(3, d_model=64, head_dim=32, mu_rec=3, vocab_size=320, seq_len=32))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long),
          h0_generator=torch.Generator().manual_seed(0)).backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "args": {"depth": 3},
             "loader": [{"buffer": [[arrival, rank, arrival * 7] for arrival in range(5000)]} for rank in range(4)]}
    torch.save(state, tmp_path / "written.pt")
    written = (tmp_path / "written.pt").stat().st_size
    assert written < checkpoint.saved_bytes(state) < 1.2 * written


def no_room(*args):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_metrics_on_a_full_disk_stop_in_one_line(tmp_path, monkeypatch, capsys):
    log = metrics.Metrics(tmp_path, 0)
    log.file = SimpleNamespace(name=str(tmp_path / "metrics.jsonl"), write=no_room)
    line = stopped_in_one_line(lambda: log.record({"step": 1, "loss": 5.0}), capsys)
    assert carries(line, str(tmp_path), "full", "metrics.jsonl"), line
    monkeypatch.setattr(metrics, "write_atomically", no_room)  # a resumed run rewrites the file first
    line = stopped_in_one_line(lambda: metrics.Metrics(tmp_path, 0), capsys)
    assert carries(line, str(tmp_path), "full", "metrics.jsonl"), line


def test_a_stale_partial_file_is_removed_in_one_line(saved, capsys):
    folder, _ = saved
    (folder / "ckpt_000004.pt.tmp").write_bytes(b"x" * 3000)
    checkpoint.remove_partial_saves(folder)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and carries(out[0], "removed", str(folder / "ckpt_000004.pt.tmp")), out
    assert kept_as_it_was(folder)


# A train.py whose disk fills up after its first checkpoint
FILLING = f"""
import runpy, shutil, sys
from pathlib import Path
from types import SimpleNamespace
disk_usage = shutil.disk_usage
shutil.disk_usage = lambda path: SimpleNamespace(free=0) if any(Path(path).glob("ckpt_*.pt")) else disk_usage(path)
sys.path.insert(0, {str(ROOT)!r})
sys.argv = [{str(ROOT / "train.py")!r}, *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def step_losses(base, name):
    records = metrics.read_metrics(base / "runs" / name / "metrics.jsonl")
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.slow
def test_a_run_stopped_by_a_full_disk_continues_where_it_saved_once_there_is_room(corpus, tmp_path):
    """A save at step 4 finds the disk full: one line, status 1, the step-2 checkpoint kept; a partial file left
    as a kill would leave it is removed at the next start, which finishes with the unbroken run's losses."""
    (tmp_path / "filling").write_text(FILLING)
    flags = [f"--data={corpus / 'corpus.txt'}", *TINY, "--save_every=2", "--run=full"]
    env = train_env(corpus, base=tmp_path / "base")
    stopped = python([str(tmp_path / "filling"), *flags], env)
    run_dir = tmp_path / "base" / "runs" / "full"
    assert stopped.returncode == 1 and len(stopped.stderr.strip().splitlines()) == 1, stopped.stderr[-3000:]
    assert carries(stopped.stderr, str(run_dir), "full"), stopped.stderr
    assert sorted(path.name for path in run_dir.glob("ckpt_*")) == ["ckpt_000002.pt"]
    (run_dir / "ckpt_000004.pt.tmp").write_bytes(b"x" * 1000)  # as a run killed inside its save leaves it
    resumed = python([str(ROOT / "train.py"), *flags], env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert carries(resumed.stdout, "removed", str(run_dir / "ckpt_000004.pt.tmp")), resumed.stdout
    assert carries(resumed.stdout, "resumed", "full", "2"), resumed.stdout
    assert not any(run_dir.glob("*.tmp"))
    train(corpus, "--run=unbroken", base=tmp_path / "base")
    assert step_losses(tmp_path / "base", "full") == step_losses(tmp_path / "base", "unbroken")


# -----------------------------------------------------------------------------
# A folder that cannot take a command's result: refused before the work, or the write cleaned up

def refusing(code):
    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return refuse


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_a_folder_that_cannot_be_written_is_refused_before_the_work(tmp_path, monkeypatch, capsys, code):
    monkeypatch.setattr(files.tempfile, "TemporaryFile", refusing(code))
    line = stopped_in_one_line(lambda: files.check_writable(tmp_path / "out", "the results"), capsys)
    assert carries(line, str(tmp_path / "out")), line
    assert not (tmp_path / "out").exists()


def test_a_disk_without_room_for_the_result_is_refused_before_the_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    line = stopped_in_one_line(lambda: files.check_writable(tmp_path, "the export", needs=10**6), capsys)
    assert carries(line, str(tmp_path), "full"), line


def test_a_file_named_as_the_folder_is_bad_input(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError):
        files.check_writable(tmp_path / "a_file", "the export")
    with pytest.raises(SystemExit) as stop:
        command.run_command(lambda argv: files.check_writable(tmp_path / "a_file", "the export"))
    assert stop.value.code == 2 and carries(capsys.readouterr().err, str(tmp_path / "a_file"))


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_an_atomic_write_that_fails_leaves_nothing_in_one_line(tmp_path, capsys, code):
    (tmp_path / "report.md").write_text("the old card")

    def half_then_fail(partial):
        partial.write_text("half")
        refusing(code)()
    line = stopped_in_one_line(lambda: files.write_atomically(tmp_path / "report.md", half_then_fail), capsys)
    assert carries(line, str(tmp_path / "report.md")), line
    assert [path.name for path in tmp_path.iterdir()] == ["report.md"]
    assert (tmp_path / "report.md").read_text() == "the old card"


def test_a_tokenizer_save_without_room_leaves_no_folder(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"document {i} of a few words" for i in range(60)))
    monkeypatch.setattr(Tokenizer, "save", lambda self, directory: (Path(directory).mkdir(parents=True),
                                                                   refusing(errno.ENOSPC)()))
    line = stopped_in_one_line(lambda: get_tokenizer(str(corpus), 300), capsys)
    assert carries(line, "tokenizers"), line
    assert list((files.get_base_dir() / "tokenizers").iterdir()) == []


def test_a_torn_json_file_is_named(tmp_path):
    (tmp_path / "ckpt_000008_bpb_T1-2-4.json").write_text('{"T": [1, 2\n "lo')
    with pytest.raises(ValueError) as torn:
        files.read_json(tmp_path / "ckpt_000008_bpb_T1-2-4.json")
    assert carries(str(torn.value), str(tmp_path / "ckpt_000008_bpb_T1-2-4.json"), "delete"), torn.value


# A real read-only folder: root ignores file modes, but a read-only bind mount refuses root too. Each command runs
# in a mount namespace of its own (unshare), so the mount is gone when it ends.

def can_unshare():
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def read_only_run(args, folder, env):
    """`python *args` with `folder` mounted read-only -> the finished process."""
    mount = f"mount --bind -o ro {shlex.quote(str(folder))} {shlex.quote(str(folder))}"
    command = " ".join(shlex.quote(word) for word in [sys.executable, *args])
    return subprocess.run(["unshare", "-rm", "sh", "-c", f"{mount} && exec {command}"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


READ_ONLY = {  # command ({run}: the run's folder), the folder mounted read-only, the status, the words it names
    "eval": (["eval_core.py", "--run=ro", "--eval=bpb", "--T=1,2,4", "--val_tokens=256"], "{run}", 1, ["{run}"]),
    "report": (["-m", "experiments.report", "--run=ro"], "{run}", 1, ["{run}/report.md"]),
    "report --machine": (["-m", "experiments.report", "--run=ro", "--machine"], "{run}", 1, ["{run}/recipe"]),
    "plot": (["-m", "experiments.plot", "ro", "-o", "{run}/plot.png"], "{run}", 1, ["{run}"]),
    "export": (["-m", "interop.hub", "export", "ro", "{run}/export"], "{run}", 1, ["{run}/export"]),
    "export onto a file": (["-m", "interop.hub", "export", "ro", "{run}/metrics.jsonl"], "{run}", 2,
                           ["{run}/metrics.jsonl"]),
    "train": (["train.py", "--data={corpus}", *TINY, "--run=other"], "{runs}", 1, ["{runs}/other"]),
    "tokenizer": (["-m", "nanoparcae.tokenizer", "--data={corpus}", "--vocab_size=300"], "{tokenizers}", 1,
                  ["{tokenizers}"]),
}


def read_only_runs(folder):
    """A run, ro, trained on a corpus in folder's base; then each command of READ_ONLY with its folder mounted
    read-only -> the folders, and {case: (the finished process, the run's files before and after, .tmp files)}."""
    if not can_unshare():
        return None
    write_corpus(folder / "corpus.txt")
    train(folder, "--run=ro")
    base = folder / "base"
    values = {"run": base / "runs" / "ro", "runs": base / "runs", "corpus": folder / "corpus.txt",
              "tokenizers": base / "tokenizers"}
    results = {}
    for case, (words, mounted, _, _) in READ_ONLY.items():
        before = untouched(values["run"])
        result = read_only_run([word.format(**values) for word in words], str(mounted).format(**values),
                               train_env(folder))
        results[case] = result, before, untouched(values["run"]), list(base.rglob("*.tmp"))
    return values, results


@pytest.mark.slow
@pytest.mark.skipif(not can_unshare(), reason="no mount namespace here (unshare -rm)")
@beforehand(read_only_runs)
@pytest.mark.parametrize("case", READ_ONLY)
def test_a_read_only_folder_stops_the_command_before_its_work_in_one_line(case):
    """Status 1 (2 for a file named as the export's folder), one line naming the folder, before the work: no
    depth evaluated, no data prepared, no tokenizer trained; nothing changed, no temporary file left."""
    _, _, status, words = READ_ONLY[case]
    values, results = awaited(read_only_runs)
    result, before, after, temporary = results[case]
    err = result.stderr.strip()
    assert result.returncode == status and len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    assert carries(err, *[word.format(**values) for word in words]), err
    assert not re.search(r"^(T =|data:|Training)", result.stdout, re.M), result.stdout  # the work's lines
    assert after == before
    assert not temporary
