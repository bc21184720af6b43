"""
model.py: Parcae, the stable looped language model, and its baselines (METHOD.md §1).

    x  = wte(ids); x = Prelude(x); e = RMSNorm(x)
    h0 ~ TruncNormal(0, sqrt(2/(5d)))
    repeat T times: h = R(Abar * h + Bbar(e))            # the recurrent block R, looped
    logits = RMSNorm(Coda(C_proj(h))) @ wte^T

The injection, u = Abar h + Bbar e, is a small module that config.injection picks: DiagonalInjection
(Parcae: Abar = exp(-Delta exp(A_log)), rho < 1 always), ConcatInjection (RDM / Huginn: a Linear(2d -> d)
adapter) or AddInjection (u = h + e, rho = 1); "none" is the fixed-depth Transformer baseline, the same
blocks run once, in order.

Training samples a recurrence depth per sequence, T_i = max(1, Poisson(mu_rec)), runs the first
n_i = T_i - k_i steps without gradient and the last k_i = min(T_i, mu_bwd) with it (METHOD.md §2).
Other samplers (the per-batch ablation, the authors' other schemes): depths.py.
The caller owns the randomness (forward's depth_generator, torch's global RNG for h0), and the model keeps
no state between forwards: the stability diagnostics come back when asked for (return_diagnostics).

torch.compile: `model.compile_blocks()` compiles each transformer block on its own; the loop over a
depth that changes every batch stays in Python, so changing depths cause no recompilation.

Use: model = Parcae(ParcaeConfig.from_depth(6)); loss = model(idx, targets); logits = model(idx, T=16)

The call path of one forward: forward -> run_prelude (e, the injection's input term) -> recurrence (depths
sorted, loop) -> recur_step (injection, then the blocks R) -> run_coda.
"""

import math
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from depths import SAMPLINGS, sample_depths, split_depths

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
        if self.mu_rec < 1 or self.mu_bwd < 1:  # mu_rec named first: mu_bwd's default comes from it
            name, value = ("mu_rec", self.mu_rec) if self.mu_rec < 1 else ("mu_bwd", self.mu_bwd)
            raise ValueError(f"{name}={value} must be at least 1")
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
        # qk norm eps None = the dtype's epsilon, as the authors' F.rms_norm(q) (parcae_lm/modules/mixer.py)
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
        # METHOD.md §1: parameter-free RMS norm on q and k after RoPE, both in one pass: per head, so the
        # forward gives the numbers of two passes (the backward sums in another order), with half the
        # kernels, which is what one decoded token's time is made of
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
# Injections: how each loop step mixes the state h with the prelude's output e (METHOD.md §1).
# Each owns its parameters and their init. The loop calls input_term(e) and state_weight() once per
# forward (neither changes over the loop), then the injection itself at every step.

def trunc_normal_(weight, std, generator=None):
    return nn.init.trunc_normal_(weight, std=std, a=-3 * std, b=3 * std, generator=generator)


@torch.no_grad()
def trunc_orthogonal_(weight, std):
    """The authors' truncated orthogonal init: Q of the QR of a standard normal matrix truncated at
    +-2, signs fixed by diag(R) (so Q is uniformly distributed), scaled by std * sqrt(max(rows, cols)).
    Every entry then has std `std`, as an i.i.d. draw would, but all singular values equal that gain
    (a rectangular matrix is semi-orthogonal) instead of spreading out."""
    rows, cols = weight.shape
    if weight.is_meta:  # train.py sizes the model on the meta device: nothing to fill
        return weight
    a = torch.empty(max(rows, cols), min(rows, cols), device=weight.device, dtype=torch.float32)
    q, r = torch.linalg.qr(nn.init.trunc_normal_(a, a=-2.0, b=2.0))
    q = q * torch.diagonal(r).sign()
    return weight.copy_(q if rows >= cols else q.t()).mul_(std * math.sqrt(max(rows, cols)))


class Injection(nn.Module):
    """u = inject(h, input_term): the baselines inject e itself and have no Abar to precompute; Parcae
    overrides both."""

    def reset_parameters(self, std):
        pass

    def input_term(self, e):
        return e

    def state_weight(self):
        return None


class Discretized(NamedTuple):
    A_bar: torch.Tensor  # (d,) the state's per-channel decay, every entry in (0, 1)
    delta: torch.Tensor  # (d,) the step size Delta = softplus(dt_bias)


