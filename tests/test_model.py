"""Tests for model.py: METHOD.md §1 sizes, the stable injection, per-sequence depths, truncated backprop."""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from model import SAMPLINGS, mean_steps, sample_depths, split_depths
from engine import KVCache
from conftest import raises_naming
from model import Parcae, ParcaeConfig, initial_state, stability_diagnostics, trunc_orthogonal_

# METHOD.md §1: (depth, Transformer params, Parcae params), vocab 32,768
PAPER_SIZES = [
    (6, 143_141_184, 144_323_136),
    (12, 385_903_104, 388_003_328),
    (18, 773_375_040, 776_655_680),
    (24, 1_333_868_544, 1_338_591_744),
]


def tiny_config(**overrides):
    kw = dict(vocab_size=97, seq_len=32, n_prelude=1, n_recur=1, n_coda=1, d_model=64, head_dim=32, mu_rec=4)
    return ParcaeConfig(**{**kw, **overrides})


def randomized(model, seed=0):
    """Give every weight a non-trivial value (the zero-init projections would hide bugs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in ("injection.A_log", "injection.dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model


@pytest.mark.parametrize("depth,n_transformer,n_parcae", PAPER_SIZES)
def test_paper_parameter_counts(depth, n_transformer, n_parcae):
    with torch.device("meta"):
        transformer = Parcae(ParcaeConfig.from_depth(depth, injection="none"))
        parcae = Parcae(ParcaeConfig.from_depth(depth, injection="diagonal"))
    assert transformer.num_params() == n_transformer
    assert parcae.num_params() == n_parcae
    d = parcae.config.d_model
    assert n_parcae - n_transformer == 2 * d * d + 3 * d


def test_config_errors_are_clear():
    with raises_naming(ValueError, "depth=7"):
        ParcaeConfig.from_depth(7)
    with raises_naming(ValueError, "d_model=100", "head_dim=128"):
        ParcaeConfig.from_depth(6, d_model=100)
    with raises_naming(ValueError, "injection='diag'"):
        ParcaeConfig.from_depth(6, injection="diag")
    assert ParcaeConfig.from_depth(6, mu_rec=7).mu_bwd == 4
    assert ParcaeConfig.from_depth(24).d_model == 1536


def test_initialisation_matches_spec():
    model = Parcae(tiny_config())
    A_bar, delta = model.injection.discretize()
    assert torch.allclose(A_bar, torch.full_like(A_bar, math.sqrt(1 / 5)), atol=1e-6)  # 0.4472
    assert torch.allclose(delta, torch.full_like(delta, 0.8047), atol=1e-4)
    assert torch.equal(model.injection.B.weight, torch.eye(64))
    assert model.spectral_radius() == pytest.approx(0.4472, abs=1e-4)
    for block in [*model.prelude, *model.recur, *model.coda]:
        assert block.attn.c_proj.weight.abs().max() == 0 and block.mlp.c_proj.weight.abs().max() == 0
    std = math.sqrt(2 / (5 * 64))
    assert model.prelude[0].attn.c_q.weight.std().item() == pytest.approx(std, rel=0.1)
    C = model.C_proj.weight
    assert torch.allclose(C @ C.t(), torch.eye(64) * 2 / 5, atol=1e-5)  # orthogonal, gain sqrt(2/5)


def test_init_is_truncated_orthogonal_with_the_authors_gain():
    torch.manual_seed(0)
    model = Parcae(tiny_config(d_model=128, head_dim=32))
    d, std = 128, math.sqrt(2 / (5 * 128))
    gain = std * math.sqrt(d)
    # square matrices: every singular value equals the gain (an i.i.d. draw spreads them over ~[0, 2 gain])
    for W in (model.recur[0].attn.c_q.weight, model.coda[0].attn.c_v.weight, model.C_proj.weight):
        sv = torch.linalg.svdvals(W)
        assert torch.allclose(sv, torch.full_like(sv, gain), rtol=1e-4), (sv.min(), sv.max())
    # rectangular (4d x d MLP input, padded vocab x d embedding): semi-orthogonal, W^T W = gain^2 I
    for W in (model.prelude[0].mlp.c_fc.weight, model.wte.weight):
        g = std * math.sqrt(max(W.shape))
        assert torch.allclose(W.t() @ W, torch.eye(d) * g * g, atol=1e-5)
    # a wide matrix is orthogonal along its rows; per-entry std stays sqrt(2/(5d)) in every shape
    wide = trunc_orthogonal_(torch.empty(32, 256), std)
    assert torch.allclose(wide @ wide.t(), torch.eye(32) * std * std * 256, atol=1e-5)
    for W in (wide, model.prelude[0].mlp.c_fc.weight, model.wte.weight, model.recur[0].attn.c_k.weight):
        assert W.std().item() == pytest.approx(std, rel=0.05)
        assert W.mean().abs().item() < 0.1 * std
    iid = torch.nn.init.trunc_normal_(torch.empty(d, d), std=std, a=-3 * std, b=3 * std)
    assert torch.linalg.svdvals(iid).min() < 0.5 * gain  # the old init, for contrast


def test_variants_built_at_one_seed_share_every_tensor_they_have_in_common():
    """Paired runs: Parcae, add, concat and the Transformer at seed 0 start from the same weights in every module
    they share, though concat and Parcae build parameters the others lack; another seed gives other weights."""
    models = {}
    for injection in ("diagonal", "add", "concat", "none"):
        torch.manual_seed(0)
        models[injection] = dict(Parcae(tiny_config(injection=injection)).named_parameters())
    parcae = models["diagonal"]
    for injection, params in models.items():
        shared = params.keys() & parcae.keys()
        assert len(shared) >= len(params) - 1  # all but concat's adapter
        for name in shared:
            assert torch.equal(params[name], parcae[name]), (injection, name)
    assert "C_proj.weight" in models["concat"] and "injection.adapter.weight" not in parcae
    torch.manual_seed(1)
    other = dict(Parcae(tiny_config()).named_parameters())
    assert not torch.equal(other["wte.weight"], parcae["wte.weight"])
    assert not torch.equal(other["value_embeds.2.weight"], parcae["value_embeds.2.weight"])


def test_spectral_radius_below_one_for_extreme_parameters():
    model = Parcae(tiny_config())
    extremes = [-1e4, -100.0, -20.0, -5.0, 0.0, 5.0, 20.0, 100.0, 1e4]
    with torch.no_grad():
        for a in extremes:
            for dt in extremes:
                model.injection.A_log.fill_(a)
                model.injection.dt_bias.fill_(dt)
                A_bar = model.injection.A_bar()
                assert torch.isfinite(A_bar).all() and (A_bar >= 0).all() and (A_bar < 1).all(), (a, dt)
                assert model.spectral_radius() < 1
        model.injection.A_log.copy_(torch.randn(64) * 30)
        model.injection.dt_bias.copy_(torch.randn(64) * 30)
        assert model.spectral_radius() < 1


def test_add_and_concat_spectral_radius():
    assert Parcae(tiny_config(injection="add")).spectral_radius() == 1.0
    model = Parcae(tiny_config(injection="concat"))
    state_half = model.injection.adapter.weight[:, :64].detach().double().numpy()
    import numpy as np
    expected = np.abs(np.linalg.eigvals(state_half)).max()
    assert model.spectral_radius() == pytest.approx(expected, rel=1e-4)


def test_depth_sampling():
    gen = torch.Generator().manual_seed(0)
    config = tiny_config(mu_rec=8)
    n, k = (torch.cat(x) for x in zip(*[sample_depths(config, 64, gen) for _ in range(50)]))
    depths = n + k
    assert depths.min() >= 1 and abs(depths.float().mean().item() - 8) < 0.2
    assert torch.equal(k, depths.clamp(max=4))  # the last min(T, mu_bwd) steps carry the gradient
    assert len(sum(sample_depths(config, 32, gen)).unique()) > 1  # per sequence: they differ
    for scheme in SAMPLINGS:
        if scheme != "per_sequence":  # every other scheme draws once per micro-batch
            n, k = sample_depths(tiny_config(mu_rec=8, sampling=scheme), 32, gen)
            assert len(n.unique()) == 1 and len(k.unique()) == 1, scheme
    n, k = sample_depths(tiny_config(mu_rec=8, sampling="per_batch"), 32, gen)
    assert torch.equal(k, n.clamp(max=4))  # the authors' per-batch: T without grad, then min(T, mu_bwd) with


def poisson_mean(rate, f):
    """E[f(X)], X ~ Poisson(rate), summed exactly over the pmf."""
    return sum(f(j) * math.exp(-rate + j * math.log(rate) - math.lgamma(j + 1)) for j in range(200))


@pytest.mark.parametrize("mu_rec,mu_bwd", [(8, 4), (3, 2)])
def test_each_sampler_has_the_mean_depths_its_help_states(mu_rec, mu_bwd):
    T = poisson_mean(mu_rec, lambda j: max(1, j))  # E[max(1, Poisson(mu_rec))] = mu_rec + exp(-mu_rec)
    assert T == pytest.approx(mu_rec + math.exp(-mu_rec))
    k_trunc = poisson_mean(mu_rec, lambda j: min(max(1, j), mu_bwd))
    rest = mu_rec - mu_bwd
    expected = {  # scheme: (mean executed n + k, mean backpropagated k), the formulas in SAMPLINGS
        "per_sequence": (T, k_trunc), "per_batch": (T + k_trunc, k_trunc), "per_batch_split": (T, k_trunc),
        "poisson_unbounded": (mu_rec + 0.5, mu_bwd + 0.5), "poisson_fill": (mu_rec, mu_bwd),
        "poisson_full": (T, T), "fixed": (mu_rec, min(mu_rec, mu_bwd)),
    }
    assert set(expected) == set(SAMPLINGS)
    for scheme, (executed, backprop) in expected.items():
        gen = torch.Generator().manual_seed(0)
        config = tiny_config(mu_rec=mu_rec, mu_bwd=mu_bwd, sampling=scheme)
        draws = [sample_depths(config, 8, gen) for _ in range(4000)]
        n, k = (torch.cat(x).double() for x in zip(*draws))
        assert (n >= 0).all() and (k >= 1).all(), scheme
        if scheme == "poisson_full":
            assert (n == 0).all()
        if scheme in ("poisson_unbounded", "poisson_fill"):
            assert n.mean().item() == pytest.approx(rest, abs=0.1), scheme
        assert (n + k).mean().item() == pytest.approx(executed, abs=0.1), scheme
        assert k.mean().item() == pytest.approx(backprop, abs=0.06), scheme
        assert mean_steps(config) == pytest.approx((executed - backprop, backprop), rel=1e-12), scheme


def test_an_n_k_draw_runs_n_then_k_steps():
    torch.manual_seed(0)
    model = randomized(Parcae(tiny_config(mu_rec=4))).eval()
    idx, h0 = torch.randint(0, 97, (3, 8)), torch.randn(3, 8, 64) * 0.1
    pair = (torch.tensor([5, 2, 0]), torch.tensor([2, 2, 1]))
    all_without_grad = (torch.tensor([7, 4, 1]), torch.tensor([0, 0, 0]))
    torch.testing.assert_close(model(idx, depths=pair, h0=h0), model(idx, depths=all_without_grad, h0=h0))
    # each refusal names the argument at fault
    with raises_naming(ValueError, "depths"):
        model(idx, depths=(torch.tensor([5, 0, 0]), torch.tensor([1, 3, 3])), h0=h0)
    with raises_naming(ValueError, "depths", "[0, 0, 0]", "[0, 0, 0]"):
        model(idx, depths=(0, 0))
    with raises_naming(ValueError, "depths"):
        model(idx, depths=(torch.tensor([5, 5, 1]), torch.tensor([1, 0, 0])))
    with raises_naming(ValueError, "T", "depths"):
        model(idx, T=3, depths=pair)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("injection", ["diagonal", "concat", "add"])
def test_per_sequence_depths_equal_running_each_sequence_alone(injection, training):
    torch.manual_seed(0)
    model = randomized(Parcae(tiny_config(injection=injection, mu_rec=4)))
    model.train(training)
    idx = torch.randint(0, 97, (4, 16))
    h0 = torch.randn(4, 16, 64) * 0.1
    depths = torch.tensor([1, 3, 7, 2])  # mixed no-grad (n) and grad (k <= mu_bwd = 2) phases
    batched = model(idx, depths=split_depths(depths, model.config.mu_bwd, training), h0=h0)
    for i in range(4):
        alone = model(idx[i:i + 1], T=int(depths[i]), h0=h0[i:i + 1])
        torch.testing.assert_close(batched[i:i + 1], alone, rtol=1e-5, atol=1e-5)
    # and depth matters, so the check above could fail
    assert not torch.allclose(model(idx, T=1, h0=h0), model(idx, T=3, h0=h0), atol=1e-3)


def saved_bytes_for_backward(model, idx, targets, T):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, targets, T=T, h0_generator=torch.Generator().manual_seed(0))
    return total, loss


def test_truncated_backprop_keeps_memory_flat_in_T():
    torch.manual_seed(0)
    model = randomized(Parcae(tiny_config(mu_rec=8, mu_bwd=4))).train()
    idx, targets = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    bytes_8, _ = saved_bytes_for_backward(model, idx, targets, 8)
    bytes_32, loss = saved_bytes_for_backward(model, idx, targets, 32)
    bytes_4, _ = saved_bytes_for_backward(model, idx, targets, 4)
    bytes_2, _ = saved_bytes_for_backward(model, idx, targets, 2)
    assert bytes_8 == bytes_32 == bytes_4
    assert bytes_2 < bytes_4  # the count does see the recurrent steps
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_none_is_the_blocks_run_once_in_order():
    torch.manual_seed(0)
    model = randomized(Parcae(tiny_config(injection="none", n_prelude=2, n_recur=2, n_coda=1))).eval()
    assert model.C_proj is None and model.prelude_norm is None and model.spectral_radius() is None
    idx = torch.randint(0, 97, (2, 12))
    x = model.wte(idx)
    cos, sin = model.rope_cos[:, :12], model.rope_sin[:, :12]
    for i, block in enumerate([*model.prelude, *model.recur, *model.coda]):
        ve = model.value_embeds[str(i)](idx) if i in model.ve_layers else None
        x = block(x, ve, cos, sin)
    expected = (model.norm_f(x) @ model.wte.weight.t())[..., :97]
    torch.testing.assert_close(model(idx), expected)
    torch.testing.assert_close(model(idx, T=5), expected)
    assert model.ve_layers == [0, 2, 4]  # alternating, the last layer always


def test_stability_diagnostics():
    torch.manual_seed(0)
    model = randomized(Parcae(tiny_config())).train()
    idx = torch.randint(0, 97, (3, 8))
    h0 = torch.randn(3, 8, 64) * 0.1
    e = torch.randn(3, 8, 64)
    cos, sin = model.rope_cos[:, :8], model.rope_sin[:, :8]

    def run(depths):  # -> (h_T, h_{T-1}) at training's split of each depth into no-grad and grad steps
        n, k = split_depths(torch.tensor(depths), model.config.mu_bwd, training=True)
        return model.recurrence(h0, e, n, k, {}, cos, sin)

    with torch.no_grad():
        h2 = run([2, 2, 2])[0]
        h3, h3_prev = run([3, 3, 3])
        stats = stability_diagnostics(h3, h3_prev)
        mixed = stability_diagnostics(*run([2, 3, 1]))
        h1 = run([1, 1, 1])[0]
    norm3 = h3.norm(dim=-1).mean()
    assert stats["h_norm"].item() == pytest.approx(norm3.item(), rel=1e-5)
    assert stats["update_ratio"].item() == pytest.approx(((h3 - h2).norm(dim=-1).mean() / norm3).item(), rel=1e-5)
    # per-sequence depths: each sequence's own last update (h_T - h_{T-1} at its own T)
    h_T = torch.stack([h2[0], h3[1], h1[2]])
    h_before = torch.stack([h1[0], h2[1], h0[2]])
    norm = h_T.norm(dim=-1).mean()
    assert mixed["h_norm"].item() == pytest.approx(norm.item(), rel=1e-5)
    assert mixed["update_ratio"].item() == pytest.approx(((h_T - h_before).norm(dim=-1).mean() / norm).item(),
                                                         rel=1e-5)
    stats = {}
    loss = model(idx, idx, h0=h0, depth_generator=torch.Generator().manual_seed(0), diagnostics=stats)
    assert math.isfinite(stats["h_norm"].item()) and loss.requires_grad
    assert torch.equal(loss, model(idx, idx, h0=h0, depth_generator=torch.Generator().manual_seed(0)))
    stats = {}
    Parcae(tiny_config(injection="none"))(idx, diagnostics=stats)
    assert stats == {"h_norm": None, "update_ratio": None}


def test_injection_is_a_plain_submodule_and_follows_conversion():
    for injection, names in (("diagonal", ["injection.A_log", "injection.dt_bias", "injection.B.weight"]),
                             ("concat", ["injection.adapter.weight"])):
        model = Parcae(tiny_config(injection=injection))
        assert [name for name, _ in model.named_parameters() if name.startswith("injection.")] == names
        assert not [name for name, _ in model.named_parameters() if "." not in name]  # nothing on Parcae itself
        torch.__future__.set_overwrite_module_params_on_conversion(True)  # .to() makes new parameter objects
        try:
            model = model.to(torch.float64)
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(False)
        params = dict(model.named_parameters())
        for name, param in model.injection.named_parameters():
            assert param is params[f"injection.{name}"] and param.dtype == torch.float64, name


def test_depth_generator_decides_the_sampled_depths():
    torch.manual_seed(0)
    model = randomized(Parcae(tiny_config(mu_rec=6))).train()
    idx = torch.randint(0, 97, (8, 8))
    h0 = torch.randn(8, 8, 64) * 0.1
    loss = model(idx, idx, h0=h0, depth_generator=torch.Generator().manual_seed(3))
    n, k = sample_depths(model.config, 8, torch.Generator().manual_seed(3))
    assert len((n + k).unique()) > 1
    assert loss.item() == model(idx, idx, h0=h0, depths=(n, k)).item()
    assert loss.item() == model(idx, idx, h0=h0, depth_generator=torch.Generator().manual_seed(3)).item()


def test_h0_comes_from_a_generator_or_the_caller_never_from_the_global_rng():
    """Training without h0 or h0_generator is refused naming both; eval mode draws the same h0 at seed 0 on
    every call, and neither touches torch's global RNG."""
    model = randomized(Parcae(tiny_config()))
    idx = torch.randint(0, 97, (2, 8))
    rng = torch.get_rng_state()
    with raises_naming(ValueError, "h0=", "h0_generator="):
        model.train()(idx, idx, T=2)
    with_seed = [model(idx, idx, T=2, h0_generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    torch.testing.assert_close(*with_seed, rtol=0, atol=0)
    model.eval()
    h0 = initial_state((2, 8, 64), "cpu", torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(idx, T=2), model(idx, T=2, h0=h0), rtol=0, atol=0)
    torch.testing.assert_close(model(idx, T=2), model(idx, T=2), rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)


def test_kv_cache_decoding_equals_full_recompute():
    torch.manual_seed(0)
    model = randomized(Parcae(tiny_config())).eval()
    idx = torch.randint(0, 97, (2, 12))
    h0 = torch.randn(2, 12, 64) * 0.1
    with torch.no_grad():
        full = model(idx, T=3, h0=h0)
        cache = KVCache(max_len=12)
        parts = [model(idx[:, :7], T=3, h0=h0[:, :7], cache=cache)]
        buffers = {slot: (k.data_ptr(), v.data_ptr()) for slot, (k, v) in cache.slots.items()}
        parts.append(model(idx[:, 7:9], T=3, h0=h0[:, 7:9], cache=cache))  # a chunk after a prefix
        for t in range(9, 12):
            parts.append(model(idx[:, t:t + 1], T=3, h0=h0[:, t:t + 1], cache=cache))
        with raises_naming(ValueError, "13", "12"):
            model(idx[:, :1], T=3, cache=cache)
        with raises_naming(ValueError, "T", "depths"):
            model(idx[:, :1], depths=(torch.tensor([2, 1]), torch.tensor([0, 0])), cache=KVCache(max_len=12))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    assert len(cache.slots) == 1 + 3 + 1 and cache.pos == 12  # prelude, 3 loop steps, coda
    # written in place: every slot is still the buffer allocated at the first forward, sized for all 12
    assert {slot: (k.data_ptr(), v.data_ptr()) for slot, (k, v) in cache.slots.items()} == buffers
    assert all(k.shape == v.shape == (2, 2, 12, 32) for k, v in cache.slots.values())


def test_flops_per_token_is_the_papers_c():
    """C (METHOD.md §2) gives the paper's numbers that its docstring states. It is linear in mu_rec
    and mu_bwd: a step costs its forward (C counts the norm vectors as matmuls too, 2e-4 of it), a
    step with gradient its backward more, twice that. A loop of one step with gradient costs what
    the Transformer's blocks do."""
    def built(**overrides):
        with torch.device("meta"):
            return Parcae(ParcaeConfig.from_depth(6, **overrides))

    parcae = built(mu_rec=8)
    assert parcae.paper_flops_per_token() == pytest.approx(1.360e9, rel=5e-4)
    assert parcae.paper_flops_per_token() / parcae.matmul_flops_per_token() == pytest.approx(1.292, abs=5e-4)
    with torch.device("meta"):
        large = Parcae(ParcaeConfig.from_depth(24, mu_rec=8))
    assert large.paper_flops_per_token() / large.matmul_flops_per_token() == pytest.approx(1.272, abs=5e-4)

    def C(mu_rec, mu_bwd):
        return built(mu_rec=mu_rec, mu_bwd=mu_bwd).paper_flops_per_token()

    forward_step = C(9, 4) - C(8, 4)
    assert C(10, 4) - C(9, 4) == C(3, 2) - C(2, 2) == forward_step
    assert C(8, 5) - C(8, 4) == C(3, 3) - C(3, 2) == 2 * forward_step  # its backward
    executed_step = parcae.matmul_flops_per_token(5, 4, backward=False) \
        - parcae.matmul_flops_per_token(4, 4, backward=False)
    assert forward_step == pytest.approx(executed_step, rel=1e-3)
    transformer = built(injection="none")
    extra = parcae.num_params() - transformer.num_params()  # B, C_proj, A_log, dt_bias, prelude norm
    assert transformer.paper_flops_per_token() == C(1, 1) - 6 * extra


def test_the_recurrence_runs_the_example_in_its_docstring():
    """T = (7, 3, 1), mu_bwd 4: n = (3, 0, 0), k = (4, 3, 1); the rows each loop step runs and whether
    it carries gradient, read off the loop itself. Given in another order, the batch runs the same."""
    torch.manual_seed(0)
    model = randomized(Parcae(tiny_config(mu_rec=8, mu_bwd=4))).train()
    n, k = split_depths(torch.tensor([7, 3, 1]), model.config.mu_bwd, training=True)
    assert n.tolist() == [3, 0, 0] and k.tolist() == [4, 3, 1]
    idx = torch.randint(0, 97, (3, 8))
    Bbar_e, steps = {}, []
    Bbar_e_of, loop_step = model.injection.Bbar_e, model.loop_step

    def recording_Bbar_e(e):
        Bbar_e["all"] = Bbar_e_of(e)
        return Bbar_e["all"]

    def recording_loop_step(h, Bbar_e_now, *args):  # the rows stepped, known by their Bbar_e
        rows = [int((Bbar_e["all"] == row).all(dim=(1, 2)).nonzero()) for row in Bbar_e_now]
        steps.append((rows, torch.is_grad_enabled()))
        return loop_step(h, Bbar_e_now, *args)

    model.injection.Bbar_e, model.loop_step = recording_Bbar_e, recording_loop_step
    model(idx, idx, depths=(n, k), h0_generator=torch.Generator().manual_seed(0))
    no, yes = False, True
    assert steps == [([0], no), ([0], no), ([0], no), ([0], yes), ([0, 1], yes), ([0, 1], yes),
                     ([0, 1, 2], yes)]
    steps.clear()
    order = [2, 0, 1]  # T = (1, 7, 3): row 1 loops first, then row 2, then row 0
    model(idx[order], idx[order], depths=(n[order], k[order]), h0_generator=torch.Generator().manual_seed(0))
    assert steps == [([1], no), ([1], no), ([1], no), ([1], yes), ([1, 2], yes), ([1, 2], yes),
                     ([1, 2, 0], yes)]


@pytest.mark.slow
@pytest.mark.parametrize("injection", ["diagonal", "concat", "add", "none"])
def test_tiny_model_learns_a_fixed_batch(injection):
    torch.manual_seed(0)
    model = Parcae(tiny_config(injection=injection, mu_rec=2, vocab_size=64)).train()
    idx = torch.randint(0, 64, (8, 33))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, h0_generator = [], torch.Generator().manual_seed(0)
    for _ in range(25):  # the loss halves within 5 steps: 25 leave a wide margin
        loss = model(idx[:, :-1], idx[:, 1:], h0_generator=h0_generator)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 2, (losses[0], losses[-1])


def test_checkpoint_round_trip_and_clear_errors(tmp_path):
    from model import from_weights
    from nanoparcae.checkpoint import find_checkpoint, load_run, save_checkpoint
    from nanoparcae.tokenizer import Tokenizer
    model = randomized(Parcae(tiny_config(injection="concat", mu_rec=3, vocab_size=260))).eval()
    Tokenizer.train(iter(["a round trip of the weights"] * 20), vocab_size=260).save(tmp_path / "tok")
    save_checkpoint(tmp_path / "runs" / "a" / "ckpt_000010.pt", model, step=10, tokenizer_dir=str(tmp_path / "tok"))
    path = find_checkpoint(tmp_path / "runs")
    assert path.name == "ckpt_000010.pt" and not list(tmp_path.rglob("*.tmp"))
    ckpt, tokenizer, loaded_path = load_run(ckpt=path)
    loaded = from_weights(ckpt["config"], ckpt["model"])
    assert ckpt["step"] == 10 and loaded.config == model.config and loaded_path == path and not loaded.training
    assert tokenizer.vocab_size == 260
    idx = torch.randint(0, 97, (1, 8))
    h0 = torch.randn(1, 8, 64)
    torch.testing.assert_close(loaded(idx, h0=h0), model(idx, h0=h0))
    with raises_naming(FileNotFoundError, str(tmp_path / "runs" / "missing")):
        find_checkpoint(tmp_path / "runs", run="missing")
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with raises_naming(ValueError, str(tmp_path / "bad.pt")):
        load_run(ckpt=tmp_path / "bad.pt")


def counted_flops_per_token(model, x, backward, **depth):
    """FlopCounterMode's count per token. Attention runs on SDPA's math path: the CPU flash kernel has no FLOP
    formula (it counts 0); the math path's bmm are counted in full over S x S, the causal mask not halving them."""
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        if backward:
            model(x, x, **depth, h0_generator=torch.Generator().manual_seed(0)).backward()
        else:
            with torch.no_grad():
                model(x, **depth)
    return counter.get_total_flops() / x.numel()


@pytest.mark.parametrize("injection", ["diagonal", "concat", "add", "none"])
def test_matmul_flops_per_token_is_what_flop_counter_mode_counts(injection):
    """Exact, with causal attention counted in full (the method's convention): a training forward + backward at a
    fixed (n, k) and at a per-sequence draw (the loop on a prefix of the batch), and an eval forward at T."""
    torch.manual_seed(0)
    config = ParcaeConfig(vocab_size=97, seq_len=32, n_prelude=1, n_recur=2, n_coda=1, d_model=64, head_dim=32,
                          mu_rec=4, injection=injection)
    model = Parcae(config).train()
    x = torch.randint(0, 97, (6, 32))
    draw = sample_depths(model.config, 6, torch.Generator().manual_seed(3))
    assert len((draw[0] + draw[1]).unique()) > 2  # the sequences loop different depths
    for n, k in [(2, 2), draw]:
        assert counted_flops_per_token(model, x, True, depths=(n, k)) == model.matmul_flops_per_token(n, k), (n, k)
    model.eval()
    assert counted_flops_per_token(model, x, False, T=5) == model.matmul_flops_per_token(5, 0, backward=False)


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
    assert model.paper_flops_per_token() - model.matmul_flops_per_token(n, k) == \
        6 * (tables + vectors(model) - core_vectors) + (2 * (n + k) + 4 * k) * core_vectors \
        - 6 * c.d_model * c.padded_vocab_size
