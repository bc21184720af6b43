"""Tests of optim.py: Polar Express, cautious weight decay, the AdamW path against torch.optim.AdamW,
parameter grouping, schedules, and Muon actually optimising."""

import io
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import optim  # noqa: E402
from conftest import beforehand, compile_cache  # noqa: E402


def svdvals(X):
    return torch.linalg.svdvals(X.float())


# -----------------------------------------------------------------------------
# Polar Express. Five bf16 steps do not reach exactly 1: the published schedule leaves the singular
# values spread over about [0.85, 1.15] (measured here; bf16 adds noise), provided the smallest
# singular value of the input is not far below 1e-3 of its Frobenius norm. We check [0.8, 1.2].

@pytest.mark.parametrize("shape", [(256, 64), (64, 256), (768, 192)])
def test_polar_express_tall_and_wide_gaussian(shape):
    torch.manual_seed(0)
    G = torch.randn(*shape)
    X = optim.polar_express(G)
    assert X.shape == G.shape and X.dtype == G.dtype
    S = svdvals(X)
    assert S.min() > 0.8 and S.max() < 1.2, (S.min(), S.max())
    # It is the polar factor U V^T of G, not just any matrix with singular values near 1.
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    cos = (X * (U @ Vh)).sum() / (X.norm() * (U @ Vh).norm())
    assert cos > 0.99


def test_polar_express_square():
    torch.manual_seed(0)
    n = 128
    Q1, _ = torch.linalg.qr(torch.randn(n, n))
    Q2, _ = torch.linalg.qr(torch.randn(n, n))
    G = Q1 @ torch.diag(torch.logspace(0, -2, n)) @ Q2  # condition number 100
    S = svdvals(optim.polar_express(G))
    assert S.min() > 0.8 and S.max() < 1.2, (S.min(), S.max())
    # A square Gaussian matrix has singular values down to ~1/(2n) of its largest, below what five
    # steps can lift: the bulk lands near 1, a few smallest ones stay below; none overshoots.
    S = svdvals(optim.polar_express(torch.randn(n, n)))
    assert S.max() < 1.2 and (S > 0.7).float().mean() > 0.95


def test_polar_express_batched_matches_one_by_one():
    torch.manual_seed(0)
    for shape in [(4, 96, 32), (4, 32, 96)]:
        G = torch.randn(*shape) * torch.tensor([1.0, 10.0, 0.01, 3.0]).view(4, 1, 1)  # per-matrix norms
        X = optim.polar_express(G)
        for i in range(shape[0]):
            torch.testing.assert_close(X[i], optim.polar_express(G[i]), atol=2e-2, rtol=0)
            S = svdvals(X[i])
            assert S.min() > 0.8 and S.max() < 1.2


# -----------------------------------------------------------------------------
# Cautious weight decay: run the same Muon step twice from the same state, with weight decay 0 and
# with weight decay 0.5. Where update * param < 0 the two results must be bitwise equal (no decay);
# where update * param >= 0 they must differ by exactly lr * wd * param.

def one_muon_step(p0, grad, wd, lr=0.1):
    p = nn.Parameter(p0.clone())
    opt = optim.MuonAdamW([{'params': [p], 'kind': 'muon', 'lr': lr, 'weight_decay': wd}])
    p.grad = grad.clone()
    opt.step()
    return p.detach()


@pytest.mark.parametrize("shape", [(48, 16), (16, 48)])
def test_cautious_weight_decay_only_where_update_agrees(shape):
    torch.manual_seed(0)
    p0, grad = torch.randn(*shape), torch.randn(*shape)
    lr, wd = 0.1, 0.5
    lr_eff = lr * max(1.0, shape[0] / shape[1]) ** 0.5
    no_decay = one_muon_step(p0, grad, 0.0, lr)
    decayed = one_muon_step(p0, grad, wd, lr)
    update = (p0 - no_decay) / lr_eff  # the step's update U, recovered: p1 = p0 - lr U
    agrees = update * p0 >= 0
    moved = decayed != no_decay
    assert 0.2 < agrees.float().mean() < 0.8  # both kinds of entries are present
    assert torch.equal(moved, agrees)
    torch.testing.assert_close((no_decay - decayed)[agrees], (lr_eff * wd * p0)[agrees], rtol=1e-4, atol=1e-7)
    # The mask follows the processed update, not the raw gradient: their signs differ in places.
    assert (agrees != (grad * p0 >= 0)).sum() >= 10


# -----------------------------------------------------------------------------
# The AdamW path against torch.optim.AdamW, several steps, with and without weight decay, on
# parameters of several shapes, one of which skips a step (no gradient), as torch does.