class DiagonalInjection(Injection):
    """Parcae: u = Abar h + Bbar e with Abar = exp(-Delta exp(A_log)), Bbar = Delta B, so rho(Abar) < 1."""

    def __init__(self, d):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(d))
        self.dt_bias = nn.Parameter(torch.zeros(d))
        self.B = nn.Linear(d, d, bias=False)

    @torch.no_grad()
    def reset_parameters(self, std):
        """A_log = 0 and Delta = softplus(dt_bias) = -ln(sqrt(1/5)), so Abar = sqrt(1/5) = 0.4472; B = I."""
        self.A_log.zero_()
        self.dt_bias.fill_(math.log(math.expm1(-math.log(math.sqrt(1 / 5)))))
        self.B.weight.copy_(torch.eye(self.B.weight.size(0)))

    def discretize(self):
        """Zero-order hold of A = Diag(-exp(A_log)) with step Delta.

        The rate Delta exp(A_log) is formed as exp(A_log + ln Delta), so no extreme pair gives 0 * inf,
        and floored at 1e-6: below that float32 rounds Abar to exactly 1 and rho < 1 would hold only on
        paper. Abar stays float32 (bf16 would round anything above 0.998 to 1).
        """
        delta = F.softplus(self.dt_bias)
        rate = torch.exp(self.A_log + torch.log(delta)).clamp(min=1e-6)
        return Discretized(A_bar=torch.exp(-rate), delta=delta)

    def input_term(self, e):
        """Bbar e = Delta (e @ B^T) (Euler: Bbar = Delta B), float32 like Abar."""
        return self.discretize().delta * self.B(e)

    def state_weight(self):
        return self.discretize().A_bar

    def forward(self, h, input_term, A_bar=None):
        return (self.state_weight() if A_bar is None else A_bar) * h + input_term

    @torch.no_grad()
    def spectral_radius(self):
        return self.discretize().A_bar.max().item()


class ConcatInjection(Injection):
    """RDM / Huginn: u = W [h; e], W a Linear(2d -> d) adapter whose state half is an unconstrained Abar."""

    def __init__(self, d):
        super().__init__()
        self.adapter = nn.Linear(2 * d, d, bias=False)

    @torch.no_grad()
    def reset_parameters(self, std):
        # the authors' "adapter" rule: i.i.d. truncated normal even when the other matrices are orthogonal
        trunc_normal_(self.adapter.weight, std)

    def forward(self, h, input_term, A_bar=None):
        return self.adapter(torch.cat([h, input_term], dim=-1)).to(h.dtype)  # the state stays float32 (autocast)

    @torch.no_grad()
    def spectral_radius(self):
        state_half = self.adapter.weight[:, :self.adapter.out_features].float()
        return torch.linalg.eigvals(state_half).abs().max().item()


class AddInjection(Injection):
    """u = h + e: Abar = I, rho = 1 (marginally stable). No parameters."""

    def __init__(self, d):
        super().__init__()

    def forward(self, h, input_term, A_bar=None):
        return h + input_term

    def spectral_radius(self):
        return 1.0


INJECTION_CLASSES = {"diagonal": DiagonalInjection, "concat": ConcatInjection, "add": AddInjection, "none": None}


# -----------------------------------------------------------------------------
# The model

class Context(NamedTuple):
    """What every block of one forward reads besides its input: value embeddings by layer index, RoPE."""
    ves: dict
    cos: torch.Tensor
    sin: torch.Tensor


class Recurrence(NamedTuple):
    h: torch.Tensor  # the final state h_T of every sequence
    diagnostics: dict | None  # stability_diagnostics, when asked for


