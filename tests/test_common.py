"""Tests for common.py: the base directory rule data.py repeats, the GPU peak table, checkpoints written under the
injection's old parameter names."""

import torch

import common
import data
from model import Parcae, ParcaeConfig
from optim import build_optimizer


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


def test_a_checkpoint_with_the_old_parameter_names_loads_and_resumes(tmp_path):
    """Before the injection was a submodule, its parameters were Parcae's own: A_log and dt_bias first in the
    parameter order (so first in the AdamW group), B.weight among the last. Such a checkpoint loads with the
    same logits, and its optimiser state lands on the same parameters."""
    torch.manual_seed(0)
    config = ParcaeConfig(vocab_size=97, seq_len=16, n_prelude=1, n_recur=1, n_coda=1, d_model=64, head_dim=32,
                          mu_rec=2)
    model = Parcae(config)
    optimizer = build_optimizer(model, adamw_lr=1e-2)
    idx = torch.randint(0, 97, (2, 16))
    model(idx, idx).backward()
    optimizer.step()
    old = {name.removeprefix("injection."): tensor for name, tensor in model.state_dict().items()}
    assert list(old).count("A_log") == list(old).count("B.weight") == 1
    saved = optimizer.state_dict()
    adamw = saved["param_groups"][0]
    moved = [i for i, name in enumerate(adamw["names"]) if name in ("injection.A_log", "injection.dt_bias")]
    order = moved + [i for i in range(len(adamw["names"])) if i not in moved]  # the old order: those two first
    adamw["params"] = [adamw["params"][i] for i in order]
    adamw["names"] = [adamw["names"][i].removeprefix("injection.") for i in order]
    torch.save({"config": vars(config), "model": old, "optimizer": saved}, tmp_path / "ckpt_000001.pt")

    loaded, ckpt = common.load_checkpoint(tmp_path / "ckpt_000001.pt")
    h0 = torch.randn(2, 16, 64)
    assert torch.equal(loaded(idx, h0=h0), model.eval()(idx, h0=h0))
    resumed = build_optimizer(loaded, adamw_lr=1e-2)
    common.load_optimizer_state(resumed, common.read_checkpoint(tmp_path / "ckpt_000001.pt")["optimizer"])
    ours = dict(loaded.named_parameters())
    for name, param in model.named_parameters():
        for key, value in optimizer.state[param].items():
            assert torch.equal(torch.as_tensor(resumed.state[ours[name]][key]), torch.as_tensor(value)), (name, key)


def test_the_state_norm_limit_stops_a_run_only_where_the_dtype_loses_the_input():
    """bfloat16: 1e4 is a bad step; float32 resolves 2^16 times more, so 1e4 there is neither a stop nor a
    warning; a limit given stops a run in any dtype."""
    assert common.state_norm_limit("bfloat16") == (1e4, True)
    limit, stops = common.state_norm_limit("float32")
    assert not stops and limit == 1e4 * 2 ** 16 and limit > 1.9e4  # the float32 run peaked at 1.9e4
    assert common.state_norm_limit("float32", 50.0) == (50.0, True)
    assert common.state_norm_limit("bfloat16", 50.0) == (50.0, True)
