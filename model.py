"""
Parcae, the stable looped language model, and its baselines (METHOD.md §1).

    x = wte(ids); e = RMSNorm(Prelude(x))
    h = h0 ~ TruncNormal(0, sqrt(2/(5d)))
    repeat T times: h = R(A_bar h + Bbar e)         # R: the recurrent block
    logits = RMSNorm(Coda(C_proj(h))) @ wte^T

A loop step is h_{t+1} = R(A_bar h_t + Bbar e), as the authors' code computes it.
The paper writes it loosely as h_{t+1} = A_bar h_t + Bbar e + R(h_t, e).
config.injection picks how the state and the input mix:

- "diagonal" is Parcae, whose A_bar = exp(-Delta exp(A_log)) makes rho(A_bar) < 1.
- "concat" is the adapter of RDM and Huginn.
- "add" is u = h + e.
- "none" is the Transformer, whose blocks run once.

In training config.sampling draws the depths, by default one per sequence (METHOD.md §2).

    model = Parcae(ParcaeConfig.from_depth(6))
    loss = model(idx, targets, h0_generator=g)      # training: depths drawn by config.sampling
    logits = model(idx, T=16)                       # every sequence loops 16 times
    loss = model(idx, targets, depths=(n, k))       # n steps without gradient, then k with it
    stats = {}; model(idx, targets, diagnostics=stats)   # ||h_T|| and the update ratio

The caller owns the randomness, through depth_generator= and h0_generator= (or h0=).
The model keeps no state between forwards.
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

@dataclass
class ParcaeConfig:
    vocab_size: int = 32768
    seq_len: int = 2048
    n_prelude: int = 2
    n_recur: int = 2
    n_coda: int = 2
    d_model: int = 768
    head_dim: int = 128  # so n_head = n_kv_head = d / 128 (METHOD.md §1)
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
                raise ValueError(f"d_model={self.d_model} is not a multiple of head_dim="
                                 f"{self.head_dim}; pick a d_model divisible by it or set head_dim")
            self.n_head = self.d_model // self.head_dim
        elif self.n_head * self.head_dim != self.d_model:
            raise ValueError(f"n_head={self.n_head} x head_dim={self.head_dim} "
                             f"!= d_model={self.d_model}")
        if self.mu_bwd is None:
            self.mu_bwd = math.ceil(self.mu_rec / 2)  # METHOD.md §2: mu_bwd = ceil(mu_rec / 2)
        if self.injection not in INJECTIONS:
            raise ValueError(f"injection={self.injection!r} is not one of {INJECTIONS}")
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"sampling={self.sampling!r} is not one of {tuple(SAMPLINGS)}")
        for name in ("mu_rec", "mu_bwd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if min(self.n_prelude, self.n_recur, self.n_coda) < 0 or self.n_recur < 1:
            raise ValueError("n_prelude and n_coda must be >= 0 and n_recur >= 1")

    @classmethod
    def from_depth(cls, depth, **overrides):
        """The paper's sizes, L_P = L_R = L_C = depth/3 and d = 128 (depth/3 + 4) (METHOD.md §1).
        Depth 6 gives the 140M."""
        if depth <= 0 or depth % 3 != 0:
            raise ValueError(f"depth={depth} must be a positive multiple of 3 (prelude, recurrent "
                             f"block and coda take a third each); try --depth=6, 12, 18 or 24")
        third = depth // 3
        sizes = dict(n_prelude=third, n_recur=third, n_coda=third, d_model=128 * (third + 4))
        return cls(**{**sizes, **overrides})

    @property
    def n_layer(self):
        return self.n_prelude + self.n_recur + self.n_coda

    @property
    def padded_vocab_size(self):
        return -(-self.vocab_size // 64) * 64  # padded up to a multiple of 64 (METHOD.md §1)

    @property
    def backprop_depth(self):
        """The most loop steps a sequence backpropagates under its sampler, which memory follows.
        It is mu_bwd where k is capped there, 2 mu_bwd for poisson_unbounded's k ~ U{1..2 mu_bwd},
        and for poisson_full's k = max(1, Poisson(r)) the k passed once in 10^6 draws."""
        if self.sampling == "poisson_unbounded":
            return 2 * self.mu_bwd
        if self.sampling == "poisson_full":
            rate = max(self.mu_rec, self.mu_bwd)
            return next(k for k in range(1, 10 * rate + 100) if poisson_tail(rate, k + 1) < 1e-6)
        return min(self.mu_rec, self.mu_bwd) if self.sampling == "fixed" else self.mu_bwd