@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_matches_torch(wd):
    torch.manual_seed(0)
    shapes = [(7, 5), (11,), (3, 4, 2)]
    ours = [nn.Parameter(torch.randn(*s)) for s in shapes]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=8e-3, betas=(0.8, 0.95), eps=1e-10, weight_decay=wd)
    opt = optim.MuonAdamW([dict(params=ours, kind='adamw', **kw)])
    ref_opt = torch.optim.AdamW(ref, **kw)
    for step in range(8):
        for a, b in zip(ours, ref):
            g = torch.randn_like(a) * 10 ** torch.empty(()).uniform_(-3, 1)
            skip = step == 3 and a.ndim == 1
            a.grad = None if skip else g.clone()
            b.grad = None if skip else g.clone()
        opt.step()
        ref_opt.step()
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    assert all(not torch.equal(a, torch.zeros_like(a)) for a in ours)
    for a, b in zip(ours, ref):
        assert opt.state[a]['step'] == ref_opt.state[b]['step'].item()


# -----------------------------------------------------------------------------
# Grouping, on a fake module with the project's parameter names.

class Block(nn.Module):
    def __init__(self, d, ve_gate):
        super().__init__()
        self.attn_norm = nn.RMSNorm(d)
        self.c_q = nn.Linear(d, d, bias=False)
        self.c_fc = nn.Linear(d, 4 * d, bias=False)
        self.c_proj = nn.Linear(4 * d, d, bias=False)
        self.ve_gate = nn.Linear(4, 2, bias=False) if ve_gate else None


class FakeParcae(nn.Module):
    def __init__(self, d=8, vocab=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: must be counted once
        self.value_embeds = nn.ModuleDict({'1': nn.Embedding(vocab, d)})
        self.prelude = nn.ModuleList([Block(d, False), Block(d, True)])
        self.recur = nn.ModuleList([Block(d, True)])
        self.coda = nn.ModuleList([Block(d, False)])
        self.prelude_norm = nn.RMSNorm(d)
        self.norm_f = nn.RMSNorm(d)
        self.A_log = nn.Parameter(torch.zeros(d))
        self.dt_bias = nn.Parameter(torch.zeros(d))
        self.B = nn.Linear(d, d, bias=False)
        self.adapter = nn.Linear(2 * d, d, bias=False)
        self.C_proj = nn.Linear(d, d, bias=False)
        self.frozen = nn.Parameter(torch.zeros(d, d), requires_grad=False)


def test_build_optimizer_grouping():
    model = FakeParcae()
    opt = optim.build_optimizer(model, adamw_lr=6e-3)
    adamw = [g for g in opt.param_groups if g['kind'] == 'adamw']
    muon = [g for g in opt.param_groups if g['kind'] == 'muon']
    assert len(adamw) == 1
    assert sorted(adamw[0]['names']) == sorted([
        'wte.weight', 'value_embeds.1.weight', 'prelude_norm.weight', 'norm_f.weight', 'A_log', 'dt_bias',
        'B.weight', 'adapter.weight', 'C_proj.weight',
        'prelude.0.attn_norm.weight', 'prelude.1.attn_norm.weight', 'recur.0.attn_norm.weight',
        'coda.0.attn_norm.weight'])
    expected_muon = {
        (8, 8): ['prelude.0.c_q.weight', 'prelude.1.c_q.weight', 'recur.0.c_q.weight', 'coda.0.c_q.weight'],
        (32, 8): ['prelude.0.c_fc.weight', 'prelude.1.c_fc.weight', 'recur.0.c_fc.weight', 'coda.0.c_fc.weight'],
        (8, 32): ['prelude.0.c_proj.weight', 'prelude.1.c_proj.weight', 'recur.0.c_proj.weight',
                  'coda.0.c_proj.weight'],
        (2, 4): ['prelude.1.ve_gate.weight', 'recur.0.ve_gate.weight'],
    }
    assert {tuple(g['params'][0].shape): g['names'] for g in muon} == expected_muon
    for g in muon:
        assert all(tuple(p.shape) == tuple(g['params'][0].shape) for p in g['params'])
        assert g['lr'] == g['initial_lr'] == 8e-3 and g['weight_decay'] == 0.2 and g['momentum'] == 0.95
    assert adamw[0]['lr'] == adamw[0]['initial_lr'] == 6e-3 and adamw[0]['weight_decay'] == 0.0
    assert adamw[0]['betas'] == (0.8, 0.95) and adamw[0]['eps'] == 1e-10
    # every trainable parameter exactly once; the tied embedding once; the frozen one nowhere
    ids = [id(p) for g in opt.param_groups for p in g['params']]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters() if p.requires_grad}


