"""
model.py: Parcae, the stable looped language model, and its baselines.

    x  = wte(ids); x = Prelude(x); e = RMSNorm(x)        # SPEC 1
    h0 ~ TruncNormal(0, sqrt(2/(5d)))
    repeat T times: h = R(Abar * h + Bbar(e))            # the recurrent block R, looped
    logits = RMSNorm(Coda(C_proj(h))) @ wte^T

`injection` picks the update: "diagonal" (Parcae: Abar = exp(-Delta exp(A_log)), rho < 1 always),
"concat" (RDM / Huginn: a Linear(2d -> d) adapter), "add" (u = h + e, rho = 1), and "none" (the
fixed-depth Transformer baseline: the same blocks run once, in order).

Training samples a recurrence depth per sequence, T_i = max(1, Poisson(mu_rec)), runs the first
n_i = T_i - k_i steps without gradient and the last k_i = min(T_i, mu_bwd) with it (SPEC 2).

torch.compile: `model.compile_blocks()` compiles each transformer block on its own; the loop over a
depth that changes every batch stays in Python, so changing depths cause no recompilation.

Use: model = Parcae(ParcaeConfig.from_depth(6)); loss = model(idx, targets); logits = model(idx, T=16)
"""

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# Configuration

INJECTIONS = ("diagonal", "concat", "add", "none")
SAMPLINGS = ("per_sequence", "per_batch", "fixed")


@dataclass
class ParcaeConfig:
    vocab_size: int = 32768
    seq_len: int = 2048
    n_prelude: int = 2
    n_recur: int = 2
    n_coda: int = 2
    d_model: int = 768
    head_dim: int = 128  # SPEC 1: head_dim 128, n_head = n_kv_head = d / 128
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
            self.mu_bwd = math.ceil(self.mu_rec / 2)  # SPEC 2: mu_bwd = ceil(mu_rec / 2)
        if self.injection not in INJECTIONS:
            raise ValueError(f"injection={self.injection!r} is not one of {INJECTIONS}")
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"sampling={self.sampling!r} is not one of {SAMPLINGS}")
        if self.mu_rec < 1 or self.mu_bwd < 1:
            raise ValueError(f"mu_rec={self.mu_rec} and mu_bwd={self.mu_bwd} must be at least 1")
        if min(self.n_prelude, self.n_recur, self.n_coda) < 0 or self.n_recur < 1:
            raise ValueError("n_prelude and n_coda must be >= 0 and n_recur >= 1")

    @classmethod
    def from_depth(cls, depth, **overrides):
        """SPEC 1 sizes: d = 128 * (depth/3 + 4), L_P = L_R = L_C = depth/3 (depth 6/12/18/24 = 140M..1.3B)."""
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
        return -(-self.vocab_size // 64) * 64  # SPEC 1: vocab padded up to a multiple of 64


# -----------------------------------------------------------------------------
# Depth sampling (SPEC 2)

def sample_depths(config, batch_size, generator=None):
    """T_i = max(1, Poisson(mu_rec)): one draw per sequence (Parcae) or one per micro-batch (ablation);
    "fixed" trains at T = mu_rec always (the paper's mu_rec = 1 fixed-depth Parcae, and tests)."""
    if config.sampling == "fixed":
        return torch.full((batch_size,), config.mu_rec, dtype=torch.long)
    n_draws = batch_size if config.sampling == "per_sequence" else 1
    rate = torch.full((n_draws,), float(config.mu_rec))
    depths = torch.poisson(rate, generator=generator).long().clamp_(min=1)
    return depths.expand(batch_size).clone()


def split_depths(depths, mu_bwd, training):
    """Per sequence: n no-grad steps then k = min(T, mu_bwd) grad steps. Evaluation: all T without grad."""
    k = depths.clamp(max=mu_bwd) if training else torch.zeros_like(depths)
    return depths - k, k


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


class KVCache:
    """Keys and values for decoding, one slot per attention call site: a prelude or coda layer, or a
    recurrent layer at one loop step (SPEC 1 loops the same weights, but each step sees other inputs).

    Each slot is one buffer per keys and values, (B, H, max_len, D), allocated at its first write and
    written in place: a new position never copies what is cached (nanochat's engine does the same)."""

    def __init__(self, max_len):
        self.max_len = max_len
        self.slots = {}  # slot -> (k, v) buffers, each (B, H, max_len, D)
        self.pos = 0  # positions claimed so far, those of the forward under way included

    def claim(self, length):
        """The next forward's `length` positions (run_prelude calls it before any layer writes)."""
        if self.pos + length > self.max_len:
            raise ValueError(f"{self.pos + length} positions exceed the KV cache's {self.max_len}; "
                             f"size the cache for the prompt plus every new token")
        self.pos += length

    def buffers(self, slot, like):
        """The slot's (k, v) buffers, allocated like `like` (B, H, S, D) at the first call."""
        if slot not in self.slots:
            B, H, _, D = like.shape
            self.slots[slot] = tuple(like.new_zeros(B, H, self.max_len, D) for _ in range(2))
        return self.slots[slot]

    def update(self, slot, k, v):
        """Write the newest k.size(2) positions' keys and values; -> every cached position's, as views."""
        k_buf, v_buf = self.buffers(slot, k)
        start = self.pos - k.size(2)
        k_buf[:, :, start:self.pos] = k
        v_buf[:, :, start:self.pos] = v
        return k_buf[:, :, :self.pos], v_buf[:, :, :self.pos]


class Attention(nn.Module):
    def __init__(self, config, has_value_embed):
        super().__init__()
        # qk norm eps None = the dtype's epsilon, as the authors' F.rms_norm(q) (parcae_lm/modules/mixer.py)
        d, self.n_head, self.head_dim, self.eps = config.d_model, config.n_head, config.head_dim, None
        self.c_q = nn.Linear(d, d, bias=False)
        self.c_k = nn.Linear(d, d, bias=False)
        self.c_v = nn.Linear(d, d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        # SPEC 1 value embeddings: v += 2 * sigmoid(ve_gate(x[..., :32])) * ve
        self.ve_gate_channels = min(32, d)
        self.ve_gate = nn.Linear(self.ve_gate_channels, self.n_head, bias=False) if has_value_embed else None

    def forward(self, x, ve, cos, sin, cache=None, slot=None):
        B, S, _ = x.shape
        q = self.c_q(x).view(B, S, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, S, self.n_head, self.head_dim)
        v = self.c_v(x).view(B, S, self.n_head, self.head_dim)
        if self.ve_gate is not None:
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :self.ve_gate_channels]))  # (B, S, H)
            v = v + gate.unsqueeze(-1) * ve.view(B, S, self.n_head, self.head_dim)
        # SPEC 1: parameter-free RMS norm on q and k after RoPE
        q = rms_norm(apply_rotary(q, cos, sin), self.eps).transpose(1, 2)  # (B, H, S, D)
        k = rms_norm(apply_rotary(k, cos, sin), self.eps).transpose(1, 2)
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
        return self.c_proj(0.5 * F.relu(self.c_fc(x)).square())  # SPEC 1: 0.5 * relu(x)^2


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
# The model