# -----------------------------------------------------------------------------
# Building blocks

def apply_rotary(x, cos, sin):
    """RoPE on (B, S, H, D), rotating the two halves of each head (nanochat's layout)."""
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # float32 tables would lift bf16 q, k to float32
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, config, has_value_embed):
        super().__init__()
        d, self.n_head, self.head_dim = config.d_model, config.n_head, config.head_dim
        self.c_q = nn.Linear(d, d, bias=False)
        self.c_k = nn.Linear(d, d, bias=False)
        self.c_v = nn.Linear(d, d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        # METHOD.md §1 value embeddings: v += 2 * sigmoid(ve_gate(x[..., :32])) * ve
        self.ve_gate = nn.Linear(min(32, d), self.n_head, bias=False) if has_value_embed else None

    def forward(self, x, ve, cos, sin, cache=None, slot=None):
        B, S, _ = x.shape
        H, D = self.n_head, self.head_dim
        v = self.c_v(x).view(B, S, H, D)
        if self.ve_gate is not None:
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :self.ve_gate.in_features]))  # (B, S, H)
            v = v + gate.unsqueeze(-1) * ve.view(B, S, H, D)
        # RoPE, then a parameter-free RMS norm per head, the dtype's eps, on q and k (METHOD.md §1)
        qk = torch.cat([self.c_q(x).view(B, S, H, D), self.c_k(x).view(B, S, H, D)], dim=2)
        q, k = F.rms_norm(apply_rotary(qk, cos, sin), (D,)).transpose(1, 2).split(H, dim=1)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(slot, k, v)
        S_kv = k.size(2)
        if S == S_kv:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif S == 1:  # one new token attends to everything cached
            y = F.scaled_dot_product_attention(q, k, v)
        else:  # a chunk after a cached prefix attends causally, its mask aligned to the end
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
    """A pre-norm transformer block, x + Attn(RMSNorm(x)), then x + MLP(RMSNorm(x))."""

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
# An injection mixes the state h with the prelude's e as u = A_bar h + Bbar e (METHOD.md §1).
# Each owns its parameters and their init. A_bar() and Bbar_e(e) are the same at every step,
# so the loop forms them once per forward.

def trunc_normal_(weight, std, generator=None):
    return nn.init.trunc_normal_(weight, std=std, a=-3 * std, b=3 * std, generator=generator)


@torch.no_grad()
def trunc_orthogonal_(weight, std):
    """The authors' truncated orthogonal init gives each entry std `std`, as an i.i.d. draw would.
    But every singular value equals std * sqrt(max(rows, cols)) instead of spreading out."""
    rows, cols = weight.shape
    a = torch.empty(max(rows, cols), min(rows, cols), device=weight.device, dtype=torch.float32)
    q, r = torch.linalg.qr(nn.init.trunc_normal_(a, a=-2.0, b=2.0))
    q = q * torch.diagonal(r).sign()  # signs fixed by diag(R), so that Q is uniformly distributed
    return weight.copy_(q if rows >= cols else q.t()).mul_(std * math.sqrt(max(rows, cols)))


class Injection(nn.Module):
    """The baselines' defaults, whose input term is e itself, with no A_bar to form ahead."""

    rho_on_host = False  # spectral_radius runs on the weights' device, so logging it is free

    def reset_parameters(self, std):
        pass

    def Bbar_e(self, e):
        return e

    def A_bar(self):
        return None


class Discretized(NamedTuple):
    A_bar: torch.Tensor  # (d,) the state's per-channel decay, every entry in [0, 1)
    delta: torch.Tensor  # (d,) the step size Delta = softplus(dt_bias)