def test_build_optimizer_without_muon_puts_every_parameter_in_one_adamw_group():
    """train.py --optimizer=adamw: one AdamW group at one rate holds every trainable parameter, once."""
    model = FakeParcae()
    opt = optim.build_optimizer(model, adamw_lr=3e-3, muon=False)
    assert [g['kind'] for g in opt.param_groups] == ['adamw'] and opt.param_groups[0]['lr'] == 3e-3
    names = opt.param_groups[0]['names']
    assert 'recur.0.c_q.weight' in names and len(names) == len(set(names))
    assert {id(p) for p in opt.param_groups[0]['params']} == {id(p) for p in model.parameters() if p.requires_grad}


def test_is_muon_param_unwraps_compiled_and_ddp_names():
    W = torch.zeros(4, 4)
    assert optim.is_muon_param('_orig_mod.recur.0.c_q.weight', W)
    assert optim.is_muon_param('module.coda.1.c_fc.weight', W)
    assert optim.is_muon_param('module._orig_mod.prelude.0.c_q.weight', W)
    assert not optim.is_muon_param('module.wte.weight', W)
    for name in ('injection.B.weight', 'injection.adapter.weight', 'module.C_proj.weight'):
        assert not optim.is_muon_param(name, W), name  # outside the blocks: AdamW, as the authors'
    assert not optim.is_muon_param('recur.0.attn_norm.weight', torch.zeros(4))


def test_muon_group_rejects_mixed_shapes():
    with pytest.raises(ValueError):
        optim.MuonAdamW([{'params': [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(3, 2))],
                          'kind': 'muon', 'lr': 1e-3}])
    with pytest.raises(ValueError):
        optim.MuonAdamW([{'params': [nn.Parameter(torch.zeros(2))], 'kind': 'sgd', 'lr': 1e-3}])


# -----------------------------------------------------------------------------
# Schedules.

