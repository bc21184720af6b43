"""
model.py: Parcae, the stable looped language model, and its baselines (METHOD.md §1).

    x = wte(ids); e = RMSNorm(Prelude(x))
    h = h0 ~ TruncNormal(0, sqrt(2/(5d)))
    repeat T times: h = R(A_bar h + Bbar_e)             # the recurrent block R, looped; Bbar_e = Bbar(e)
    logits = RMSNorm(Coda(C_proj(h))) @ wte^T

The injection u = A_bar h + Bbar_e is a small module that config.injection picks: DiagonalInjection (Parcae:
A_bar = exp(-Delta exp(A_log)), rho < 1 always), ConcatInjection (RDM / Huginn: a Linear(2d -> d) adapter) or
AddInjection (u = h + e, rho = 1); "none" is the fixed-depth Transformer baseline, whose "loop" is its recurrent
blocks run once, in order, with no injection and no h0.

Training draws per-sequence depths from config.sampling (the Depths section): sequence i runs n_i loop steps without
gradient, then k_i with it (METHOD.md §2). Parcae.recurrence is that loop.

    model = Parcae(ParcaeConfig.from_depth(6))
    loss = model(idx, targets)                      # training: depths drawn (depth_generator=, or torch's RNG)
    logits = model(idx, T=16)                       # every sequence loops 16 times
    loss = model(idx, targets, depths=(n, k))       # a draw of depths.sample_depths, replayed
    stats = {}; model(idx, targets, diagnostics=stats)   # stats: ||h_T|| and the update ratio

The caller owns the randomness (depth_generator; torch's global RNG for h0, or an h0 drawn under evaluation's or
decoding's policy: initial_state); the model keeps no state between forwards. The accounting section sizes a run:
the paper's C, the matmul FLOPs executed, the memory per GPU.
torch.compile: `model.compile_blocks()` compiles each block alone, so a depth that changes every batch never
recompiles.
"""

import math
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# Configuration

INJECTIONS = ("diagonal", "concat", "add", "none")


@dataclass
class ParcaeConfig:
    vocab_size: int = 32768
    seq_len: int = 2048
    n_prelude: int = 2
    n_recur: int = 2
    n_coda: int = 2
    d_model: int = 768
    head_dim: int = 128  # METHOD.md §1: head_dim 128, n_head = n_kv_head = d / 128
    n_head: int | None = None  # derived from d_model / head_dim when not given
    mu_rec: int = 8  # mean recurrence depth
    mu_bwd: int | None = None  # backpropagated depth, ceil(mu_rec / 2) when not given
    injection: str = "diagonal"
    prelude_norm: bool = True
    sampling: str = "per_sequence"
    rope_base: float = 50_000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.n_head is None:
            if self.d_model % self.head_dim != 0:
                raise ValueError(f"d_model={self.d_model} is not a multiple of head_dim={self.head_dim}; "
                                 f"pick a d_model divisible by {self.head_dim} or set head_dim")
            self.n_head = self.d_model // self.head_dim
        elif self.n_head * self.head_dim != self.d_model:
            raise ValueError(f"n_head={self.n_head} x head_dim={self.head_dim} != d_model={self.d_model}")
        if self.mu_bwd is None:
            self.mu_bwd = math.ceil(self.mu_rec / 2)  # METHOD.md §2: mu_bwd = ceil(mu_rec / 2)
        if self.injection not in INJECTIONS:
            raise ValueError(f"injection={self.injection!r} is not one of {INJECTIONS}")
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"sampling={self.sampling!r} is not one of {SAMPLINGS}")
        for name in ("mu_rec", "mu_bwd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if min(self.n_prelude, self.n_recur, self.n_coda) < 0 or self.n_recur < 1:
            raise ValueError("n_prelude and n_coda must be >= 0 and n_recur >= 1")

    @classmethod
    def from_depth(cls, depth, **overrides):
        """METHOD.md §1 sizes: d = 128 * (depth/3 + 4), L_P = L_R = L_C = depth/3 (depth 6/12/18/24 = 140M..1.3B)."""
        if depth <= 0 or depth % 3 != 0:
            raise ValueError(f"depth={depth} must be a positive multiple of 3 (prelude, recurrent block "
                             f"and coda take a third each); try --depth=6, 12, 18 or 24")
        third = depth // 3
        sizes = dict(n_prelude=third, n_recur=third, n_coda=third, d_model=128 * (third + 4))
        return cls(**{**sizes, **overrides})

    @property
    def n_layer(self):
        return self.n_prelude + self.n_recur + self.n_coda

    @property
    def padded_vocab_size(self):
        return -(-self.vocab_size // 64) * 64  # METHOD.md §1: vocab padded up to a multiple of 64


# -----------------------------------------------------------------------------
# Building blocks

def rms_norm(x, eps):
    return F.rms_norm(x, (x.size(-1),), eps=eps)


def apply_rotary(x, cos, sin):
    """RoPE on (B, S, H, D), rotating the two halves of each head (nanochat's layout)."""
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # float32 tables would lift bf16 q, k to float32
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, config, has_value_embed):
        super().__init__()
        # q/k norm eps None: the dtype's epsilon, as the authors' F.rms_norm(q)
        d, self.n_head, self.head_dim, self.eps = config.d_model, config.n_head, config.head_dim, None
        self.c_q = nn.Linear(d, d, bias=False)
        self.c_k = nn.Linear(d, d, bias=False)
        self.c_v = nn.Linear(d, d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        # METHOD.md §1 value embeddings: v += 2 * sigmoid(ve_gate(x[..., :32])) * ve
        self.ve_gate_channels = min(32, d)
        self.ve_gate = nn.Linear(self.ve_gate_channels, self.n_head, bias=False) if has_value_embed else None

    def forward(self, x, ve, cos, sin, cache=None, slot=None):
        B, S, _ = x.shape
        H, D = self.n_head, self.head_dim
        v = self.c_v(x).view(B, S, H, D)
        if self.ve_gate is not None:
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :self.ve_gate_channels]))  # (B, S, H)
            v = v + gate.unsqueeze(-1) * ve.view(B, S, H, D)
        # METHOD.md §1: RoPE, then a parameter-free RMS norm per head, on q and k together
        qk = torch.cat([self.c_q(x).view(B, S, H, D), self.c_k(x).view(B, S, H, D)], dim=2)  # (B, S, 2H, D)
        q, k = rms_norm(apply_rotary(qk, cos, sin), self.eps).transpose(1, 2).split(H, dim=1)  # (B, H, S, D)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(slot, k, v)
        S_kv = k.size(2)
        if S == S_kv:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif S == 1:  # one new token attends to everything cached
            y = F.scaled_dot_product_attention(q, k, v)
        else:  # a chunk after a cached prefix: causal, aligned to the end
            mask = torch.ones(S, S_kv, dtype=torch.bool, device=x.device).tril(diagonal=S_kv - S)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.d_model, 4 * config.d_model, bias=False)
        self.c_proj = nn.Linear(4 * config.d_model, config.d_model, bias=False)

    def forward(self, x):
        return self.c_proj(0.5 * F.relu(self.c_fc(x)).square())  # METHOD.md §1: 0.5 * relu(x)^2