class DiagonalInjection(Injection):
    """Parcae's injection, A_bar = exp(-Delta exp(A_log)), Bbar = Delta B, rho = max(A_bar) < 1."""

    def __init__(self, d):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(d))
        self.dt_bias = nn.Parameter(torch.zeros(d))
        self.B = nn.Linear(d, d, bias=False)

    @torch.no_grad()
    def reset_parameters(self, std):
        """The paper's init sets A_log = 0, Delta = -ln(sqrt(1/5)) and B = I (METHOD.md §1).
        So A_bar = sqrt(1/5) = 0.4472."""
        self.A_log.zero_()
        self.dt_bias.fill_(math.log(math.expm1(-math.log(math.sqrt(1 / 5)))))
        self.B.weight.copy_(torch.eye(self.B.weight.size(0)))

    def discretize(self):
        """The zero-order hold of A = Diag(-exp(A_log)) with step Delta, in float32.
        It puts every entry of A_bar in [0, 1)."""
        delta = F.softplus(self.dt_bias)
        # Adding logs avoids 0 * inf. Below a rate of ~3e-8 float32 rounds exp(-rate) to 1,
        # so the 1e-6 floor keeps A_bar < 1. Past a rate of ~104, A_bar underflows to 0.
        rate = torch.exp(self.A_log + torch.log(delta)).clamp(min=1e-6)
        return Discretized(A_bar=torch.exp(-rate), delta=delta)

    def Bbar_e(self, e):
        return self.discretize().delta * self.B(e)  # Euler's Bbar = Delta B, float32 like A_bar

    def A_bar(self):
        return self.discretize().A_bar

    def forward(self, h, Bbar_e, A_bar=None):
        return (self.A_bar() if A_bar is None else A_bar) * h + Bbar_e

    @torch.no_grad()
    def spectral_radius(self):
        return self.discretize().A_bar.max()


class ConcatInjection(Injection):
    """The adapter of RDM and Huginn, u = W [h; e] with W a Linear(2d -> d).
    Its state half is an unconstrained A_bar."""

    # rho is an eigendecomposition that LAPACK runs on the host after a sync, so it is logged rarely
    rho_on_host = True

    def __init__(self, d):
        super().__init__()
        self.adapter = nn.Linear(2 * d, d, bias=False)

    @torch.no_grad()
    def reset_parameters(self, std):
        # the authors' "adapter" rule draws i.i.d. truncated normals, even beside orthogonal ones
        trunc_normal_(self.adapter.weight, std)

    def forward(self, h, Bbar_e, A_bar=None):
        return self.adapter(torch.cat([h, Bbar_e], dim=-1)).to(h.dtype)  # the state stays float32

    @torch.no_grad()
    def spectral_radius(self):
        state_half = self.adapter.weight[:, :self.adapter.out_features].float()
        return torch.linalg.eigvals(state_half).abs().max()


class AddInjection(Injection):
    """Addition, u = h + e, so A_bar = I and rho = 1 (marginally stable). It has no parameters."""

    def __init__(self, d):
        super().__init__()

    def forward(self, h, Bbar_e, A_bar=None):
        return h + Bbar_e

    def spectral_radius(self):
        return 1.0


INJECTION_CLASSES = {"diagonal": DiagonalInjection, "concat": ConcatInjection, "add": AddInjection}
INJECTIONS = (*INJECTION_CLASSES, "none")  # "none" is the Transformer


# -----------------------------------------------------------------------------
# h0 is the loop's initial state (METHOD.md §1). Training draws a fresh one from the generator
# it hands forward; evaluation and decoding pass their own. No draw uses torch's global RNG.

def initial_state(shape, device=None, generator=None):
    """h0 ~ TruncNormal(0, s, -3s..3s), s = sqrt(2 / (5 d)), float32 of `shape` (B, S, d).
    generator is a torch.Generator on `device`, or a list of one per row."""
    if isinstance(generator, (list, tuple)):
        return torch.cat([initial_state((1, *shape[1:]), device, g) for g in generator])
    sigma = math.sqrt(2 / (5 * shape[-1]))
    return trunc_normal_(torch.empty(shape, device=device, dtype=torch.float32), sigma, generator)


def evaluation_initial_state(d_model, length, seed, device):
    """Evaluation's h0 (1, length, d) is one seeded table every row reads, so scores reproduce."""
    generator = torch.Generator().manual_seed(seed)
    return initial_state((1, length, d_model), "cpu", generator).to(device)