def test_lr_multiplier():
    T = 1000
    assert optim.lr_multiplier(0, T) == 1.0
    assert optim.lr_multiplier(500, T) == 1.0
    assert optim.lr_multiplier(750, T) == pytest.approx(0.5)
    assert optim.lr_multiplier(999, T) == pytest.approx(0.002)
    assert optim.lr_multiplier(1000, T) == 0.0
    assert optim.lr_multiplier(900, T, warmdown_frac=0.2) == pytest.approx(0.5)
    values = [optim.lr_multiplier(s, T) for s in range(T + 1)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_muon_momentum_and_weight_decay_schedules():
    assert optim.muon_momentum(0) == pytest.approx(0.85)
    assert optim.muon_momentum(150) == pytest.approx(0.90)
    assert optim.muon_momentum(300) == pytest.approx(0.95)
    assert optim.muon_momentum(10_000) == pytest.approx(0.95)
    assert optim.weight_decay_at(0, 1000, 0.2) == pytest.approx(0.2)
    assert optim.weight_decay_at(500, 1000, 0.2) == pytest.approx(0.1)
    assert optim.weight_decay_at(1000, 1000, 0.2) == 0.0


def test_learning_rate_for_depth():
    assert [optim.learning_rate_for_depth(d) for d in (6, 12, 18, 24)] == [8e-3, 8e-3, 6e-3, 6e-3]


# -----------------------------------------------------------------------------
# Muon optimises: least squares ||W X - Y||^2 on a stack of same-shape matrices, with the loop
# applying the schedules as train.py will. The loss must fall by a large factor.

def test_muon_decreases_quadratic_loss():
    torch.manual_seed(0)
    X = torch.randn(16, 256)
    targets = [torch.randn(32, 16) / 4 for _ in range(2)]
    Ws = [nn.Parameter(torch.zeros(32, 16)) for _ in range(2)]
    opt = optim.MuonAdamW([{'params': Ws, 'kind': 'muon', 'lr': 0.02, 'weight_decay': 0.0}])

    def loss_fn():
        return sum(((W - T) @ X).square().mean() for W, T in zip(Ws, targets))

    first = loss_fn().item()
    steps = 100
    for step in range(steps):
        for g in opt.param_groups:
            g['lr'] = g['initial_lr'] * optim.lr_multiplier(step, steps)
            g['momentum'] = optim.muon_momentum(step)
        opt.zero_grad(set_to_none=True)
        loss_fn().backward()
        opt.step()
    last = loss_fn().item()
    assert last < 0.02 * first, (first, last)


@pytest.mark.slow
def test_state_dict_round_trip_resumes_exactly():
    def make():
        torch.manual_seed(1)
        return FakeParcae()

    def train(model, opt, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen) if p.requires_grad else None
            opt.step()

    a = make()
    opt_a = optim.build_optimizer(a, adamw_lr=8e-3)
    train(a, opt_a, 3, 0)
    # Through torch.save / torch.load, as a checkpoint goes: Optimizer.load_state_dict keeps the
    # very tensors it is given, so loading opt_a.state_dict() directly would share state with opt_a.
    buffer = io.BytesIO()
    torch.save({'model': a.state_dict(), 'optim': opt_a.state_dict()}, buffer)
    buffer.seek(0)
    ckpt = torch.load(buffer)
    b = make()
    b.load_state_dict(ckpt['model'])
    opt_b = optim.build_optimizer(b, adamw_lr=8e-3)
    opt_b.load_state_dict(ckpt['optim'])
    train(a, opt_a, 3, 1)
    train(b, opt_b, 3, 1)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n


# -----------------------------------------------------------------------------
# The compiled updates (MuonAdamW.compile) against the plain ones: the same steps from the same
# state, every group kind, lr, momentum and weight decay changing each step as the schedules change
# them, one step without a gradient. Dynamo's graphs run by its eager backend: equal to the bit.
# Inductor's fused kernels round differently: AdamW and the momenta within float32's tolerance.
# Muon's bf16 Polar Express is within 8% of exact arithmetic (the last test), so the compiled
# weights are held to the same steps with Polar Express in float64: no further than the plain
# ones. No graph is compiled after the first step but for the missing gradient's.

def train_fake_parcae(compile_backend=None, steps=5):
    """FakeParcae's weights, optimiser and dynamo's graph count after each of `steps` steps."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = FakeParcae()
    opt = optim.build_optimizer(model, adamw_lr=8e-3)
    if compile_backend:
        opt.compile(backend=compile_backend)
    gen = torch.Generator().manual_seed(1)
    graphs = [counters['stats']['unique_graphs']]
    for step in range(steps):
        for name, p in model.named_parameters():
            grad = torch.randn(p.shape, generator=gen)
            p.grad = None if step == 2 and name == 'A_log' else grad
        for g in opt.param_groups:
            g['lr'] = g['initial_lr'] * optim.lr_multiplier(step + 4, 8)
            if g['kind'] == 'muon':
                g['momentum'] = optim.muon_momentum(step, warmup_steps=4)
                g['weight_decay'] = optim.weight_decay_at(step, 8, 0.2)
        opt.step()
        graphs.append(counters['stats']['unique_graphs'])
    return model, opt, graphs


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=beforehand(compile_cache))])
def test_compiled_updates_equal_the_plain_ones(backend, monkeypatch):
    plain_model, plain, _ = train_fake_parcae()
    compiled_model, compiled, graphs = train_fake_parcae(backend)
    # one graph per group at step 1, one more for step 3's AdamW group without A_log, no other
    assert graphs[1] - graphs[0] == len(compiled.param_groups)
    assert graphs[2] == graphs[1] and graphs[3] == graphs[1] + 1 and graphs[5] == graphs[3]
    muon = {name for g in plain.param_groups if g['kind'] == 'muon' for name in g['names']}
    for (name, a), b in zip(plain_model.named_parameters(), compiled_model.parameters()):
        if backend == 'eager':
            assert torch.equal(a, b), name
            assert all(torch.equal(torch.as_tensor(compiled.state[b][key]), torch.as_tensor(value))
                       for key, value in plain.state[a].items()), name
        elif name not in muon:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=name)
    if backend == 'eager':
        return
    for a, b in zip(plain_model.parameters(), compiled_model.parameters()):
        for key in ('exp_avg', 'exp_avg_sq', 'momentum_buffer'):
            if key in plain.state[a]:
                torch.testing.assert_close(compiled.state[b][key], plain.state[a][key], rtol=1e-5, atol=1e-7)
    monkeypatch.setattr(optim, 'polar_express', polar_express_float64)
    exact_model, _, _ = train_fake_parcae()
    exact = dict(exact_model.named_parameters())

    def distance(model):
        return torch.cat([(p - exact[name]).flatten() for name, p in model.named_parameters()
                          if name in muon]).norm()
    assert distance(compiled_model) < 1.2 * distance(plain_model)


def polar_express_float64(G, steps=5):
    """Polar Express in float64 (one layout for tall and wide), returned in G's dtype."""
    X = G.double()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    for a, b, c in optim.POLAR_EXPRESS_COEFFS[:steps]:
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.to(G.dtype)


def test_polar_express_in_bf16_is_within_8_percent_of_float64():
    """On a stack of non-square matrices; the compiled update's Polar Express is held to it above."""
    torch.manual_seed(0)
    G = torch.randn(3, 32, 64)
    exact = polar_express_float64(G)
    assert ((optim.polar_express(G) - exact).norm() / exact.norm()).item() < 0.08