class Parcae(nn.Module):
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
        special = {self.wte: lambda m: trunc_orthogonal_(m.weight, std)}  # module -> its init; others: default
        for block in [*self.prelude, *self.recur, *self.coda]:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                special[lin] = lambda m: trunc_orthogonal_(m.weight, std)
            for lin in (block.attn.c_proj, block.mlp.c_proj):
                special[lin] = lambda m: nn.init.zeros_(m.weight)
        if self.injection is not None:
            special[self.injection] = lambda m: m.reset_parameters(std)
            special[self.C_proj] = lambda m: trunc_orthogonal_(m.weight, std)  # square: every singular value sqrt(2/5)
        covered = set()  # the submodules of a module whose init covers them (the injection's B or adapter)
        with torch.random.fork_rng(devices=[]):  # the caller's global RNG stream is left as it was
            for name, module in self.named_modules():
                init = special.get(module)
                if init is None and (module in covered or not hasattr(module, "reset_parameters")
                                     or next(module.parameters(recurse=False), None) is None):
                    continue
                covered.update(module.modules())
                torch.default_generator.manual_seed(self.init_seed + zlib.crc32(name.encode()))
                init(module) if init else module.reset_parameters()

    def compile_blocks(self, backend="inductor"):
        """Compile each block alone and keep the loop in Python, so a depth that changes every step never
        recompiles. The recurrent blocks see a shrinking prefix of the batch (see recurrence), so their
        batch dimension is left to dynamo's automatic dynamic shapes: at most a static, a dynamic and a
        size-1 graph. backend="eager" traces and guards the same without generating code (tests)."""
        for block in [*self.prelude, *self.coda]:
            block.compile(dynamic=False, backend=backend)
        for block in self.recur:
            block.compile(dynamic=None, backend=backend)

    @torch.no_grad()
    def spectral_radius(self):
        """rho(Abar): max(Abar) for Parcae, the adapter's state half for concat, 1 for add, None unlooped."""
        return self.injection.spectral_radius() if self.injection is not None else None

    # --- forward
    # Precision under bf16 autocast (every CUDA run; train.py --dtype=bfloat16 runs the same on a CPU):
    # - weights and the residual stream stay float32 at every stage: prelude, loop state h (and h0), coda.
    #   The matmuls (Linear, attention, the head) take bf16 copies and return bf16, which is added into
    #   the float32 stream, so rounding does not accumulate over the T loop steps and every RMSNorm sees a
    #   float32 input with its float32 weight: the fused kernel, no dtype-mismatch fallback.
    # - Abar and Bbar e: float32 (DiagonalInjection.discretize, input_term); C_proj's and the concat
    #   adapter's bf16 outputs are cast back to the state's float32 (ConcatInjection, run_coda).
    # - RoPE: float32 angle tables applied in q and k's bf16 (apply_rotary); q, k, v enter attention in bf16.
    # - the head: bf16 logits, cast to float32 before the float32 cross-entropy.

    def forward(self, idx, targets=None, T=None, h0=None, cache=None, reduction="mean", depth_generator=None,
                return_diagnostics=False):
        """idx (B, S) -> logits (B, S, vocab), or the cross-entropy with targets (-1 = ignore; per
        token as (B, S) with reduction="none").

        T: None samples depths in training (from depth_generator; the global RNG when None) and runs
        mu_rec in eval; an int runs T steps for every sequence; a (B,) tensor T_i steps for sequence i; a
        pair (n, k) exactly n_i steps without grad then k_i with it (a sample_depths draw, replayed).
        h0 (B, S, d) fixes the initial state. cache: decoding's engine.KVCache, which the S new positions
        extend. return_diagnostics=True returns (output, diagnostics), the paper's stability diagnostics:
        ||h_T|| and the update ratio ||h_T - h_{T-1}|| / ||h_T||, batch means.
        """
        B, S = idx.shape
        injected, ctx = self.run_prelude(idx, cache)
        if self.injection is None:
            x, diagnostics = injected, stability_diagnostics(None, None)
            for i, block in enumerate(self.recur):
                x = block(x, ctx.ves.get(self.config.n_prelude + i), ctx.cos, ctx.sin, cache, ("recur", 0, i))
        else:
            steps = self.resolve_steps(T, B, depth_generator)
            x, diagnostics = self.recurrence(injected, steps, h0, ctx, cache, diagnostics=return_diagnostics)
        logits = self.run_coda(x, *ctx, cache)
        output = logits
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                                   reduction=reduction)
            output = loss.view(B, S) if reduction == "none" else loss
        return (output, diagnostics) if return_diagnostics else output

    # The three pieces of a forward, apart so that engine.py can read the coda's prediction after any
    # recurrent step (adaptive depth) and loop the steps itself.

    def run_prelude(self, idx, cache=None):
        """ids (B, S) -> (injected, ctx). injected: the prelude's output e = RMSNorm(P(x)) as the loop adds
        it at every step (the injection's input term, Bbar e for Parcae; e itself, un-normed, for the
        Transformer, whose "loop" is one pass). ctx: the Context of the later pieces. Claims the S positions
        in the cache."""
        pos = cache.pos if cache is not None else 0
        S = idx.size(1)
        if pos + S > self.rope_cos.size(1):
            raise ValueError(f"sequence of {pos + S} positions exceeds the RoPE table of {self.rope_cos.size(1)}")
        if cache is not None:
            cache.claim(S)
        ctx = Context({i: self.value_embeds[str(i)](idx) for i in self.ve_layers},
                      self.rope_cos[:, pos:pos + S], self.rope_sin[:, pos:pos + S])
        x = self.wte(idx)
        for i, block in enumerate(self.prelude):
            x = block(x, ctx.ves.get(i), ctx.cos, ctx.sin, cache, ("prelude", i))
        if self.injection is None:
            return x, ctx
        e = self.prelude_norm(x) if self.prelude_norm is not None else x
        return self.injection.input_term(e), ctx

    def recur_step(self, h, injected, step, ves, cos, sin, cache=None, A_bar=None):
        """One loop step h -> R(u), u = the injection of (h, injected), for every row of h; `step` names
        its cache slots. A_bar: the injection's state_weight() when the caller has it already."""
        u = self.injection(h, injected, A_bar)
        for i, block in enumerate(self.recur):
            u = block(u, ves.get(self.config.n_prelude + i), cos, sin, cache, ("recur", step, i))
        return u

    def run_coda(self, h, ves, cos, sin, cache=None):
        """The recurrence's output (B, S, d) -> logits (B, S, vocab): C_proj, coda, norm, tied head. The logits are
        float32, or the weights' dtype when wider (a float64 model's are float64), whatever autocast computed."""
        c = self.config
        x = self.C_proj(h).to(h.dtype) if self.C_proj is not None else h  # float32 stream (see forward)
        for i, block in enumerate(self.coda):
            x = block(x, ves.get(c.n_prelude + c.n_recur + i), cos, sin, cache, ("coda", i))
        logits = (self.norm_f(x) @ self.wte.weight.t())[..., :c.vocab_size]
        return logits.to(torch.promote_types(self.wte.weight.dtype, torch.float32))

    def resolve_steps(self, T, batch_size, generator=None):
        """forward's T -> (n, k), (B,) CPU long tensors: each sequence's loop steps without gradient, then with
        it. Training with T None draws them (sample_depths); an eval depth runs all T steps without grad."""
        if T is None and self.training:
            return sample_depths(self.config, batch_size, generator)
        if isinstance(T, tuple):
            n, k = (torch.as_tensor(x).long().cpu().expand(batch_size).clone() for x in T)
            if (n < 0).any() or (k < 0).any() or (n + k < 1).any():
                raise ValueError(f"steps (n, k) = {T} must be >= 0 with n + k >= 1 for every sequence")
            return n, k
        depths = torch.as_tensor(self.config.mu_rec if T is None else T).long().cpu().expand(batch_size).clone()
        if (depths < 1).any():
            raise ValueError(f"recurrence depth T must be >= 1, got {T}")
        return split_depths(depths, self.config.mu_bwd, self.training)

    def initial_state(self, shape, device, dtype, generator=None):
        """METHOD.md §1: h0 ~ TruncNormal(0, sigma, +-3 sigma), sigma = sqrt(2 / (5 d)), drawn every forward
        (from `generator`, which lives on `device`, when given: engine.py's reproducible decoding)."""
        sigma = math.sqrt(2 / (5 * self.config.d_model))
        return trunc_normal_(torch.empty(shape, device=device, dtype=torch.float32), sigma, generator).to(dtype)

    def recurrence(self, injected, steps, h0, ctx, cache=None, diagnostics=False):
        """Run sequence i for steps = (n, k): n_i loop steps without gradient, then k_i with it (METHOD.md §2)
        -> Recurrence(h, stability_diagnostics or None).

        The paper's formulation (bench.masked_reference_loss; tests/test_bench.py checks the two agree)
        steps the whole batch and masks the sequences whose count is used up:

            for step in range(max(n) + max(k)):
                active = n > step if step < max(n) else k > step - max(n)
                with torch.set_grad_enabled(step >= max(n)):
                    h = torch.where(active, R(inject(h, e)), h)

        which costs B * (max(n) + max(k)) sequence-passes. Here the batch is sorted by depth, longest
        first: n_i and k_i both grow with T_i, so the sequences still running at any step are a prefix
        of the sorted batch, and each step runs the block on that prefix alone, sum(n_i + k_i) passes in
        all (a per-batch draw gives every sequence the same n and k).
        Each sequence gets exactly its own steps, loss and gradients.
        """
        n, k = steps
        h = self.initial_state(injected.shape, injected.device, injected.dtype) if h0 is None else h0.to(injected.dtype)
        ves = ctx.ves
        order = torch.argsort(n + k, descending=True, stable=True)
        if (n[order].diff() > 0).any() or (k[order].diff() > 0).any():
            raise ValueError("per-sequence steps (n, k) must grow together (longer T: no fewer n and k steps)")
        permuted = bool((order != torch.arange(len(order))).any())
        if permuted:
            if cache is not None:
                raise ValueError("decoding with a KV cache needs one depth T for the whole batch")
            order_dev = order.to(injected.device, non_blocking=True)
            injected, h = injected[order_dev], h[order_dev]
            ves = {i: ve[order_dev] for i, ve in ves.items()}
            n, k = n[order], k[order]
        A_bar = self.injection.state_weight()  # once per forward, not per step
        h_prev = h if diagnostics else None  # each sequence's state before its latest step
        n_max, grad_enabled = int(n[0]), torch.is_grad_enabled()
        for step in range(n_max + int(k[0])):
            with_grad = step >= n_max
            active = int((k > step - n_max).sum()) if with_grad else int((n > step).sum())
            if diagnostics:
                h_prev = torch.cat([h[:active].detach(), h_prev[active:]])
            # the rows past `active` are done: they keep their state. Sliced with grad on: a view taken under
            # no_grad still requires grad but has no grad_fn, which FlopCounterMode's module tracker rejects
            h_in, injected_in, ves_in = (h, injected, ves) if active == h.size(0) else \
                (h[:active], injected[:active], {i: ve[:active] for i, ve in ves.items()})
            with torch.set_grad_enabled(with_grad and grad_enabled):
                h_active = self.recur_step(h_in, injected_in, step, ves_in, ctx.cos, ctx.sin, cache, A_bar)
            h = h_active if active == h.size(0) else torch.cat([h_active, h[active:]])
        stats = stability_diagnostics(h, h_prev) if diagnostics else None
        return Recurrence(h[torch.argsort(order_dev)] if permuted else h, stats)

    # --- accounting

    def num_params(self):
        """Every parameter once (the output head is wte itself)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self):
        """The paper's training compute C per token, METHOD.md §2 (Appendix D), for FLOP budgets (--target_flops,
        isoFLOP sweeps, fits), not for MFU: N excludes wte only, so the value-embedding lookups count as matmuls
        and the tied head does not (common.matmul_flops_per_token counts what runs). N_core is the recurrent blocks'
        parameters (the value-embedding tables are not inside the blocks)."""
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

    def activation_bytes(self, batch_size, bf16=True):
        """Bytes saved for backward by a training forward of batch_size sequences that all backpropagate
        through mu_bwd loop steps (the most any can: memory follows mu_bwd, not the sampled depth). Per
        token, counted from eager saved tensors (tests/test_memory.py measures them again): each block run
        with grad saves 80 d bytes in float32 and 56 d under bf16 autocast; a value embedding 4 d; the loop
        4 (4 + mu_bwd) d (prelude norm, B, Abar h per step, C_proj); the head 12 d and the float32
        log-softmax 4 vocab. bf16 also keeps one bf16 copy of every matrix (autocast's weight cache)."""
        c = self.config
        d = c.d_model
        looped = self.injection is not None

        def runs(i):  # how many times layer i runs with grad in one forward
            return c.mu_bwd if looped and c.n_prelude <= i < c.n_prelude + c.n_recur else 1

        block_runs = sum(runs(i) for i in range(c.n_layer))
        per_token = (block_runs * (56 if bf16 else 80) * d + sum(runs(i) for i in self.ve_layers) * 4 * d
                     + (4 * (4 + c.mu_bwd) * d if looped else 0) + 12 * d + 4 * c.vocab_size)
        matrices = sum(p.numel() for name, p in self.named_parameters()
                       if p.ndim == 2 and not name.startswith("value_embeds"))  # embeddings are read, not cast
        return batch_size * c.seq_len * per_token + (2 * matrices if bf16 else 0)


@torch.no_grad()
def stability_diagnostics(h, h_prev):
    """The paper's stability diagnostics of a forward: ||h_T|| and ||h_T - h_{T-1}|| / ||h_T||, means over
    the batch's positions (None without a loop: the Transformer)."""
    if h is None:
        return {"h_norm": None, "update_ratio": None}
    h_norm = h.float().norm(dim=-1).mean()
    return {"h_norm": h_norm, "update_ratio": (h - h_prev).float().norm(dim=-1).mean() / h_norm}