# -----------------------------------------------------------------------------
# The depths are the loop steps each sequence of a training forward runs (METHOD.md §2), n_i steps
# without gradient, then k_i with it. Parcae.loop_depths, right after forward, draws them from here.
# Each sampler's text says what it draws, then its mean executed (n + k) and backprop (k) steps,
# at mu_rec 8, mu_bwd 4; "mu_rec - mu_bwd" means max(0, mu_rec - mu_bwd).
# The Poisson ones are the authors' other per-batch schemes (their names, "-" written "_").
SAMPLINGS = {
    "per_sequence": "Parcae: T_i = max(1, Poisson(mu_rec)) per sequence, n_i = T_i - k_i, "
                    "k_i = min(T_i, mu_bwd); executes mu_rec + exp(-mu_rec) (8.00), "
                    "backprops E[min(T, mu_bwd)] (3.94)",
    "per_batch": "the authors' per-batch ablation (their poisson-truncated-full, per-batch): "
                 "one T = max(1, Poisson(mu_rec)) per micro-batch, n = T, then k = min(T, mu_bwd) "
                 "more; executes E[T] + E[min(T, mu_bwd)] (11.94), backprops 3.94",
    "per_batch_split": "per_sequence's depths drawn once per micro-batch: one T, n = T - k, "
                       "k = min(T, mu_bwd); executes 8.00, backprops 3.94 (per_sequence's compute)",
    "poisson_unbounded": "per micro-batch n ~ Poisson(mu_rec - mu_bwd), k ~ U{1..2 mu_bwd}; "
                         "executes mu_rec + 1/2 (8.5), backprops mu_bwd + 1/2 (4.5)",
    "poisson_fill": "per micro-batch n ~ Poisson(mu_rec - mu_bwd), k = mu_bwd; executes mu_rec "
                    "(8), backprops mu_bwd (4)",
    "poisson_full": "per micro-batch n = 0, k = max(1, Poisson(r)), r = max(mu_rec, mu_bwd): full "
                    "backprop, memory grows with k; executes and backprops r + exp(-r) (8.00)",
    "fixed": "T = mu_rec always, n = T - k, k = min(T, mu_bwd) (the paper's mu_rec = 1 fixed-depth "
             "Parcae); executes mu_rec (8), backprops min(mu_rec, mu_bwd) (4)",
}


def sample_depths(config, batch_size, generator=None):
    """One training draw of config.sampling -> (n, k), two (B,) long tensors.
    Only per_sequence draws per sequence. The others draw once per micro-batch, as the authors'."""
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
        k = poisson(rest + mu_bwd).clamp_(min=1)  # rest + mu_bwd = max(mu_rec, mu_bwd)
        n = torch.zeros_like(k)
    else:
        fixed = scheme == "fixed"
        T = torch.full((draws,), config.mu_rec) if fixed else poisson(config.mu_rec).clamp_(min=1)
        n, k = split_depths(T, mu_bwd, training=True)
        if scheme == "per_batch":
            n = T  # the authors' per-batch path runs all T steps without grad, then k more with it
    return n.expand(batch_size).clone(), k.expand(batch_size).clone()


def split_depths(depths, mu_bwd, training):
    """Split depths T into (n, k).
    In training the last k = min(T, mu_bwd) steps have gradient, and otherwise none has."""
    k = depths.clamp(max=mu_bwd) if training else torch.zeros_like(depths)
    return depths - k, k


def mean_steps(config):
    """The expected (n, k), steps without / with gradient, of one sequence under config.sampling.
    These are the means SAMPLINGS states."""
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
    """A KV-cache slot names one attention call site, so a recurrent layer has one per loop step."""
    part: str  # "prelude", "recur" or "coda"
    layer: int  # the layer's index within its part
    step: int = 0  # the loop step; 0 in the prelude and the coda


def value_embedding_layers(config):
    """Layers are numbered 0..n-1 across prelude, recurrent block and coda (METHOD.md §1).
    Layer i has a value embedding when i % 2 == (n - 1) % 2, every other one, the last included."""
    return [i for i in range(config.n_layer) if i % 2 == (config.n_layer - 1) % 2]