class Block(nn.Module):
    """Pre-norm transformer block: x + Attn(RMSNorm(x)), then x + MLP(RMSNorm(x))."""

    def __init__(self, config, has_value_embed):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = Attention(config, has_value_embed)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, ve, cos, sin, cache=None, slot=None):
        x = x + self.attn(self.attn_norm(x), ve, cos, sin, cache, slot)
        return x + self.mlp(self.mlp_norm(x))


# -----------------------------------------------------------------------------
# Injections: how each loop step mixes the state h with the prelude's output e (METHOD.md §1), u = A_bar h + Bbar_e.
# Each owns its parameters and their init. A_bar() and Bbar_e(e) do not change over the loop: the loop forms them
# once per forward and the injection itself at every step.

def trunc_normal_(weight, std, generator=None):
    return nn.init.trunc_normal_(weight, std=std, a=-3 * std, b=3 * std, generator=generator)


@torch.no_grad()
def trunc_orthogonal_(weight, std):
    """The authors' truncated orthogonal init: Q of the QR of a standard normal matrix truncated at
    +-2, signs fixed by diag(R) (so Q is uniformly distributed), scaled by std * sqrt(max(rows, cols)).
    Every entry then has std `std`, as an i.i.d. draw would, but all singular values equal that gain
    (a rectangular matrix is semi-orthogonal) instead of spreading out."""
    rows, cols = weight.shape
    if weight.is_meta:  # a model sized on the meta device has nothing to fill
        return weight
    a = torch.empty(max(rows, cols), min(rows, cols), device=weight.device, dtype=torch.float32)
    q, r = torch.linalg.qr(nn.init.trunc_normal_(a, a=-2.0, b=2.0))
    q = q * torch.diagonal(r).sign()
    return weight.copy_(q if rows >= cols else q.t()).mul_(std * math.sqrt(max(rows, cols)))


class Injection(nn.Module):
    """The baselines' defaults: the input term is e itself (add: Bbar = I; concat mixes e inside its adapter) and
    there is no A_bar to form ahead of the loop. Parcae overrides both."""

    rho_on_host = False  # spectral_radius is a few ops on the weights' device, free to log with every step

    def reset_parameters(self, std):
        pass

    def Bbar_e(self, e):
        return e

    def A_bar(self):
        return None


class Discretized(NamedTuple):
    A_bar: torch.Tensor  # (d,) the state's per-channel decay, every entry in (0, 1)
    delta: torch.Tensor  # (d,) the step size Delta = softplus(dt_bias)


