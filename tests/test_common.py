"""Tests for common.py: the base directory rule data.py repeats, the GPU peak table, the matmul FLOPs executed
(against FlopCounterMode), checkpoints written under the injection's old parameter names."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import common
import data
from common import matmul_flops_per_token
from depths import sample_depths
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


def counted_flops_per_token(model, x, T, backward):
    """FlopCounterMode's count per token. Attention runs on SDPA's math path: the CPU flash kernel has no FLOP
    formula (it counts 0); the math path's bmm are counted in full over S x S, the causal mask not halving them."""
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        if backward:
            model(x, x, T=T).backward()
        else:
            with torch.no_grad():
                model(x, T=T)
    return counter.get_total_flops() / x.numel()


@pytest.mark.parametrize("injection", ["diagonal", "concat", "add", "none"])
def test_matmul_flops_per_token_is_what_flop_counter_mode_counts(injection):
    """Exact, with causal attention counted in full (the function's convention): a training forward +
    backward at a fixed (n, k) and at a per-sequence draw (the loop on a shrinking prefix of the batch), and an
    eval forward at T."""
    torch.manual_seed(0)
    config = ParcaeConfig(vocab_size=97, seq_len=32, n_prelude=1, n_recur=2, n_coda=1, d_model=64, head_dim=32,
                          mu_rec=4, injection=injection)
    model = Parcae(config).train()
    x = torch.randint(0, 97, (6, 32))
    draw = sample_depths(model.config, 6, torch.Generator().manual_seed(3))
    assert len((draw[0] + draw[1]).unique()) > 2  # the sequences loop different depths
    for n, k in [(2, 2), draw]:
        assert counted_flops_per_token(model, x, (n, k), True) == matmul_flops_per_token(model, n, k), (n, k)
    model.eval()
    assert counted_flops_per_token(model, x, 5, False) == matmul_flops_per_token(model, 5, 0, backward=False)


def test_matmul_flops_differ_from_the_papers_c_by_lookups_vectors_and_the_head():
    """At the 140M and T = (mu_rec - mu_bwd, mu_bwd), the paper's C (METHOD.md §2) less the executed count is
    exactly what C counts as matmuls that are not (the value-embedding tables, the norm and A_log / dt_bias
    vectors) less the tied head's 6 d V, which C leaves out."""
    with torch.device("meta"):
        model = Parcae(ParcaeConfig.from_depth(6, mu_rec=8))
    c = model.config
    n, k = c.mu_rec - c.mu_bwd, c.mu_bwd

    def vectors(module):
        return sum(p.numel() for p in module.parameters() if p.ndim == 1)

    tables, core_vectors = sum(p.numel() for p in model.value_embeds.parameters()), vectors(model.recur)
    assert model.flops_per_token() - matmul_flops_per_token(model, n, k) == \
        6 * (tables + vectors(model) - core_vectors) + (2 * (n + k) + 4 * k) * core_vectors \
        - 6 * c.d_model * c.padded_vocab_size


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