class Parcae(nn.Module):
    """The looped language model of METHOD.md §1, or under injection "none" the Transformer."""

    def __init__(self, config):
        super().__init__()
        self.config = c = config
        d = c.d_model
        # drawn before any module is built, so one seed gives one init_seed whatever the modules
        self.init_seed = int(torch.randint(2**31, (), device="cpu"))
        self.wte = nn.Embedding(c.padded_vocab_size, d)  # tied with the output head
        self.ve_layers = value_embedding_layers(c)
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(c.padded_vocab_size, d)
                                           for i in self.ve_layers})
        blocks = [Block(c, i in self.ve_layers) for i in range(c.n_layer)]
        self.prelude = nn.ModuleList(blocks[:c.n_prelude])
        self.recur = nn.ModuleList(blocks[c.n_prelude:c.n_prelude + c.n_recur])
        self.coda = nn.ModuleList(blocks[c.n_prelude + c.n_recur:])
        self.norm_f = nn.RMSNorm(d, eps=c.norm_eps)
        injection = INJECTION_CLASSES.get(c.injection)  # None for the fixed-depth Transformer
        self.prelude_norm = nn.RMSNorm(d, eps=c.norm_eps) if injection and c.prelude_norm else None
        self.injection = injection(d) if injection else None
        # C_proj reads the loop's output with no norm before it (METHOD.md §1), in every looped
        # variant, so the injection ablations differ from Parcae in the injection alone
        self.C_proj = nn.Linear(d, d, bias=False) if injection else None
        self.init_buffers()
        self.init_weights()

    def init_buffers(self):
        """Compute the RoPE tables, buffers left out of the state dict.
        A model built on the meta device, then loaded with assign=True, computes them here."""
        c = self.config
        channels = torch.arange(0, c.head_dim, 2, dtype=torch.float32)
        inv_freq = 1.0 / (c.rope_base ** (channels / c.head_dim))
        positions = torch.arange(10 * c.seq_len, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)[None, :, None, :]  # (1, S, 1, D/2)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    @torch.no_grad()
    def init_weights(self):
        """METHOD.md §1's "scaled-zero" init, orthogonal as in the authors' code.
        Each module draws from a generator seeded by init_seed and its name.
        So variants built at one seed share every common module's tensors, and their runs pair."""
        std = math.sqrt(2 / (5 * self.config.d_model))
        with torch.random.fork_rng(devices=[]):  # the caller's global RNG stream is left as it was
            for name, module in self.named_modules():
                leaf = name.rsplit(".", 1)[-1]
                owns = next(module.parameters(recurse=False), None) is not None
                if name.startswith("injection.") or not (owns or leaf == "injection"):
                    continue  # the injection's init sets its B or adapter
                torch.default_generator.manual_seed(self.init_seed + zlib.crc32(name.encode()))
                if leaf in ("wte", "c_q", "c_k", "c_v", "c_fc", "C_proj"):
                    trunc_orthogonal_(module.weight, std)
                elif leaf == "c_proj":  # each block's output projections start at zero
                    nn.init.zeros_(module.weight)
                elif leaf == "injection":
                    module.reset_parameters(std)
                else:  # norms, value embeddings and their gates keep torch's init
                    module.reset_parameters()

    # --- forward, then the parts of the loop it runs, in order (depths, recurrence, loop step).
    # Under bf16 autocast the weights and the residual stream (prelude, h0, h, coda) stay float32.
    # The matmuls' bf16 outputs are added into it, so rounding does not build up over T steps.
    # Every RMSNorm sees float32 with its float32 weight (the fused kernel).
    # A_bar and Bbar e are float32; RoPE runs in bf16; the logits are float32 for the loss.

    def forward(self, idx, targets=None, T=None, depths=None, h0=None, cache=None, reduction="mean",
                depth_generator=None, h0_generator=None, diagnostics=None):
        """idx (B, S) -> logits (B, S, vocab).
        - With targets (-1 is ignored) it returns the cross-entropy, (B, S) with reduction="none".
        - T or depths = (n, k) give the steps without / with gradient per sequence (loop_depths).
        - h0 (B, S, d) is the initial state. Without it h0_generator draws one on idx's device.
          With neither, training raises ValueError and eval mode draws from a generator seeded 0.
        - cache is decoding's KV cache, which the S new positions extend.
        - diagnostics is a dict that gets ||h_T|| and the update ratio."""
        Bbar_e, ves, cos, sin = self.run_prelude(idx, cache)
        if self.injection is None:  # the Transformer runs its recurrent blocks once on e, no h0
            h, h_prev = self.recurrent_block(Bbar_e, 0, ves, cos, sin, cache), None
        else:
            n, k = self.loop_depths(idx.size(0), T, depths, depth_generator)
            if cache is not None and ((n != n[0]).any() or (k != k[0]).any()):
                raise ValueError("a KV cache runs one depth for every row: give T, not depths")
            if h0 is None:
                h0 = self.draw_h0(Bbar_e.shape, Bbar_e.device, h0_generator)
            h, h_prev = self.recurrence(h0.to(Bbar_e.dtype), Bbar_e, n, k, ves, cos, sin, cache)
        if diagnostics is not None:
            diagnostics.update(stability_diagnostics(h, h_prev))
        if targets is None:
            return self.run_coda(h, ves, cos, sin, cache)
        return self.coda_loss(h, ves, cos, sin, targets, reduction)

    def draw_h0(self, shape, device, generator=None):
        """h0 from generator; without one, eval mode's fixed draw (seed 0), so scores reproduce."""
        if generator is not None:
            return initial_state(shape, device, generator)
        if self.training:
            raise ValueError("a training forward needs h0= or h0_generator=: "
                             "its h0 is drawn from the caller's generator (METHOD.md §1)")
        return initial_state(shape, "cpu", torch.Generator().manual_seed(0)).to(device)

    def loop_depths(self, batch_size, T=None, depths=None, generator=None):
        """forward's T or depths -> (n, k), two (B,) CPU long tensors (METHOD.md §2).
        Sequence i loops n_i steps without gradient, then k_i with it. T gives T steps each (None
        means mu_rec), and in training the last min(T, mu_bwd) have gradient. depths gives (n, k)
        as they are. With neither, training draws them with sample_depths."""
        if depths is not None and T is not None:
            raise ValueError("give the loop's depth as T or as depths = (n, k), not both")
        if depths is None and T is None and self.training:
            depths = sample_depths(self.config, batch_size, generator)
        elif depths is None:
            T = self.config.mu_rec if T is None else int(T)
            depths = split_depths(torch.full((batch_size,), T), self.config.mu_bwd, self.training)
        # recurrence needs a longer sequence to have no fewer steps of either kind.
        # And k_i >= 1 for all or none, so every sequence ends at the loop's last step.
        n, k = (torch.as_tensor(x).long().cpu().expand(batch_size).clone() for x in depths)
        if (n < 0).any() or (k < 0).any() or (n + k < 1).any():
            raise ValueError(f"depths (n, k) = ({n.tolist()}, {k.tolist()}) must be >= 0 with "
                             f"n + k >= 1 for every sequence")
        order = torch.argsort(n + k, descending=True, stable=True)
        if (n[order].diff() > 0).any() or (k[order].diff() > 0).any():
            raise ValueError("per-sequence depths (n, k) must grow together "
                             "(longer T: no fewer n and k steps)")
        if (k == 0).any() and (k > 0).any():
            raise ValueError("depths (n, k): k must be >= 1 for every sequence or 0 for all")
        return n, k

    def recurrence(self, h, Bbar_e, n, k, ves, cos, sin, cache=None):
        """The loop (METHOD.md §1) with truncated backprop (§2) -> (h_T, h_{T-1}).
        h is h0 (B, S, d), and n, k are loop_depths' (n_i steps without gradient, then k_i with it).

        No step is spent on a sequence that has stopped. Rows are sorted longest first.
        Each row's no-grad steps end with the no-grad phase, its grad steps with the loop.
        So the rows looping at a step are the first ones, sum(n_i + k_i) row-steps in all.
        For example, in training T = (7, 3, 1) and mu_bwd 4 give k = (4, 3, 1) and n = (3, 0, 0).

            step        0    1    2  |  3    4       5       6
            rows       {0}  {0}  {0} | {0}  {0, 1}  {0, 1}  {0, 1, 2}
            gradient    no   no   no | yes  yes     yes     yes

        Row 0 runs 7 steps, row 1 its 3 at steps 4-6 and row 2 its 1 at step 6, so all end together.
        """
        order = torch.argsort(n + k, descending=True, stable=True)
        rows = order.to(h.device, non_blocking=True)
        h, Bbar_e, n, k = h[rows], Bbar_e[rows], n[order], k[order]
        ves = {i: ve[rows] for i, ve in ves.items()}
        A_bar = self.injection.A_bar()  # (d,) for Parcae, None for the baselines
        n_max, k_max, grad = int(n[0]), int(k[0]), torch.is_grad_enabled()
        for step in range(n_max + k_max):
            # the first `looping` rows have at least as many steps as are left in this phase
            if step < n_max:
                looping = int((n >= n_max - step).sum())  # n_max - step steps without gradient left
            else:
                looping = int((k >= n_max + k_max - step).sum())  # n_max + k_max - step with it
            # one step on those rows; the others keep their state
            h_now, Bbar_e_now = h[:looping], Bbar_e[:looping]
            ves_now = {i: ve[:looping] for i, ve in ves.items()}
            with torch.set_grad_enabled(grad and step >= n_max):  # gradient in the last k_i steps
                h_now = self.loop_step(h_now, Bbar_e_now, A_bar, step, ves_now, cos, sin, cache)
            h_prev, h = h, (h_now if looping == len(h) else torch.cat([h_now, h[looping:]]))
        back = torch.argsort(rows)  # back in the caller's order
        return h[back], h_prev[back]

    def loop_step(self, h, Bbar_e, A_bar, step, ves, cos, sin, cache=None):
        """One loop step, h -> R(A_bar h + Bbar e), the only place the loop's update is written."""
        return self.recurrent_block(self.injection(h, Bbar_e, A_bar), step, ves, cos, sin, cache)

    def recurrent_block(self, u, step, ves, cos, sin, cache=None):
        """R, the recurrent layers on u (B, S, d) at loop step `step`, which names their slots."""
        for i, block in enumerate(self.recur):
            ve = ves.get(self.config.n_prelude + i)
            u = block(u, ve, cos, sin, cache, Slot("recur", i, step))
        return u

    # The prelude and the coda stand apart from forward so that decoding can run the loop itself.

    def run_prelude(self, idx, cache=None):
        """ids (B, S) -> (Bbar_e, ves, cos, sin). Bbar_e (B, S, d) is the loop's input term, Bbar e
        of the prelude's normed output e, or e itself for the baselines without a B and the
        Transformer. ves holds the value embeddings by layer, cos, sin the S positions' RoPE."""
        pos = cache.pos if cache is not None else 0
        S = idx.size(1)
        if pos + S > self.rope_cos.size(1):
            raise ValueError(f"sequence of {pos + S} positions exceeds the RoPE table of "
                             f"{self.rope_cos.size(1)}")
        if cache is not None:
            cache.claim(S)
        ves = {i: self.value_embeds[str(i)](idx) for i in self.ve_layers}
        cos, sin = self.rope_cos[:, pos:pos + S], self.rope_sin[:, pos:pos + S]
        x = self.wte(idx)
        for i, block in enumerate(self.prelude):
            x = block(x, ves.get(i), cos, sin, cache, Slot("prelude", i))
        e = self.prelude_norm(x) if self.prelude_norm is not None else x
        return (self.injection.Bbar_e(e) if self.injection is not None else e), ves, cos, sin

    def run_coda(self, h, ves, cos, sin, cache=None):
        """The loop's output (B, S, d) -> logits (B, S, vocab), float32 or the weights' if wider."""
        c = self.config
        x = self.C_proj(h).to(h.dtype) if self.C_proj is not None else h  # the float32 stream
        for i, block in enumerate(self.coda):
            x = block(x, ves.get(c.n_prelude + c.n_recur + i), cos, sin, cache, Slot("coda", i))
        logits = (self.norm_f(x) @ self.wte.weight.t())[..., :c.vocab_size]
        return logits.to(torch.promote_types(self.wte.weight.dtype, torch.float32))

    def coda_loss(self, h, ves, cos, sin, targets, reduction="mean"):
        """The cross-entropy of run_coda with targets (-1 ignored), (B, S) for reduction="none"."""
        logits = self.run_coda(h, ves, cos, sin)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=-1, reduction=reduction)
        return loss.view(targets.shape) if reduction == "none" else loss

    # --- compilation and the spectral radius

    def compile_regions(self, backend="inductor"):
        """Compile run_prelude (with Bbar e), loop_step (the Transformer's recurrent_block),
        coda_loss and run_coda, each a graph, and keep the loop in Python. In coda_loss's graph the
        loss reads the head's bf16 logits, so float32 ones are never stored, forward or backward.
        The loop step runs on the rows still looping, a prefix of the batch. Its row count is
        dynamic, so a new depth does not recompile, one row included.
        Decoding runs them eagerly (engine.py), since each token's cache position is new."""
        for name, dynamic in (("run_prelude", False), ("coda_loss", False), ("run_coda", False),
                              ("loop_step" if self.injection else "recurrent_block", None)):
            plain = getattr(type(self), name).__get__(self)  # the method, compiled before or not
            setattr(self, name, torch.compile(plain, dynamic=dynamic, backend=backend))
        # a row count of one then gets no graph of its own, since no broadcast reads it as special
        torch.fx.experimental._config.backed_size_oblivious = True
        # the loop step compiles graphs with and without gradient, its first step, one row, evals
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
        # a region's backward hands DDP its gradients region by region, to all-reduce meanwhile;
        # DDP's graph splitting would only compile other graphs than one process does
        torch._dynamo.config.optimize_ddp = False

    @torch.no_grad()
    def spectral_radius(self):
        """rho(A_bar), a 0-d float32 tensor on the weights' device; None unlooped.
        Parcae's is max(A_bar), addition's 1, concat's the top |eigenvalue| of its state half."""
        if self.injection is None:
            return None
        return torch.as_tensor(self.injection.spectral_radius(), device=self.wte.weight.device)

    # --- accounting

    def num_params(self):
        """Every parameter once (the output head is wte itself)."""
        return sum(p.numel() for p in self.parameters())

    def paper_flops_per_token(self):
        """The paper's training compute C per token (METHOD.md §2, its Appendix D).
        FLOP budgets use it, so they compare with the paper's; what runs is matmul_flops_per_token.
        N leaves out wte alone, as C counts value-embedding lookups as matmuls, not the tied head.
        At the 140M (depth 6, mu_rec 8) C = 1.360e9, 29.2% above its matmul FLOPs (1.3B: 27.2%)."""
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
        """The matmul FLOPs a training forward and backward run per token, for MFU (METHOD.md §2).
        backward=False counts a forward alone. n and k are the loop steps without and with
        gradient, as numbers or per-sequence tensors whose means count. None takes mean_steps.
        A forward costs 2 per nn.Linear weight and 2 d V for the tied head, and attention 4 S d per
        block, over all S x S, as FlopCounterMode counts it. Lookups cost nothing, and a backward
        twice its forward. All outside the loop is backpropagated (Bbar e is in each step)."""
        c = self.config

        def forward_flops(modules):
            parts = [m for module in modules for m in module.modules()]
            linears = sum(m.weight.numel() for m in parts if isinstance(m, nn.Linear))
            blocks = sum(isinstance(m, Block) for m in parts)
            return 2 * linears + blocks * 4 * c.seq_len * c.d_model

        # a loop step runs the recurrent blocks and concat's adapter (Parcae's B makes Bbar e once)
        per_step = [*self.recur, *([self.injection] if c.injection == "concat" else [])]
        # the Transformer runs its blocks once, whatever n and k
        step = forward_flops(per_step) if self.injection is not None else 0
        once = forward_flops([self]) - step + 2 * self.wte.weight.numel()
        if n is None:
            n, k = mean_steps(c)
        n, k = (torch.as_tensor(x, dtype=torch.float64, device="cpu").mean().item() for x in (n, k))
        return 3 * once + (n + 3 * k) * step if backward else once + (n + k) * step