class Parcae(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = c = config
        d = c.d_model
        self.wte = nn.Embedding(c.padded_vocab_size, d)  # tied with the output head
        # SPEC 1: unique layers numbered 0..n-1 across prelude, recurrent block and coda; layer i
        # carries a value embedding when i % 2 == (n - 1) % 2 (alternating, the last layer always)
        self.ve_layers = [i for i in range(c.n_layer) if i % 2 == (c.n_layer - 1) % 2]
        has_ve = [i in self.ve_layers for i in range(c.n_layer)]
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(c.padded_vocab_size, d) for i in self.ve_layers})
        self.prelude = nn.ModuleList(Block(c, has_ve[i]) for i in range(c.n_prelude))
        self.recur = nn.ModuleList(Block(c, has_ve[c.n_prelude + i]) for i in range(c.n_recur))
        self.coda = nn.ModuleList(Block(c, has_ve[c.n_prelude + c.n_recur + i]) for i in range(c.n_coda))
        self.norm_f = nn.RMSNorm(d, eps=c.norm_eps)
        looped = c.injection != "none"
        self.prelude_norm = nn.RMSNorm(d, eps=c.norm_eps) if looped and c.prelude_norm else None
        if c.injection == "diagonal":
            self.A_log = nn.Parameter(torch.zeros(d))
            self.dt_bias = nn.Parameter(torch.zeros(d))
            self.B = nn.Linear(d, d, bias=False)
        elif c.injection == "concat":
            self.adapter = nn.Linear(2 * d, d, bias=False)
        # C_proj reads the loop's output for every looped variant, so the Table 4 ablations differ
        # from Parcae only in the injection (SPEC 1 puts it after the loop, with no norm before it)
        self.C_proj = nn.Linear(d, d, bias=False) if looped else None
        cos, sin = self._rope_tables(10 * c.seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.log_stats = False  # train.py sets it on the steps it logs: then a forward records
        self.last_h_norm = None  # ||h_T|| (the paper's stability diagnostic)
        self.last_update_ratio = None  # and ||h_T - h_{T-1}|| / ||h_T||
        self.depth_generator = torch.Generator().manual_seed(0)  # train.py reseeds it per rank
        self.init_weights()

    def _rope_tables(self, length):
        c = self.config
        inv_freq = 1.0 / (c.rope_base ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # (S, D/2)
        return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]  # (1, S, 1, D/2)

    @torch.no_grad()
    def init_weights(self):
        """SPEC 1 "scaled-zero" init: small truncated-normal matrices, zero output projections."""
        c = self.config
        std = math.sqrt(2 / (5 * c.d_model))
        for block in [*self.prelude, *self.recur, *self.coda]:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                nn.init.trunc_normal_(lin.weight, std=std, a=-3 * std, b=3 * std)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
            # value embeddings and ve_gate keep PyTorch's default init, as in the authors' code
        nn.init.trunc_normal_(self.wte.weight, std=std, a=-3 * std, b=3 * std)
        if c.injection == "diagonal":
            # A_log = 0 and Delta = softplus(dt_bias) = -ln(sqrt(1/5)), so Abar = sqrt(1/5) = 0.4472
            delta = -math.log(math.sqrt(1 / 5))
            self.A_log.zero_()
            self.dt_bias.fill_(math.log(math.expm1(delta)))
            self.B.weight.copy_(torch.eye(c.d_model))
        if c.injection == "concat":
            nn.init.trunc_normal_(self.adapter.weight, std=std, a=-3 * std, b=3 * std)
        if self.C_proj is not None:
            nn.init.orthogonal_(self.C_proj.weight, gain=math.sqrt(2 / 5))

    def compile_blocks(self):
        """Compile each block alone and keep the loop in Python, so a depth that changes every step never
        recompiles. The recurrent blocks see a shrinking prefix of the batch (see recurrence), so their
        batch dimension is left to dynamo's automatic dynamic shapes: at most a static, a dynamic and a
        size-1 graph."""
        for block in [*self.prelude, *self.coda]:
            block.compile(dynamic=False)
        for block in self.recur:
            block.compile(dynamic=None)

    # --- the Parcae injection and its spectral radius

    def discretized_A(self):
        """Zero-order hold of A = Diag(-exp(A_log)): Abar = exp(-Delta exp(A_log)), every entry in (0, 1).

        The rate Delta exp(A_log) is formed as exp(A_log + ln Delta), so no extreme pair gives 0 * inf,
        and floored at 1e-6: below that float32 rounds Abar to exactly 1 and rho < 1 would hold only on
        paper. Abar stays float32 (bf16 would round anything above 0.998 to 1).
        """
        delta = F.softplus(self.dt_bias)
        rate = torch.exp(self.A_log + torch.log(delta)).clamp(min=1e-6)
        return torch.exp(-rate), delta

    def injected_input(self, e):
        """What the loop adds of e at every step: Bbar e = Delta (e @ B^T) for Parcae (Euler: Bbar = Delta B),
        computed once per forward since e does not change over the loop; e itself for the baselines."""
        if self.config.injection == "diagonal":
            return self.discretized_A()[1] * self.B(e)  # float32, like Abar
        return e

    def inject(self, h, e, A_bar=None):
        """u = Abar h + Bbar e (SPEC 1), or the baselines' concat / add; e from injected_input, A_bar
        from discretized_A (computed here when not given)."""
        inj = self.config.injection
        if inj == "diagonal":
            return (self.discretized_A()[0] if A_bar is None else A_bar) * h + e
        if inj == "concat":
            return self.adapter(torch.cat([h, e], dim=-1))
        return h + e

    @torch.no_grad()
    def spectral_radius(self):
        """rho(Abar): max(Abar) for Parcae, the state half of the adapter for concat, 1 for add."""
        inj = self.config.injection
        if inj == "diagonal":
            return self.discretized_A()[0].max().item()
        if inj == "concat":
            state_half = self.adapter.weight[:, :self.config.d_model].float()
            return torch.linalg.eigvals(state_half).abs().max().item()
        return 1.0 if inj == "add" else None

    # --- forward

    def forward(self, idx, targets=None, T=None, h0=None, cache=None, reduction="mean"):
        """idx (B, S) -> logits (B, S, vocab), or the cross-entropy with targets (-1 = ignore; per
        token as (B, S) with reduction="none").

        T: None samples depths (training) or uses mu_rec (eval); an int runs T steps for every
        sequence; a (B,) tensor runs T_i steps for sequence i. h0 (B, S, d) fixes the initial state.
        """
        c = self.config
        B, S = idx.shape
        x, ctx = self.run_prelude(idx, cache)
        if c.injection == "none":
            ves, cos, sin = ctx
            for i, block in enumerate(self.recur):
                x = block(x, ves.get(c.n_prelude + i), cos, sin, cache, ("recur", 0, i))
        else:
            x = self.recurrence(x, self._depths(T, B), h0, *ctx, cache)
        logits = self.run_coda(x, *ctx, cache)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                               reduction=reduction)
        return loss.view(B, S) if reduction == "none" else loss

    # The three pieces of a forward, apart so that sample.py can read the coda's prediction after any
    # recurrent step (adaptive depth) and loop the steps itself.

    def run_prelude(self, idx, cache=None):
        """ids (B, S) -> (e, ctx): e the recurrence's input (the prelude output, prelude-normed, through
        injected_input when looped), ctx = (value embeddings, cos, sin) for the later pieces. Claims the S
        positions in the cache."""
        pos = cache.pos if cache is not None else 0
        S = idx.size(1)
        if pos + S > self.rope_cos.size(1):
            raise ValueError(f"sequence of {pos + S} positions exceeds the RoPE table of {self.rope_cos.size(1)}")
        if cache is not None:
            cache.claim(S)
        cos, sin = self.rope_cos[:, pos:pos + S], self.rope_sin[:, pos:pos + S]
        ves = {i: self.value_embeds[str(i)](idx) for i in self.ve_layers}
        x = self.wte(idx)
        for i, block in enumerate(self.prelude):
            x = block(x, ves.get(i), cos, sin, cache, ("prelude", i))
        if self.config.injection == "none":
            return x, (ves, cos, sin)
        e = self.prelude_norm(x) if self.prelude_norm is not None else x
        return self.injected_input(e), (ves, cos, sin)

    def recur_step(self, h, e, step, ves, cos, sin, cache=None, A_bar=None):
        """One recurrent step h -> R(inject(h, e)) for the whole batch; `step` names its cache slots."""
        u = self.inject(h, e, A_bar)
        for i, block in enumerate(self.recur):
            u = block(u, ves.get(self.config.n_prelude + i), cos, sin, cache, ("recur", step, i))
        return u

    def run_coda(self, h, ves, cos, sin, cache=None):
        """The recurrence's output (B, S, d) -> logits (B, S, vocab) float32: C_proj, coda, norm, tied head."""
        c = self.config
        x = self.C_proj(h) if self.C_proj is not None else h
        for i, block in enumerate(self.coda):
            x = block(x, ves.get(c.n_prelude + c.n_recur + i), cos, sin, cache, ("coda", i))
        return (self.norm_f(x) @ self.wte.weight.t())[..., :c.vocab_size].float()

    def _depths(self, T, batch_size):
        """Per-sequence depths as a (B,) CPU tensor."""
        if T is None:
            if self.training:
                return sample_depths(self.config, batch_size, self.depth_generator)
            T = self.config.mu_rec
        depths = torch.as_tensor(T).long().cpu().expand(batch_size).clone()
        if (depths < 1).any():
            raise ValueError(f"recurrence depth T must be >= 1, got {T}")
        return depths

    def initial_state(self, shape, device, dtype, generator=None):
        """SPEC 1: h0 ~ TruncNormal(0, sigma, +-3 sigma), sigma = sqrt(2 / (5 d)), drawn every forward
        (from `generator`, which lives on `device`, when given: sample.py's reproducible decoding)."""
        sigma = math.sqrt(2 / (5 * self.config.d_model))
        h0 = torch.empty(shape, device=device, dtype=torch.float32)
        return nn.init.trunc_normal_(h0, std=sigma, a=-3 * sigma, b=3 * sigma, generator=generator).to(dtype)

    def recurrence(self, e, depths, h0, ves, cos, sin, cache):
        """Run sequence i for depths[i] steps: n_i without grad, then k_i with grad (SPEC 2).

        The paper masks finished sequences with torch.where, so every sequence runs max(n) + max(k)
        steps. Here the batch is sorted by depth, longest first: n_i and k_i both grow with T_i, so the
        sequences still running at any step are a prefix of the sorted batch, and each step runs the
        block on that prefix alone. Each sequence gets exactly its own steps, loss and gradients, and
        the block runs sum(T_i) sequence-passes instead of B * (max n + max k).
        """
        n, k = split_depths(depths, self.config.mu_bwd, self.training)
        h = self.initial_state(e.shape, e.device, e.dtype) if h0 is None else h0.to(e.dtype)
        order = torch.argsort(depths, descending=True, stable=True)
        permuted = bool((order != torch.arange(len(order))).any())
        if permuted:
            if cache is not None:
                raise ValueError("decoding with a KV cache needs one depth T for the whole batch")
            order_dev = order.to(e.device, non_blocking=True)
            e, h = e[order_dev], h[order_dev]
            ves = {i: ve[order_dev] for i, ve in ves.items()}
            n, k = n[order], k[order]
        prev = h if self.log_stats else None  # the training log's diagnostics, on the steps it logs
        A_bar = self.discretized_A()[0] if self.config.injection == "diagonal" else None  # once, not per step
        n_max = int(n[0])
        with torch.no_grad():
            for step in range(n_max):
                h, prev = self._prefix_step(h, prev, e, int((n > step).sum()), step, ves, cos, sin, cache, A_bar)
        for step in range(int(k[0])):
            h, prev = self._prefix_step(h, prev, e, int((k > step).sum()), n_max + step, ves, cos, sin, cache,
                                        A_bar)
        if prev is not None:
            with torch.no_grad():
                h_norm = h.float().norm(dim=-1).mean()
                self.last_h_norm = h_norm
                self.last_update_ratio = (h - prev).float().norm(dim=-1).mean() / h_norm
        return h[torch.argsort(order_dev)] if permuted else h

    def _prefix_step(self, h, prev, e, active, step, ves, cos, sin, cache, A_bar):
        """One recurrent step for the first `active` sequences; the others keep their state.
        -> (new h, each sequence's state before its latest step for the diagnostics, or None)."""
        if active == h.size(0):
            return self.recur_step(h, e, step, ves, cos, sin, cache, A_bar), None if prev is None else h.detach()
        ves = {i: ve[:active] for i, ve in ves.items()}
        u = self.recur_step(h[:active], e[:active], step, ves, cos, sin, cache, A_bar)
        if prev is not None:
            prev = torch.cat([h[:active].detach(), prev[active:]])
        return torch.cat([u, h[active:]]), prev

    # --- accounting

    def num_params(self):
        """Every parameter once (the output head is wte itself)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self):
        """Training FLOPs per token, SPEC 2 (the paper's Appendix D). N excludes wte only; N_core is
        the recurrent blocks' parameters (the value-embedding tables are not inside the blocks)."""
        c = self.config
        d, S = c.d_model, c.seq_len
        N = self.num_params() - self.wte.weight.numel()
        if c.injection == "none":
            return 6 * N + 12 * c.n_layer * d * S
        N_core = sum(p.numel() for p in self.recur.parameters())
        N_nc = N - N_core
        return (6 * N_nc + 3 * (c.n_prelude + c.n_coda) * 4 * d * S
                + c.mu_rec * (2 * N_core + c.n_recur * 4 * d * S)
                + c.mu_bwd * (4 * N_core + 2 * c.n_recur * 4 * d * S))


# -----------------------------------------------------------------------------
# MFU: model FLOPs from flops_per_token() against the GPU's peak

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, per GPU


def peak_bf16_flops(device):
    """The GPU's dense bf16 peak, the denominator of MFU; None on a CPU or an unlisted GPU."""
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else ""
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


# -----------------------------------------------------------------------------
# Checkpoints: <runs_dir>/<run>/ckpt_<step>.pt, a plain dict loadable with weights_only=True

def save_checkpoint(path, model, **extra):
    """Write to a temporary name, then rename: a killed run never leaves a torn checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"config": asdict(model.config), "model": model.state_dict(), **extra}, tmp)
    os.replace(tmp, path)


def find_checkpoint(runs_dir, run=None):
    """The newest checkpoint of `run`, or of the most recently written run when run is None."""
    runs_dir = Path(runs_dir)
    pattern = f"{run}/ckpt_*.pt" if run else "*/ckpt_*.pt"
    found = sorted(runs_dir.glob(pattern), key=lambda p: (p.stat().st_mtime, p.name))
    if not found:
        where = runs_dir / run if run else runs_dir
        raise FileNotFoundError(f"no checkpoint under {where}; train one first with `python train.py`")
    return found[-1]


def load_checkpoint(path, device="cpu"):
    """-> (model in eval mode, the checkpoint dict). Never unpickles code (weights_only=True)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist; pass --ckpt with an existing file")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
        model = Parcae(ParcaeConfig(**ckpt["config"]))
        model.load_state_dict(ckpt["model"])
    except Exception as err:
        raise ValueError(f"checkpoint {path} is corrupt or not a nanoparcae checkpoint "
                         f"({type(err).__name__}: {str(err).splitlines()[0][:200]})") from None
    return model.to(device).eval(), ckpt
