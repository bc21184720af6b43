"""
The optimiser of the Parcae paper (METHOD.md §2): the authors' MuonAdamW, one torch.optim.Optimizer
holding two kinds of parameter groups.

- kind='adamw': embeddings, value embeddings, norms, every vector, and the Parcae injection
  parameters (A_log, dt_bias, B, C_proj, or the concat baseline's adapter). Plain AdamW,
  betas (0.8, 0.95), eps 1e-10, no weight decay.
- kind='muon': every other matrix, i.e. the 2-D weights inside the prelude, recurrent and coda
  blocks, one group per shape so the orthogonalisation runs on a stacked batch. Nesterov momentum,
  Polar-Express orthogonalisation in bf16, NorMuon's factored second moment, cautious weight decay.

Plus the schedules the training loop applies each step (learning rate, Muon momentum, weight
decay) as small pure functions, the per-size AdamW learning rate, and the bytes of the optimiser's state.

    optimizer = build_optimizer(model, adamw_lr=learning_rate_for_depth(6))
    for group in optimizer.param_groups:                  # before each optimizer.step()
        group['lr'] = group['initial_lr'] * lr_multiplier(step, total_steps)

Sources: the authors' recpre/optim/muon_adamw.py and scripts/train.py (sandyresearch/parcae),
which follow nanochat's nanochat/optim.py (karpathy/nanochat), itself from modded-nanogpt.
Everything runs eagerly (no torch.compile inside the optimiser), so hyperparameters are plain
floats the loop may change at any step, and the same code runs on CPU and GPU.
"""

import math

import torch
from torch import Tensor

# -----------------------------------------------------------------------------
# Polar Express (METHOD.md §2: "5 Polar-Express orthogonalisation steps in bf16, input scaled by its
# norm * 1.02"). Amsel, Persson, Musco, Gower, https://arxiv.org/abs/2505.16932. Each step applies
# the odd quintic p(X) = a X + b (X X^T) X + c (X X^T)^2 X, whose coefficients are chosen per step
# (computed for 5 iterations, safety factor 2e-2, cushion 2) to push every singular value of X
# towards 1 as fast as possible; the result approximates U V^T of G = U S V^T, the orthogonal
# matrix nearest the momentum. These are the published coefficients, the ones the authors and
# nanochat use. Dividing by ||G||_F * 1.02 puts every singular value in (0, 1], where the
# schedule is designed to work; the 1.02 (nanochat uses 1.01) is the authors' safety margin.

POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def polar_express(G: Tensor, steps: int = 5) -> Tensor:
    """Approximately orthogonalise the last two dims of G (a matrix or a stack of same-shape
    matrices). Runs in bf16, returns G's dtype. Five steps leave the singular values in about
    [0.85, 1.15], except those of G below ~1e-3 of its Frobenius norm, which stay smaller."""
    assert G.ndim >= 2 and 1 <= steps <= len(POLAR_EXPRESS_COEFFS)
    X = G.bfloat16()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    # Work on the wide orientation so X X^T is the smaller Gram matrix (min(rows, cols) squared).
    # The authors write the tall case out as X (b A + c A^2) with A = X^T X; transposing is the same math.
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    for a, b, c in POLAR_EXPRESS_COEFFS[:steps]:
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


# -----------------------------------------------------------------------------
# NorMuon (METHOD.md §2: "a factored second-moment normalisation, beta2 0.95"). Li et al.,
# https://arxiv.org/abs/2510.05491. The orthogonalised update has uneven scale across neurons;
# keep an EMA of its mean square per row (for tall or square matrices, reduced over columns) or per
# column (for wide ones), divide by its square root, then rescale so the Frobenius norm is the one
# the orthogonalised update had. As in the authors' muon_step, written here with plain norms.

def normuon(U: Tensor, v: Tensor, beta2: float) -> Tensor:
    """U: (n, rows, cols) orthogonalised updates; v: factored second moment, (n, rows, 1) when
    rows >= cols else (n, 1, cols), updated in place. Returns the normalised update."""
    reduce_dim = -1 if U.size(-2) >= U.size(-1) else -2
    v.lerp_(U.square().mean(dim=reduce_dim, keepdim=True), 1 - beta2)
    scaled = U * v.clamp_min(1e-10).rsqrt()
    norm_ratio = U.norm(dim=(-2, -1), keepdim=True) / scaled.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10)
    return scaled * norm_ratio


# -----------------------------------------------------------------------------
# The optimiser. Group keys (every group): params, kind, lr, initial_lr; the training loop sets
# group['lr'] = group['initial_lr'] * lr_multiplier(step) each step (the authors keep a 'base_lr'
# ratio instead; same effect). AdamW groups: betas, eps, weight_decay. Muon groups: momentum,
# weight_decay (both set by the loop each step), beta2, ns_steps. Missing keys take the defaults
# below, which are METHOD.md §2's values.

