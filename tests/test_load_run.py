"""Tests for nanoparcae.checkpoint.load_run, the one loader of a run: every command that loads a run finds it, and its tokenizer,
after the base folder has moved; and the ways a checkpoint or its tokenizer can be wrong, each in one line."""

import shutil

import pytest
import torch

from nanoparcae.checkpoint import load_run
from conftest import Started, train, train_env


@pytest.fixture(scope="module")
def moved(corpus):
    """A tiny run trained under corpus/base, then the base folder moved to corpus/moved -> the new base."""
    train(corpus, "--max_tokens=512", "--run=tiny")
    shutil.move(corpus / "base", corpus / "moved")
    return corpus / "moved"


def test_every_command_that_loads_a_run_works_after_the_base_folder_moved(corpus, moved):
    """README: moving NANOPARCAE_BASE_DIR moves the runs. The checkpoint records the old tokenizer path; each command
    finds the tokenizer by its key under the new base folder. The four run at once, one thread each."""
    ckpt = moved / "runs" / "tiny" / "ckpt_000002.pt"
    commands = {
        "sample": ["sample.py", "--prompt=the loop", "--max_new_tokens=4"],
        "eval_core": ["eval_core.py", "--eval", "bpb", "--T", "1,2", "--val_tokens=64", "--batch_size=2"],
        "export": ["-m", "interop.hub", "export", "tiny", str(corpus / "exported")],
        "bench": ["-m", "experiments.bench", "--ckpt", str(ckpt), "--rows", "5", "--repeats", "1", "--new_tokens", "4"],
    }
    env = train_env(corpus, base=moved)
    running = {name: Started(args, env) for name, args in commands.items()}
    out = {}
    for name, process in running.items():
        out[name], err = process.communicate(timeout=300)
        assert process.returncode == 0, f"{name}: {err[-3000:]}"
    assert not (corpus / "base").exists()
    assert out["sample"].startswith("the loop")
    assert (moved / "runs" / "tiny" / "ckpt_000002_bpb_T1-2.json").is_file()
    assert {"config.json", "model.pt", "tokenizer.json"} <= {p.name for p in (corpus / "exported").iterdir()}
    assert "checkpoint tiny/ckpt_000002.pt" in out["bench"]  # the run's checkpoint, not the untrained stand-in


def test_a_wrong_checkpoint_or_tokenizer_is_one_line(moved, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(moved))
    path = moved / "runs" / "tiny" / "ckpt_000002.pt"
    model, tokenizer, ckpt, found = load_run("tiny")
    assert found == path and not model.training and tokenizer.vocab_size == model.config.vocab_size == 320
    assert load_run(path)[3] == load_run(None)[3] == path  # a file, a run's name, the newest run

    def message(ckpt_or_run, error=ValueError):
        with pytest.raises(error) as err:
            load_run(ckpt_or_run)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert message(path.parent, FileNotFoundError) == (f"{path.parent} is a folder, not a checkpoint file; pass a "
                                                       f"checkpoint file such as its newest, {path}, or the run's "
                                                       f"name, tiny")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    assert message(tmp_path / "other.pt").startswith(f"checkpoint {tmp_path / 'other.pt'} is not a nanoparcae "
                                                     f"checkpoint (KeyError: 'config')")
    torch.save({**ckpt, "tokenizer_dir": str(tmp_path / "gone" / "files-0-320")}, tmp_path / "no_tokenizer.pt")
    assert message(tmp_path / "no_tokenizer.pt", FileNotFoundError).endswith(
        f"recreate it with `python -m nanoparcae.dataset tokenizer --data={ckpt['args']['data']} --vocab_size=320`")
    smaller = {**ckpt, "config": {**ckpt["config"], "vocab_size": 300}}  # padded to 320 as well: the same weights
    torch.save(smaller, tmp_path / "smaller.pt")
    assert message(tmp_path / "smaller.pt").endswith("has 320 tokens, the model 300: they are not from the same run")