def from_weights(config, state_dict, device="cpu"):
    """A Parcae holding state_dict's tensors, in eval mode on device, with no random init.
    config is a checkpoint's dict. One that builds no Parcae, or weights of other shapes, raise
    ValueError. The model is sized on the meta device, then given the tensors cast to its dtypes."""
    try:
        with torch.device("meta"):
            model = Parcae(ParcaeConfig(**config))
    except (TypeError, ValueError, ArithmeticError, RuntimeError) as err:
        raise ValueError(f"the checkpoint's config builds no Parcae ({type(err).__name__}: "
                         f"{err})") from None
    dtypes = {name: tensor.dtype for name, tensor in model.state_dict().items()}
    weights = {name: value.to(dtypes.get(name, value.dtype)) for name, value in state_dict.items()}
    try:
        model.load_state_dict(weights, assign=True)
    except RuntimeError as err:  # missing, unexpected or misshapen tensors, over several lines
        why = " ".join(str(err).split())[:300]
        raise ValueError(f"the checkpoint's weights do not fit its config ({why})") from None
    model.init_buffers()  # the RoPE tables, which no checkpoint carries
    return model.to(device).eval()


@torch.no_grad()
def stability_diagnostics(h, h_prev):
    """The paper's stability diagnostics, ||h_T|| and ||h_T - h_{T-1}|| / ||h_T||.
    Each is a mean over the batch's positions; None without a loop (the Transformer)."""
    if h_prev is None:
        return {"h_norm": None, "update_ratio": None}
    h_norm = h.float().norm(dim=-1).mean()
    return {"h_norm": h_norm, "update_ratio": (h - h_prev).float().norm(dim=-1).mean() / h_norm}