ADAMW_DEFAULTS = dict(betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
MUON_DEFAULTS = dict(momentum=0.95, weight_decay=0.2, beta2=0.95, ns_steps=5)


class MuonAdamW(torch.optim.Optimizer):
    def __init__(self, param_groups: list[dict]):
        super().__init__(param_groups, defaults={})

    def add_param_group(self, group: dict) -> None:
        kind = group.get('kind')
        if kind not in ('adamw', 'muon'):
            raise ValueError(f"param group kind must be 'adamw' or 'muon', got {kind!r}")
        for key, value in (ADAMW_DEFAULTS if kind == 'adamw' else MUON_DEFAULTS).items():
            group.setdefault(key, value)
        group.setdefault('initial_lr', group['lr'])
        params = group['params'] = [group['params']] if isinstance(group['params'], Tensor) else list(group['params'])
        if kind == 'muon' and any(p.ndim != 2 or p.shape != params[0].shape for p in params):
            raise ValueError("a muon group holds 2-D parameters of a single shape (they are stacked)")
        super().add_param_group(group)

    # AdamW, the same arithmetic in the same order as torch.optim.AdamW's single-tensor path, so
    # the two agree to the last bit on CPU: decoupled decay p *= 1 - lr wd, EMAs of g and g^2,
    # bias correction folded into the step size and the denominator.
    def _step_adamw(self, group: dict) -> None:
        lr, (beta1, beta2), eps, wd = group['lr'], group['betas'], group['eps'], group['weight_decay']
        for p in group['params']:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state['step'] = 0
                state['exp_avg'] = torch.zeros_like(p)
                state['exp_avg_sq'] = torch.zeros_like(p)
            state['step'] += 1
            m, v, g, t = state['exp_avg'], state['exp_avg_sq'], p.grad, state['step']
            p.mul_(1 - lr * wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))

    # Muon for one same-shape group, stacked as (n, rows, cols). The group's buffers live in the
    # state of its first parameter (as in the authors' code), so state_dict / load_state_dict
    # round-trip them like any optimiser state.
    def _step_muon(self, group: dict) -> None:
        params = group['params']
        if all(p.grad is None for p in params):
            return
        state = self.state[params[0]]
        n, (rows, cols) = len(params), params[0].shape
        if not state:
            state['momentum_buffer'] = torch.zeros(n, rows, cols, dtype=params[0].dtype, device=params[0].device)
            factored = (n, rows, 1) if rows >= cols else (n, 1, cols)
            state['second_momentum_buffer'] = torch.zeros(factored, dtype=torch.float32, device=params[0].device)
        # A parameter that got no gradient this step counts as a zero gradient (the authors' choice).
        g = torch.stack([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
        P = torch.stack(params)

        # Nesterov momentum: buf = mom buf + (1 - mom) g, then step along (1 - mom) g + mom buf.
        mom = group['momentum']
        buf = state['momentum_buffer']
        buf.lerp_(g, 1 - mom)
        g = g.lerp_(buf, mom)

        # Orthogonalise in bf16, then do the rest in fp32. The authors keep the update and lr in
        # bf16 from here on (nanochat casts back to the parameter dtype, as here); the difference
        # is bf16 rounding of the update, not a change of method.
        U = polar_express(g, group['ns_steps']).float()
        U = normuon(U, state['second_momentum_buffer'], group['beta2'])

        # lr * sqrt(max(1, rows / cols)) (METHOD.md §2): an update with singular values ~1 has RMS entry
        # 1/sqrt(max(rows, cols)); the factor makes it 1/sqrt(cols) = 1/sqrt(fan_in) for every shape,
        # so tall matrices (rows = out_features > in_features, e.g. the MLP's c_fc) are not under-stepped.
        lr = group['lr'] * math.sqrt(max(1.0, rows / cols))
        wd = group['weight_decay']

        # Cautious weight decay (METHOD.md §2: "applied only where grad * param >= 0"). "grad" is the
        # final update U (after momentum, orthogonalisation and NorMuon), as in the authors' code
        # and nanochat: decay is applied only to entries the update already pushes towards zero,
        # so decay never fights the optimiser. Both terms use the parameter before this step.
        mask = (U * P) >= 0
        P.sub_(lr * U + (lr * wd) * P * mask)
        torch._foreach_copy_(params, list(P.unbind(0)))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group['kind'] == 'adamw':
                self._step_adamw(group)
            else:
                self._step_muon(group)
        return loss


# -----------------------------------------------------------------------------
# Parameter groups (METHOD.md §2). A parameter goes to Muon iff it is a 2-D matrix inside the
# transformer blocks: its name starts with prelude., recur. or coda. Everything else goes to
# AdamW with no weight decay: the tied embedding wte (also the output head), the value
# embeddings, norm weights, all vectors, and Parcae's injection parameters (A_log, dt_bias,
# B.weight, C_proj.weight, and adapter.weight of the concat baseline), which the authors keep on
# AdamW for stability. The authors match substrings of their own module names ('embed', 'norm',
# 'a_log', 'adapter.b', 'transformer.c.', ...) and send every other matrix to Muon; in this
# project's naming the rule here selects the same parameters by role.

MUON_PREFIXES = ('prelude.', 'recur.', 'coda.')
ADAMW_LEAVES = {'A_log', 'dt_bias', 'B.weight', 'C_proj.weight', 'adapter.weight'}


def is_muon_param(name: str, p: Tensor) -> bool:
    # Accept names from a torch.compile'd or DDP-wrapped model too.
    while name.startswith(('_orig_mod.', 'module.')):
        name = name.split('.', 1)[1]
    parts = name.split('.')
    leaf = parts[-1] if parts[-1] != 'weight' else '.'.join(parts[-2:])
    return (p.ndim == 2 and name.startswith(MUON_PREFIXES) and leaf not in ADAMW_LEAVES
            and 'value_embeds' not in parts)


def build_optimizer(model: torch.nn.Module, adamw_lr: float, muon_lr: float = 8e-3,
                    weight_decay: float = 0.2, muon: bool = True) -> MuonAdamW:
    """One AdamW group (METHOD.md §2's ADAMW_DEFAULTS, no weight decay) and one Muon group per matrix shape, in
    a fixed order (the model's parameter order), so checkpoints load back into the same groups. Each
    group also carries 'names', the parameter names it holds, for logging. muon=False puts every parameter
    in the AdamW group (train.py --optimizer=adamw: the setup of the paper's RDM comparison)."""
    adamw, matrices = {'params': [], 'names': []}, {}
    for name, p in model.named_parameters():  # named_parameters() already yields a tied tensor once
        if not p.requires_grad:
            continue
        group = matrices.setdefault(tuple(p.shape), {'params': [], 'names': []}) \
            if muon and is_muon_param(name, p) else adamw
        group['params'].append(p)
        group['names'].append(name)
    groups = [dict(adamw, kind='adamw', lr=adamw_lr, **ADAMW_DEFAULTS)]
    groups += [dict(g, kind='muon', lr=muon_lr, weight_decay=weight_decay) for g in matrices.values()]
    return MuonAdamW(groups)


def optimizer_state_bytes(model: torch.nn.Module, muon: bool = True) -> int:
    """Bytes of the state build_optimizer's optimiser keeps for model: AdamW's two float32 moments per parameter;
    Muon's float32 momentum per parameter and its factored second moment, one float32 per row or column of
    each matrix, whichever is longer (normuon). Works on a model built on the meta device."""
    total = 0
    for group in build_optimizer(model, adamw_lr=1.0, muon=muon).param_groups:
        numel = sum(p.numel() for p in group['params'])
        if group['kind'] == 'adamw':
            total += 8 * numel
        else:
            total += 4 * numel + 4 * len(group['params']) * max(group['params'][0].shape)
    return total


# -----------------------------------------------------------------------------
# Schedules (METHOD.md §2), pure functions of the step the training loop applies before each
# optimizer.step(). The forms are the authors' scripts/train.py and nanochat's scripts/base_train.py.

def lr_multiplier(step: int, total_steps: int, warmdown_frac: float = 0.5) -> float:
    """No warmup; 1.0 until the last warmdown_frac of the steps, then linear down to 0 at total_steps."""
    warmdown = round(warmdown_frac * total_steps)
    if step <= total_steps - warmdown:
        return 1.0
    return max(0.0, (total_steps - step) / warmdown)


def muon_momentum(step: int, warmup_steps: int = 300, start: float = 0.85, end: float = 0.95) -> float:
    """Muon momentum warmed up linearly from 0.85 to 0.95 over the first 300 steps, then held."""
    frac = min(step / warmup_steps, 1.0)
    return start + frac * (end - start)


def weight_decay_at(step: int, total_steps: int, wd: float) -> float:
    """Muon's cautious weight decay, wd at step 0 decayed linearly to 0 at total_steps."""
    return wd * max(0.0, 1 - step / total_steps)


def learning_rate_for_depth(depth: int) -> float:
    """AdamW learning rate per size (METHOD.md §2): 8e-3 for 140M and 370M (depth 6, 12), 6e-3 for
    770M and 1.3B (depth 18, 24). Muon's base lr is 8e-3 at every size."""
    return 8e-3 if depth <= 12 else 6e-3
