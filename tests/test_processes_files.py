"""Tests for the processes, files, command and checkpoint modules: the base directory, the GPU peak table, reading a
checkpoint that is missing or damaged."""

import json

import pytest
import torch

from nanoparcae import checkpoint, command, files, ranks
from conftest import carries, raises_naming
from model import Parcae, ParcaeConfig


def test_the_base_directory_is_the_variable_else_under_home(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(tmp_path / "custom"))
    assert files.get_base_dir() == tmp_path / "custom"
    assert (tmp_path / "custom").is_dir()
    monkeypatch.delenv("NANOPARCAE_BASE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert files.get_base_dir() == tmp_path / "home" / ".cache" / "nanoparcae"


def test_peak_flops_only_for_listed_gpus(monkeypatch):
    assert ranks.peak_bf16_flops("cpu") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert ranks.peak_bf16_flops(torch.device("cuda", 0)) == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA GeForce RTX 3090")
    assert ranks.peak_bf16_flops(torch.device("cuda", 0)) is None


def test_a_missing_or_damaged_checkpoint_is_named_with_what_to_do(tmp_path):
    config = ParcaeConfig(vocab_size=97, seq_len=16, n_prelude=1, n_recur=1, n_coda=1, d_model=64, head_dim=32)
    whole = tmp_path / "ckpt_000002.pt"
    checkpoint.save_checkpoint(whole, Parcae(config), step=2)
    assert checkpoint.read_checkpoint(whole)["step"] == 2
    with raises_naming(FileNotFoundError, "ckpt_000001.pt"):
        checkpoint.read_checkpoint(tmp_path / "ckpt_000001.pt")
    for damaged, content, what in (("truncated.pt", whole.read_bytes()[:1000], "truncated"),
                                   ("noise.pt", b"not a checkpoint", "nanoparcae")):
        (tmp_path / damaged).write_bytes(content)
        with pytest.raises(ValueError) as err:
            checkpoint.read_checkpoint(tmp_path / damaged)
        message = str(err.value)
        assert carries(message, str(tmp_path / damaged), what) and "remove" not in message, message  # not a run's
        assert "\n" not in message



def test_a_device_is_checked_once_for_every_cli():
    assert ranks.parse_device("cpu") == torch.device("cpu")
    for name in ("gpu", "mps"):
        with pytest.raises(ValueError) as err:
            ranks.parse_device(name)
        assert carries(str(err.value), f"--device={name}", "cpu", "cuda"), err.value  # the value, then the choices
    if not torch.cuda.is_available():
        with pytest.raises(ValueError) as err:
            ranks.parse_device("cuda")
        assert carries(str(err.value), "--device=cuda", "--device=cpu"), err.value  # no GPU here: the fix


def test_every_reader_of_metrics_skips_a_torn_last_line(tmp_path):
    """A killed run leaves a torn last line: the run's own reader, the scaling fit and gpu_check skip it alike."""
    from experiments import gpu_check, scaling
    from nanoparcae.metrics import Metrics, read_metrics
    whole = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 2, "val_loss_T8": 2.6}]
    torn = "".join(f"{json.dumps(record)}\n" for record in whole) + '{"step": 3, "lo'
    for folder in (checkpoint.run_dir("gpu_check_torn"), checkpoint.run_dir("scaled")):
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text(torn)
    assert read_metrics(checkpoint.run_dir("scaled") / "metrics.jsonl") == whole
    assert gpu_check.run_records(checkpoint.run_dir(), "torn") == whole
    assert scaling.final_eval({"name": "scaled", "steps": 2, "mu_rec": 8}) == whole[2]
    Metrics(checkpoint.run_dir("scaled"), step=1).file.close()  # a resume from step 1 keeps what came before it
    assert read_metrics(checkpoint.run_dir("scaled") / "metrics.jsonl") == whole[:1]


def refusing(err):
    """A command's main() that raises err."""
    def main(argv=None):
        raise err
    return main


def test_run_command_prints_a_refusal_once_a_node_and_exits_with_its_status(monkeypatch, capsys):
    monkeypatch.setattr(command.time, "sleep", lambda seconds: None)
    for local_rank, printed in (("0", True), ("3", False), (None, True)):
        if local_rank is None:
            monkeypatch.delenv("LOCAL_RANK", raising=False)
        else:
            monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(SystemExit) as exit_info:
            command.run_command(refusing(command.EnvironmentFailure("the disk is full")))
        assert exit_info.value.code == 1
        assert (capsys.readouterr().err == "error: the disk is full\n") == printed


def test_run_command_gives_each_kind_of_error_its_status_and_raises_the_rest(capsys):
    for err, status in ((ValueError("--depth=0 must be positive"), 2), (FileNotFoundError("no shard"), 2),
                        (command.EnvironmentFailure("the disk is full"), 1), (KeyboardInterrupt(), 130)):
        with pytest.raises(SystemExit) as exit_info:
            command.run_command(refusing(err))
        assert exit_info.value.code == status and capsys.readouterr().err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_info:
        command.run_command(lambda argv: 3)
    assert exit_info.value.code == 3
    with pytest.raises(KeyError):  # a bug keeps its traceback
        command.run_command(refusing(KeyError("step")))


def test_ddp_is_told_not_to_sync_buffers_in_its_torch_release_s_words(monkeypatch):
    assert ranks.no_buffer_sync() == {"forward_sync_buffers": False}  # torch 2.13 and later

    class OlderDDP:  # torch 2.11's DistributedDataParallel knows only the old keyword
        def __init__(self, module, device_ids=None, broadcast_buffers=True):
            pass
    monkeypatch.setattr(ranks, "DistributedDataParallel", OlderDDP)
    assert ranks.no_buffer_sync() == {"broadcast_buffers": False}


def test_two_writers_of_one_json_never_share_its_temporary_file(tmp_path, monkeypatch):
    """A second writer of the same file (another eval of the run) finishes while the first is between its write and
    its rename: both succeed, and the file holds whole JSON, the last rename's."""
    path, write_text = tmp_path / "result.json", type(tmp_path).write_text
    others = []

    def write_then_another_writes(self, text):
        write_text(self, text)
        if not others:
            others.append(self)
            files.write_json(path, {"writer": 2})
    monkeypatch.setattr(type(tmp_path), "write_text", write_then_another_writes)
    files.write_json(path, {"writer": 1})
    assert json.loads(path.read_text()) == {"writer": 1} and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_an_empty_base_dir_setting_is_refused_for_every_command(monkeypatch, tmp_path):
    """An empty NANOPARCAE_BASE_DIR names itself, rather than writing into the current folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", "")
    with pytest.raises(ValueError, match="NANOPARCAE_BASE_DIR is set but empty"):
        files.get_base_dir()
    assert list(tmp_path.iterdir()) == []


def test_the_json_reader_checks_the_type_at_the_top(tmp_path):
    """A JSON file holding a list where the project writes a dict is named in one line."""
    path = tmp_path / "result.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not the dict"):
        files.read_json(path)
    path.write_text('{"a": 1}')
    assert files.read_json(path) == {"a": 1}