class DiagonalInjection(Injection):
    """Parcae: u = A_bar h + Bbar_e with A_bar = exp(-Delta exp(A_log)), Bbar = Delta B, so rho(A_bar) < 1."""

    def __init__(self, d):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(d))
        self.dt_bias = nn.Parameter(torch.zeros(d))
        self.B = nn.Linear(d, d, bias=False)

    @torch.no_grad()
    def reset_parameters(self, std):
        """A_log = 0 and Delta = softplus(dt_bias) = -ln(sqrt(1/5)), so A_bar = sqrt(1/5) = 0.4472; B = I."""
        self.A_log.zero_()
        self.dt_bias.fill_(math.log(math.expm1(-math.log(math.sqrt(1 / 5)))))
        self.B.weight.copy_(torch.eye(self.B.weight.size(0)))

    def discretize(self):
        """Zero-order hold of A = Diag(-exp(A_log)) with step Delta.

        The rate Delta exp(A_log) is formed as exp(A_log + ln Delta), so no extreme pair gives 0 * inf,
        and floored at 1e-6: below that float32 rounds A_bar to exactly 1 and rho < 1 would hold only on
        paper. A_bar stays float32 (bf16 would round anything above 0.998 to 1).
        """
        delta = F.softplus(self.dt_bias)
        rate = torch.exp(self.A_log + torch.log(delta)).clamp(min=1e-6)
        return Discretized(A_bar=torch.exp(-rate), delta=delta)

    def Bbar_e(self, e):
        """Bbar e = Delta (e @ B^T) (Euler: Bbar = Delta B), float32 like A_bar."""
        return self.discretize().delta * self.B(e)

    def A_bar(self):
        return self.discretize().A_bar

    def forward(self, h, Bbar_e, A_bar=None):
        return (self.A_bar() if A_bar is None else A_bar) * h + Bbar_e

    @torch.no_grad()
    def spectral_radius(self):
        return self.discretize().A_bar.max()


class ConcatInjection(Injection):
    """RDM / Huginn: u = W [h; e], W a Linear(2d -> d) adapter whose state half is an unconstrained A_bar."""

    # rho is an eigendecomposition of the d x d state half, which LAPACK runs on the host (on CUDA, after a sync):
    # train.py logs it at a cadence of its own (--rho_every) so that it never stalls the training step
    rho_on_host = True

    def __init__(self, d):
        super().__init__()
        self.adapter = nn.Linear(2 * d, d, bias=False)

    @torch.no_grad()
    def reset_parameters(self, std):
        # the authors' "adapter" rule: i.i.d. truncated normal even when the other matrices are orthogonal
        trunc_normal_(self.adapter.weight, std)

    def forward(self, h, e, A_bar=None):
        return self.adapter(torch.cat([h, e], dim=-1)).to(h.dtype)  # the state stays float32 under autocast

    @torch.no_grad()
    def spectral_radius(self):
        state_half = self.adapter.weight[:, :self.adapter.out_features].float()
        return torch.linalg.eigvals(state_half).abs().max()


class AddInjection(Injection):
    """u = h + e: A_bar = I, rho = 1 (marginally stable). No parameters."""

    def __init__(self, d):
        super().__init__()

    def forward(self, h, e, A_bar=None):
        return h + e

    def spectral_radius(self):
        return 1.0


INJECTION_CLASSES = {"diagonal": DiagonalInjection, "concat": ConcatInjection, "add": AddInjection, "none": None}


def initial_state(shape, device=None, generator=None):
    """METHOD.md §1's h0 ~ TruncNormal(0, s, -3s..3s), s = sqrt(2 / (5 d)), d = shape[-1]: a float32 tensor of
    `shape` (B, S, d) on `device`. generator: None for torch's global RNG, a torch.Generator on `device`, or a list
    of them, one per row.

    The draw is always this one; which randomness it reads is one of three policies, each a function below that
    its callers name:
    - training_initial_state: afresh inside every forward, from torch's global RNG, as the paper draws it.
      train.py reseeds that RNG per micro-batch, so a step's h0 does not depend on the number of processes.
    - evaluation_initial_state: one seeded table of positions, shared by every row of an evaluation: a score
      depends on neither what else is in its batch, nor the number of ranks, nor the device.
    - decoding_initial_state: one generator per row: a sample does not depend on how many others are drawn
      beside it."""
    if isinstance(generator, (list, tuple)):
        return torch.cat([initial_state((1, *shape[1:]), device, g) for g in generator])
    sigma = math.sqrt(2 / (5 * shape[-1]))
    return trunc_normal_(torch.empty(shape, device=device, dtype=torch.float32), sigma, generator)


def training_initial_state(shape, device):
    """Training's h0 (B, S, d): from torch's global RNG, drawn inside every forward (initial_state)."""
    return initial_state(shape, device)


def evaluation_initial_state(d_model, length, seed, device):
    """Evaluation's h0 (1, length, d): one table of positions 0..length-1 drawn on the CPU from `seed`, every row
    of an evaluation reading its first positions (initial_state). METHOD.md §1 draws h0 afresh per forward; one
    draw per evaluation keeps the distribution and makes every score reproducible."""
    return initial_state((1, length, d_model), "cpu", torch.Generator().manual_seed(seed)).to(device)


def decoding_initial_state(shape, device, generators):
    """Decoding's h0 (B, S, d): row i drawn from generators[i], a torch.Generator on `device` or None for the
    global RNG (initial_state)."""
    return initial_state(shape, device, list(generators))


# -----------------------------------------------------------------------------
# Depths: how many loop steps each sequence of a training forward runs (METHOD.md §2)

