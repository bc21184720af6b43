"""Tests for common.py: the base directory, the GPU peak table, the matmul FLOPs executed (against
FlopCounterMode), reading a checkpoint that is missing or damaged."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import common
from common import matmul_flops_per_token
from depths import sample_depths
from model import Parcae, ParcaeConfig


def test_the_base_directory_is_the_variable_else_under_home(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(tmp_path / "custom"))
    assert common.get_base_dir() == tmp_path / "custom"
    assert (tmp_path / "custom").is_dir()
    monkeypatch.delenv("NANOPARCAE_BASE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert common.get_base_dir() == tmp_path / "home" / ".cache" / "nanoparcae"


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


def test_a_missing_or_damaged_checkpoint_is_named_with_what_to_do(tmp_path):
    config = ParcaeConfig(vocab_size=97, seq_len=16, n_prelude=1, n_recur=1, n_coda=1, d_model=64, head_dim=32)
    whole = tmp_path / "ckpt_000002.pt"
    common.save_checkpoint(whole, Parcae(config), step=2)
    assert common.read_checkpoint(whole)["step"] == 2
    with pytest.raises(FileNotFoundError, match="ckpt_000001.pt does not exist"):
        common.read_checkpoint(tmp_path / "ckpt_000001.pt")
    for damaged, content in (("truncated.pt", whole.read_bytes()[:1000]), ("noise.pt", b"not a checkpoint")):
        (tmp_path / damaged).write_bytes(content)
        with pytest.raises(ValueError) as err:
            common.read_checkpoint(tmp_path / damaged)
        message = str(err.value)
        assert message.startswith(f"checkpoint {tmp_path / damaged} is truncated or unreadable (") and \
            message.endswith("remove it to continue from the run's previous checkpoint (or start over), or restore it")
        assert "\n" not in message


def test_the_state_norm_limit_stops_a_run_only_where_the_dtype_loses_the_input():
    """bfloat16: 1e4 is a bad step; float32 resolves 2^16 times more, so 1e4 there is neither a stop nor a
    warning; a limit given stops a run in any dtype."""
    assert common.state_norm_limit("bfloat16") == (1e4, True)
    limit, stops = common.state_norm_limit("float32")
    assert not stops and limit == 1e4 * 2 ** 16 and limit > 1.9e4  # the float32 run peaked at 1.9e4
    assert common.state_norm_limit("float32", 50.0) == (50.0, True)
    assert common.state_norm_limit("bfloat16", 50.0) == (50.0, True)
