"""Tests for common.py: the base directory rule data.py repeats, and the GPU peak table; and what the
training script's imports pull in."""

import subprocess
import sys
from pathlib import Path

import torch

import common
import data


def test_data_caches_under_the_base_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(tmp_path / "custom"))
    assert data.cache_dir() == common.get_base_dir() == tmp_path / "custom"
    assert (tmp_path / "custom").is_dir()
    monkeypatch.delenv("NANOPARCAE_BASE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data.cache_dir() == common.get_base_dir() == tmp_path / "home" / ".cache" / "nanoparcae"


def test_peak_flops_only_for_listed_gpus(monkeypatch):
    assert common.peak_bf16_flops("cpu") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert common.peak_bf16_flops(torch.device("cuda", 0)) == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA GeForce RTX 3090")
    assert common.peak_bf16_flops(torch.device("cuda", 0)) is None


def test_the_training_scripts_imports_never_load_hub():
    """train.py imports common, data, model, optim and eval_core's evaluators: none of them loads hub.py."""
    code = "import sys, common, data, model, optim, eval_core; print('hub' in sys.modules)"
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert result.stdout.strip() == "False", result.stderr