# Depth samplers: each training forward runs n_i recurrent steps without gradient, then k_i with it. Every
# entry says what it draws and its mean executed (n + k) and backpropagated (k) steps, also at mu_rec 8,
# mu_bwd 4; "mu_rec - mu_bwd" means max(0, mu_rec - mu_bwd). The Poisson ones after per_batch_split are the
# other schemes of the authors' per-batch sampler (their sampling_scheme names with "-" for "_").
SAMPLINGS = {
    "per_sequence": "Parcae: T_i = max(1, Poisson(mu_rec)) per sequence, n_i = T_i - k_i, "
                    "k_i = min(T_i, mu_bwd); executes mu_rec + exp(-mu_rec) (8.00), backprops E[min(T, mu_bwd)] "
                    "(3.94)",
    "per_batch": "the authors' per-batch ablation (their poisson-truncated-full, per-batch): one T = max(1, "
                 "Poisson(mu_rec)) per micro-batch, n = T, then k = min(T, mu_bwd) more; executes E[T] + "
                 "E[min(T, mu_bwd)] (11.94), backprops E[min(T, mu_bwd)] (3.94)",
    "per_batch_split": "per_sequence's depths drawn once per micro-batch: one T, n = T - k, k = min(T, mu_bwd); "
                       "executes 8.00, backprops 3.94 (equal compute to per_sequence)",
    "poisson_unbounded": "per micro-batch n ~ Poisson(mu_rec - mu_bwd), k ~ U{1..2 mu_bwd}; executes "
                         "mu_rec + 1/2 (8.5), backprops mu_bwd + 1/2 (4.5)",
    "poisson_fill": "per micro-batch n ~ Poisson(mu_rec - mu_bwd), k = mu_bwd; executes mu_rec (8), "
                    "backprops mu_bwd (4)",
    "poisson_full": "per micro-batch n = 0, k = max(1, Poisson(mu_rec)): full backprop, memory grows with T; "
                    "executes and backprops mu_rec + exp(-mu_rec) (8.00)",
    "fixed": "T = mu_rec always, n = T - k, k = min(T, mu_bwd) (the paper's mu_rec = 1 fixed-depth Parcae); "
             "executes mu_rec (8), backprops min(mu_rec, mu_bwd) (4)",
}


def sample_depths(config, batch_size, generator=None):
    """One training draw of config.sampling (SAMPLINGS) -> (n, k), (B,) long tensors: sequence i runs n_i
    steps without gradient, then k_i with it. Only per_sequence draws per sequence; the others once per
    micro-batch, as the authors' per-batch sampler."""
    scheme, mu_bwd = config.sampling, config.mu_bwd
    draws = batch_size if scheme == "per_sequence" else 1

    def poisson(rate):
        return torch.poisson(torch.full((draws,), float(rate)), generator=generator).long()

    rest = max(config.mu_rec - mu_bwd, 0)  # the authors' mean no-grad depth
    if scheme == "poisson_unbounded":
        n, k = poisson(rest), torch.randint(1, 2 * mu_bwd + 1, (draws,), generator=generator)
    elif scheme == "poisson_fill":
        n, k = poisson(rest), torch.full((draws,), mu_bwd)
    elif scheme == "poisson_full":
        k = poisson(rest + mu_bwd).clamp_(min=1)
        n = torch.zeros_like(k)
    else:
        T = torch.full((draws,), config.mu_rec) if scheme == "fixed" else poisson(config.mu_rec).clamp_(min=1)
        n, k = split_depths(T, mu_bwd, training=True)
        if scheme == "per_batch":
            n = T  # the authors' per-batch path runs all T steps without grad, then k more with it
    return n.expand(batch_size).clone(), k.expand(batch_size).clone()


def split_depths(depths, mu_bwd, training):
    """Per sequence: n no-grad steps then k = min(T, mu_bwd) grad steps. Evaluation: all T without grad."""
    k = depths.clamp(max=mu_bwd) if training else torch.zeros_like(depths)
    return depths - k, k


def mean_steps(config):
    """The expected (n, k) of one sequence under config.sampling, the means SAMPLINGS states: the loop steps a
    training forward runs on average without and with gradient (Parcae.matmul_flops_per_token, train.py's MFU)."""
    scheme, mu_rec, mu_bwd = config.sampling, config.mu_rec, config.mu_bwd
    rest = max(mu_rec - mu_bwd, 0)
    if scheme == "poisson_unbounded":
        return float(rest), mu_bwd + 0.5
    if scheme == "poisson_fill":
        return float(rest), float(mu_bwd)
    if scheme == "poisson_full":
        return 0.0, rest + mu_bwd + math.exp(-(rest + mu_bwd))
    if scheme == "fixed":
        return float(mu_rec - min(mu_rec, mu_bwd)), float(min(mu_rec, mu_bwd))
    T = mu_rec + math.exp(-mu_rec)  # E[max(1, X)], X ~ Poisson(mu_rec)
    k = 1 + sum(poisson_tail(mu_rec, j) for j in range(2, mu_bwd + 1))  # E[min(max(1, X), mu_bwd)]
    return (T if scheme == "per_batch" else T - k), k


def poisson_tail(rate, j):
    """P(X >= j), X ~ Poisson(rate)."""
    return 1 - sum(math.exp(-rate) * rate**i / math.factorial(i) for i in range(j))


# -----------------------------------------------------------------------------
# The model

class Slot(NamedTuple):
    """A KV-cache slot: one attention call site. A recurrent layer has one per loop step (the same weights see
    other inputs at every step); the prelude's and the coda's layers have step 0."""
    part: str  # "prelude", "recur" or "coda"
    layer: int  # the layer's index within its part
    step: int = 0


class Parcae(nn.Module):
    """The looped language model of METHOD.md §1 (config.injection="none": the fixed-depth Transformer)."""

    def __init__(self, config):
        super().__init__()
        self.config = c = config
        d = c.d_model
        # drawn before any module is built, so one seed gives one init_seed whatever the modules (init_weights)
        self.init_seed = int(torch.randint(2**31, (), device="cpu"))
        self.wte = nn.Embedding(c.padded_vocab_size, d)  # tied with the output head
        # METHOD.md §1: unique layers numbered 0..n-1 across prelude, recurrent block and coda; layer i
        # carries a value embedding when i % 2 == (n - 1) % 2 (alternating, the last layer always)
        self.ve_layers = [i for i in range(c.n_layer) if i % 2 == (c.n_layer - 1) % 2]
        has_ve = [i in self.ve_layers for i in range(c.n_layer)]
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(c.padded_vocab_size, d) for i in self.ve_layers})
        self.prelude = nn.ModuleList(Block(c, has_ve[i]) for i in range(c.n_prelude))
        self.recur = nn.ModuleList(Block(c, has_ve[c.n_prelude + i]) for i in range(c.n_recur))
        self.coda = nn.ModuleList(Block(c, has_ve[c.n_prelude + c.n_recur + i]) for i in range(c.n_coda))
        self.norm_f = nn.RMSNorm(d, eps=c.norm_eps)
        injection = INJECTION_CLASSES[c.injection]  # None: the fixed-depth Transformer, its blocks run once
        looped = injection is not None
        self.prelude_norm = nn.RMSNorm(d, eps=c.norm_eps) if looped and c.prelude_norm else None
        self.injection = injection(d) if looped else None
        # C_proj reads the loop's output for every looped variant, so the Table 4 ablations differ
        # from Parcae only in the injection (METHOD.md §1 puts it after the loop, with no norm before it)
        self.C_proj = nn.Linear(d, d, bias=False) if looped else None
        cos, sin = self._rope_tables(10 * c.seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    def _rope_tables(self, length):
        c = self.config
        inv_freq = 1.0 / (c.rope_base ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # (S, D/2)
        return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]  # (1, S, 1, D/2)

    @torch.no_grad()
    def init_weights(self):
        """METHOD.md §1 "scaled-zero" init, orthogonal as in the authors' code (init_orthogonal=True): every
        matrix that reads the residual stream (q, k, v, the MLP input, wte, C_proj) is truncated
        orthogonal with per-entry std sqrt(2/(5d)); the output projections start at zero; value embeddings,
        ve_gate and the norms keep PyTorch's default init, as in the authors' code.

        Each module draws from the CPU generator seeded by init_seed and its own name, so models built at one
        seed share every initial tensor of the modules they have in common, whatever else they hold: Parcae,
        its injection ablations and the Transformer are paired runs (the evidence suite) down to the weights."""
        std = math.sqrt(2 / (5 * self.config.d_model))
        inits = {self.wte: lambda m: trunc_orthogonal_(m.weight, std)}  # module -> its init; the rest: PyTorch's
        for block in [*self.prelude, *self.recur, *self.coda]:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                inits[lin] = lambda m: trunc_orthogonal_(m.weight, std)
            for lin in (block.attn.c_proj, block.mlp.c_proj):
                inits[lin] = lambda m: nn.init.zeros_(m.weight)
        if self.injection is not None:
            inits[self.injection] = lambda m: m.reset_parameters(std)
            inits[self.C_proj] = lambda m: trunc_orthogonal_(m.weight, std)  # square: every singular value sqrt(2/5)
        initialised = set()  # a module's submodules are set by its own init (the injection's B or adapter)
        with torch.random.fork_rng(devices=[]):  # the caller's global RNG stream is left as it was
            for name, module in self.named_modules():
                init = inits.get(module)
                if init is None and (module in initialised or not hasattr(module, "reset_parameters")
                                     or next(module.parameters(recurse=False), None) is None):
                    continue
                initialised.update(module.modules())
                torch.default_generator.manual_seed(self.init_seed + zlib.crc32(name.encode()))
                init(module) if init else module.reset_parameters()

    def compile_blocks(self, backend="inductor"):
        """Compile each block alone and keep the loop in Python, so a depth that changes every step never
        recompiles. The recurrent blocks see a prefix of the batch (recurrence), so their batch dimension is
        left to dynamo's automatic dynamic shapes: a static, a dynamic and a size-1 graph at most, with and without
        gradient (the loop's n_i steps), and once more for the evals' full batch: 7. A prelude or coda block meets 2
        (training, evals). Forwards of shapes that change with every batch (CORE's rows, eval_core.score_rows) run
        eagerly by choice. backend="eager" traces and guards the same without generating code.

        Two dynamo settings go with it, process-wide. Every block's graphs live in one cache, that of the code of
        Block.forward, whose limit (dynamo's recompile_limit, 8) is meant for one function: it is raised to 8
        per block, so each block keeps dynamo's own budget and none falls back to eager silently. And DDP's graph
        splitting (dynamo's optimize_ddp) is turned off: it splits a graph compiled inside DDP's forward at DDP's
        bucket sizes so that gradient all-reduces overlap the backward, but a block is already one small graph whose
        backward finishes before the next block's starts, so the buckets fill and overlap block by block anyway,
        and the split would only make a DDP run compile other graphs than one process does."""
        blocks = [*self.prelude, *self.recur, *self.coda]
        for block in [*self.prelude, *self.coda]:
            block.compile(dynamic=False, backend=backend)
        for block in self.recur:
            block.compile(dynamic=None, backend=backend)
        budget = 8 * len(blocks)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, budget)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                               budget)
        torch._dynamo.config.optimize_ddp = False

    @torch.no_grad()
    def spectral_radius(self):
        """rho(A_bar) as a 0-d float32 tensor on the weights' device, None unlooped: max(A_bar) for Parcae and 1 for
        add, formed there without a host sync; for concat the largest |eigenvalue| of the adapter's state half
        (computed on the host: injection.rho_on_host)."""
        if self.injection is None:
            return None
        rho = self.injection.spectral_radius()
        return rho if torch.is_tensor(rho) else torch.full((), rho, device=self.wte.weight.device)

    # --- forward
    # Precision under bf16 autocast (every CUDA run; train.py --dtype=bfloat16 runs the same on a CPU):
    # - weights and the residual stream stay float32 at every stage: prelude, loop state h (and h0), coda.
    #   The matmuls (Linear, attention, the head) take bf16 copies and return bf16, which is added into
    #   the float32 stream, so rounding does not accumulate over the T loop steps and every RMSNorm sees a
    #   float32 input with its float32 weight: the fused kernel, no dtype-mismatch fallback.
    # - A_bar and Bbar_e: float32 (DiagonalInjection.discretize, Bbar_e); C_proj's and the concat
    #   adapter's bf16 outputs are cast back to the state's float32 (ConcatInjection, run_coda).
    # - RoPE: float32 angle tables applied in q and k's bf16 (apply_rotary); q, k, v enter attention in bf16.
    # - the head: bf16 logits, cast to float32 before the float32 cross-entropy.

    def forward(self, idx, targets=None, T=None, depths=None, h0=None, cache=None, reduction="mean",
                depth_generator=None, diagnostics=None):
        """idx (B, S) -> logits (B, S, vocab), or with targets (-1 = ignore) the mean cross-entropy ((B, S) per
        token with reduction="none").

        The loop's depths (loop_depths): T, an int, runs every sequence T steps (None: mu_rec, or in training a
        draw of config.sampling from depth_generator); depths = (n, k), two (B,) tensors, replays a draw: sequence
        i runs n_i steps without gradient, then k_i with it. h0 (B, S, d) fixes the initial state. cache: decoding's
        engine.KVCache, which the S new positions extend. diagnostics: a dict filled with the paper's stability
        diagnostics, ||h_T|| and the update ratio ||h_T - h_{T-1}|| / ||h_T|| (0-d tensors, None unlooped).
        """
        B, S = idx.shape
        e, ves, cos, sin = self.run_prelude(idx, cache)
        if self.injection is None:  # the Transformer: its recurrent blocks run once, no injection, no h0
            h, h_prev = self.recurrent_block(e, 0, ves, cos, sin, cache), None
        else:
            n, k = self.loop_depths(B, T, depths, depth_generator)
            if cache is not None and ((n != n[0]).any() or (k != k[0]).any()):
                raise ValueError("decoding with a KV cache runs one depth for the whole batch: give T, not depths")
            h0 = training_initial_state(e.shape, e.device) if h0 is None else h0
            h, h_prev = self.recurrence_longest_first(h0.to(e.dtype), self.injection.Bbar_e(e), n, k, ves, cos, sin,
                                                      cache)
        if diagnostics is not None:
            diagnostics.update(stability_diagnostics(h, h_prev))
        logits = self.run_coda(h, ves, cos, sin, cache)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                               reduction=reduction)
        return loss.view(B, S) if reduction == "none" else loss

    def recurrence(self, h, Bbar_e, n, k, ves, cos, sin, cache=None):
        """The loop (METHOD.md §1) with truncated backprop (§2): sequence i runs n_i steps without gradient, then
        k_i with it. h: h0 (B, S, d); Bbar_e (B, S, d); n, k: (B,) CPU tensors; ves, cos, sin: run_prelude's.

        The batch comes sorted longest first (recurrence_longest_first), n and k both falling, and each
        sequence's steps of a phase end with the phase: so the sequences looping at any step are a prefix of the
        batch (still_looping counts them), each step runs the blocks on those alone (sum(n_i + k_i) sequence-passes,
        not B * max), and every sequence takes its last step in the final iteration. -> (h_T, h_{T-1}), each
        sequence at its own T."""
        A_bar = self.injection.A_bar()  # (d,) for Parcae, None for the baselines; the same at every step
        n_max, grad = int(n[0]), torch.is_grad_enabled()
        for step in range(n_max + int(k[0])):
            looping = still_looping(n, k, step)  # the first `looping` rows; the rest start this phase later
            h_now, Bbar_e_now, ves_now = h[:looping], Bbar_e[:looping], {i: ve[:looping] for i, ve in ves.items()}
            with torch.set_grad_enabled(grad and step >= n_max):  # gradient through the last k_i steps only
                h_now = self.loop_step(h_now, Bbar_e_now, A_bar, step, ves_now, cos, sin, cache)
            h_prev, h = h, (h_now if looping == len(h) else torch.cat([h_now, h[looping:]]))  # the rest keep theirs
        return h, h_prev

    def loop_step(self, h, Bbar_e, A_bar, step, ves, cos, sin, cache=None):
        """One step of the loop (METHOD.md §1): u = A_bar h + Bbar_e, then h = R(u), R the recurrent block at loop
        step `step`. The one place both are applied: recurrence, engine.py's decoding and experiments/bench.py's
        masked reference all step through it. A_bar: injection.A_bar(), formed once per forward."""
        return self.recurrent_block(self.injection(h, Bbar_e, A_bar), step, ves, cos, sin, cache)

    def recurrence_longest_first(self, h, Bbar_e, n, k, ves, cos, sin, cache=None):
        """recurrence on the batch sorted by depth, longest first, and put back in order -> (h_T, h_{T-1})."""
        order = torch.argsort(n + k, descending=True, stable=True)
        if (order == torch.arange(len(order))).all():
            return self.recurrence(h, Bbar_e, n, k, ves, cos, sin, cache)
        rows = order.to(h.device, non_blocking=True)
        h, h_prev = self.recurrence(h[rows], Bbar_e[rows], n[order], k[order], {i: ve[rows] for i, ve in ves.items()},
                                    cos, sin, cache)
        back = torch.argsort(rows)
        return h[back], h_prev[back]

    def loop_depths(self, batch_size, T=None, depths=None, generator=None):
        """forward's T or depths -> (n, k), (B,) CPU long tensors: each sequence's loop steps without gradient,
        then with it (METHOD.md §2). T: every sequence loops T times (mu_rec when None), the last min(T, mu_bwd)
        with gradient in training; with neither T nor depths, training draws them (depths.sample_depths)."""
        if depths is not None and T is not None:
            raise ValueError("give the loop's depth as T or as depths = (n, k), not both")
        if depths is None and T is None and self.training:
            depths = sample_depths(self.config, batch_size, generator)
        elif depths is None:
            T = self.config.mu_rec if T is None else int(T)
            if T < 1:
                raise ValueError(f"recurrence depth T must be >= 1, got {T}")
            depths = split_depths(torch.full((batch_size,), T), self.config.mu_bwd, self.training)
        return checked_depths(depths, batch_size)

    # The pieces of a forward, apart so that engine.py can read the coda's prediction after any recurrent step
    # (adaptive depth) and loop the steps itself.

    def run_prelude(self, idx, cache=None):
        """ids (B, S) -> (e, ves, cos, sin): the prelude's output e (B, S, d), RMS-normed for the loop
        (METHOD.md §1's prelude norm); the value embeddings of the ids by layer index; the RoPE tables of the S
        positions, which it claims in the cache."""
        pos = cache.pos if cache is not None else 0
        S = idx.size(1)
        if pos + S > self.rope_cos.size(1):
            raise ValueError(f"sequence of {pos + S} positions exceeds the RoPE table of {self.rope_cos.size(1)}")
        if cache is not None:
            cache.claim(S)
        ves = {i: self.value_embeds[str(i)](idx) for i in self.ve_layers}
        cos, sin = self.rope_cos[:, pos:pos + S], self.rope_sin[:, pos:pos + S]
        x = self.wte(idx)
        for i, block in enumerate(self.prelude):
            x = block(x, ves.get(i), cos, sin, cache, Slot("prelude", i))
        return (self.prelude_norm(x) if self.prelude_norm is not None else x), ves, cos, sin

    def recurrent_block(self, u, step, ves, cos, sin, cache=None):
        """R: the n_recur recurrent layers on u (B, S, d), at loop step `step` (which names its cache slots)."""
        for i, block in enumerate(self.recur):
            u = block(u, ves.get(self.config.n_prelude + i), cos, sin, cache, Slot("recur", i, step))
        return u

    def run_coda(self, h, ves, cos, sin, cache=None):
        """The loop's output (B, S, d) -> logits (B, S, vocab): C_proj, coda, norm, tied head. The logits are
        float32, or the weights' dtype when wider (a float64 model's are float64), whatever autocast computed."""
        c = self.config
        x = self.C_proj(h).to(h.dtype) if self.C_proj is not None else h  # float32 stream (see forward)
        for i, block in enumerate(self.coda):
            x = block(x, ves.get(c.n_prelude + c.n_recur + i), cos, sin, cache, Slot("coda", i))
        logits = (self.norm_f(x) @ self.wte.weight.t())[..., :c.vocab_size]
        return logits.to(torch.promote_types(self.wte.weight.dtype, torch.float32))

    # --- accounting

    def num_params(self):
        """Every parameter once (the output head is wte itself)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self):
        """The paper's training compute C per token, METHOD.md §2 (Appendix D). Used for FLOP budgets, so that they
        compare with the paper's: train.py's --target_flops horizon and its total FLOPs, the isoFLOP sweeps and
        their fits (experiments/scaling.py), README's sizes table. Not for MFU or FLOP/s: that is
        matmul_flops_per_token, what runs. N excludes wte only, so the value-embedding lookups count as matmuls
        and the tied head does not. N_core is the recurrent blocks' parameters (the value-embedding tables are not
        inside the blocks).

        At the paper's 140M (depth 6, mu_rec 8) C is 1.360e9 and the executed count 1.053e9: C is 29.2% more.
        Of the 3.07e8 gap, the value embeddings' 75.5M parameters, which C counts 6 FLOPs each, give +4.53e8; the
        tied head, which C leaves out, -1.51e8 (6 d V); the sampler's mean depths +5.0e6 (C takes mu_rec and
        mu_bwd steps, per_sequence's mean k is 3.94 < mu_bwd = 4). At the 1.3B C is 27.2% more."""
        c = self.config
        d, S = c.d_model, c.seq_len
        N = self.num_params() - self.wte.weight.numel()
        if self.injection is None:
            return 6 * N + 12 * c.n_layer * d * S
        N_core = sum(p.numel() for p in self.recur.parameters())
        N_nc = N - N_core
        return (6 * N_nc + 3 * (c.n_prelude + c.n_coda) * 4 * d * S
                + c.mu_rec * (2 * N_core + c.n_recur * 4 * d * S)
                + c.mu_bwd * (4 * N_core + 2 * c.n_recur * 4 * d * S))

    def matmul_flops_per_token(self, n=None, k=None, backward=True):
        """The matmul FLOPs executed per token by a training forward + backward (backward=False: a forward alone):
        the numerator of MFU and of every FLOP/s figure (METHOD.md §2): train.py's mfu, experiments/bench.py,
        runs/gpu_check.sh. flops_per_token is the paper's C, for budgets: 29.2% more than this at the 140M, most
        of it the value-embedding lookups that C counts as matmuls (flops_per_token says what makes the gap).

        n, k: loop steps per sequence without and with gradient, numbers or per-sequence tensors (their means
        count: each sequence runs its own steps); None: config.sampling's expected steps (depths.mean_steps).
        A forward runs 2 FLOPs per token for every nn.Linear weight, 2 d V for the tied head and, in each block,
        2 S d for QK^T and 2 S d for AV: causal attention counted in full over S, as FlopCounterMode counts SDPA
        and PaLM's MFU and nanochat's estimate_flops count attention. A backward runs twice its forward (input
        and weight gradients): the prelude, Bbar_e, C_proj, coda and head cost 3x their forward (Bbar_e enters
        every step with gradient, k >= 1 in every sampler, so the prelude is backpropagated in full), a loop step
        with gradient 3x, one without 1x. backward=False runs all n + k steps 1x. The embedding lookups (wte,
        value embeddings) are not matmuls. The Transformer runs its blocks once, whatever n and k.
        """
        c = self.config

        def forward_flops(modules):
            parts = [m for module in modules for m in module.modules()]
            linears = sum(m.weight.numel() for m in parts if isinstance(m, nn.Linear))
            return 2 * linears + sum(isinstance(m, Block) for m in parts) * 4 * c.seq_len * c.d_model

        # per loop step: the recurrent blocks, and concat's adapter (Parcae's B makes Bbar_e once per forward)
        per_step = [*self.recur, *([self.injection] if c.injection == "concat" else [])] \
            if self.injection is not None else []
        step = forward_flops(per_step)
        once = forward_flops([self]) - step + 2 * self.wte.weight.numel()
        if self.injection is None:
            return (3 if backward else 1) * once
        if n is None:
            n, k = mean_steps(c)
        n, k = (torch.as_tensor(x, dtype=torch.float64, device="cpu").mean().item() for x in (n, k))
        return 3 * once + (n + 3 * k) * step if backward else once + (n + k) * step


def still_looping(n, k, step):
    """The number of sequences still looping at loop step `step` of recurrence, the first ones of its longest-first
    batch. Each sequence's steps of a phase end with the phase, so in the no-grad phase (step < max n) sequence i
    loops iff n_i >= the no-grad steps left, max n - step; in the grad phase iff k_i >= max n + max k - step."""
    n_max, k_max = int(n[0]), int(k[0])
    return int((n >= n_max - step).sum()) if step < n_max else int((k >= n_max + k_max - step).sum())


def checked_depths(depths, batch_size):
    """The loop's (n, k) -> two (B,) CPU long tensors, or ValueError where recurrence cannot run them: every
    sequence loops at least once, a longer sequence has no fewer steps of either kind (so the sequences looping
    at any step are a prefix of the longest-first batch) and every k_i is >= 1, or all are 0 (so every sequence
    takes its last step in the loop's final iteration)."""
    n, k = (torch.as_tensor(x).long().cpu().expand(batch_size).clone() for x in depths)
    if (n < 0).any() or (k < 0).any() or (n + k < 1).any():
        raise ValueError(f"depths (n, k) = ({n.tolist()}, {k.tolist()}) must be >= 0 with n + k >= 1 for every "
                         f"sequence")
    order = torch.argsort(n + k, descending=True, stable=True)
    if (n[order].diff() > 0).any() or (k[order].diff() > 0).any():
        raise ValueError("per-sequence depths (n, k) must grow together (longer T: no fewer n and k steps)")
    if (k == 0).any() and (k > 0).any():
        raise ValueError("depths (n, k): k must be >= 1 for every sequence or 0 for all")
    return n, k


@torch.no_grad()
def stability_diagnostics(h, h_prev):
    """The paper's stability diagnostics of a forward: ||h_T|| and ||h_T - h_{T-1}|| / ||h_T||, means over
    the batch's positions (None without a loop: the Transformer)."""
    if h_prev is None:
        return {"h_norm": None, "update_ratio": None}
    h_norm = h.float().norm(dim=-1).mean()
    return {"h_norm": h_norm, "update_ratio": (h - h_prev).float().norm(dim=-1).mean() / h_norm}
