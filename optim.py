"""
The paper's optimiser (METHOD.md §2), the authors' MuonAdamW, and its schedules.
It is one torch.optim.Optimizer with two kinds of parameter groups.

- kind='adamw' holds the embeddings, norms, every vector, and Parcae's injection parameters
  (A_log, dt_bias, B, C_proj, or the concat baseline's adapter). It is plain AdamW, no weight decay.
- kind='muon' holds every other matrix, one group per shape, orthogonalised as a stack.
  It runs Nesterov momentum, Polar Express in bf16, NorMuon and cautious weight decay.

A library, not a script:
    optimizer = build_optimizer(model, adamw_lr=learning_rate_for_depth(6))
    for group in optimizer.param_groups:                  # before each optimizer.step()
        group['lr'] = group['initial_lr'] * lr_multiplier(step, total_steps)

It follows the authors' recpre/optim/muon_adamw.py and scripts/train.py (sandyresearch/parcae).
They follow nanochat's nanochat/optim.py, itself from modded-nanogpt.
"""

import math

import torch
from torch import Tensor

# -----------------------------------------------------------------------------
# Polar Express (METHOD.md §2; Amsel et al., https://arxiv.org/abs/2505.16932).
# Each step applies an odd quintic a X + b (X X^T) X + c (X X^T)^2 X.
# Its coefficients push every singular value towards 1, so G = U S V^T goes to about U V^T,
# the orthogonal matrix nearest the momentum. They are the published ones, as the authors' are.
# Dividing by ||G||_F * 1.02 first (nanochat uses 1.01) puts the singular values in (0, 1].

POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def polar_express(G: Tensor) -> Tensor:
    """Approximately orthogonalise the last two dims of G, in bf16.
    The singular values end in about [0.85, 1.15]; those below ~1e-3 of ||G||_F stay smaller."""
    X = G.bfloat16()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    # wide, so that X X^T is the smaller Gram matrix (the authors write out the tall case instead)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


# -----------------------------------------------------------------------------
# NorMuon (METHOD.md §2; Li et al., https://arxiv.org/abs/2510.05491), the authors' math.
# The orthogonalised update's scale is uneven across neurons. So it is divided by the root of
# an EMA of its mean square per row (per column when wide), then rescaled to its former norm.

def normuon(U: Tensor, v: Tensor, beta2: float) -> Tensor:
    """U (n, rows, cols) -> U normalised, with v, (n, rows, 1) or (n, 1, cols), updated in place."""
    reduce_dim = -1 if U.size(-2) >= U.size(-1) else -2
    v.lerp_(U.square().mean(dim=reduce_dim, keepdim=True), 1 - beta2)
    scaled = U * v.clamp_min(1e-10).rsqrt()
    norm_ratio = (U.norm(dim=(-2, -1), keepdim=True)
                  / scaled.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10))
    return scaled * norm_ratio


# -----------------------------------------------------------------------------
# The updates, as plain functions of tensors. The hyperparameters are numbers, or 0-d tensors when
# compiled (below). AdamW follows torch.optim.AdamW's order of operations (single-tensor path), so
# that the two agree to the last bit on CPU.

def adamw_update(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, wd) -> None:
    """AdamW on a group's tensors, in place. steps counts each one's updates, this one included."""
    for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        p.mul_(1 - lr * wd)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g * (1 - beta2))  # addcmul_'s value= takes no tensor
        denom = (v.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
        p.add_(m * (-lr / (1 - beta1 ** t)) / denom)  # addcdiv_, in the same order


def muon_update(P, g, momentum_buffer, second_momentum_buffer, momentum, lr, wd, beta2) -> None:
    """Muon on a stack P (n, rows, cols) and its gradients g, both changed in place."""
    momentum_buffer.lerp_(g, 1 - momentum)
    g = g.lerp_(momentum_buffer, momentum)
    # fp32 from here, as nanochat; the authors stay in bf16, which differs only by rounding
    U = polar_express(g).float()
    U = normuon(U, second_momentum_buffer, beta2)
    # Cautious weight decay (METHOD.md §2), as the authors', decays only where U * P >= 0, the
    # entries the update already moves towards zero, so the decay never fights the optimiser.
    mask = (U * P) >= 0
    P.sub_(lr * U + (lr * wd) * P * mask)


# Compiled, each group's update is one graph of few fused kernels, not dozens of small ones. The
# hyperparameters go in as 0-d CPU float64 tensors, graph inputs as in nanochat, so a schedule that
# changes lr, momentum or wd every step never recompiles, and they reach the kernels as the plain
# update's floats do. Without fullgraph, an update past dynamo's recompile limit runs eagerly.

def compiled_update(update, backend: str):
    compiled = torch.compile(update, dynamic=False, backend=backend)

    def scalar(value):
        return torch.tensor(float(value), dtype=torch.float64)

    def run(*tensors, **hyper):
        hyper = {k: [scalar(t) for t in v] if k == 'steps' else scalar(v) for k, v in hyper.items()}
        compiled(*tensors, **hyper)
    return run


# -----------------------------------------------------------------------------
# The optimiser. Every group has params, kind, lr and initial_lr, the lr the schedule scales;
# AdamW groups add betas, eps, weight_decay; Muon groups momentum, weight_decay, beta2.
# A missing key takes METHOD.md §2's value, below.

ADAMW_DEFAULTS = dict(betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
MUON_DEFAULTS = dict(momentum=0.95, weight_decay=0.2, beta2=0.95)


class MuonAdamW(torch.optim.Optimizer):
    def __init__(self, param_groups: list[dict]):
        super().__init__(param_groups, defaults={})
        self.adamw_update, self.muon_update = adamw_update, muon_update

    def compile(self, backend: str = "inductor") -> None:
        """Run the updates compiled from now on (the state and its checkpoints are unchanged)."""
        self.adamw_update = compiled_update(adamw_update, backend)
        self.muon_update = compiled_update(muon_update, backend)

    def add_param_group(self, group: dict) -> None:
        kind = group.get('kind')
        if kind not in ('adamw', 'muon'):
            raise ValueError(f"param group kind must be 'adamw' or 'muon', got {kind!r}")
        for key, value in (ADAMW_DEFAULTS if kind == 'adamw' else MUON_DEFAULTS).items():
            group.setdefault(key, value)
        group.setdefault('initial_lr', group['lr'])
        params = group['params'] = ([group['params']] if isinstance(group['params'], Tensor)
                                    else list(group['params']))
        if kind == 'muon' and any(p.ndim != 2 or p.shape != params[0].shape for p in params):
            raise ValueError("a muon group holds 2-D parameters of a single shape "
                             "(they are stacked)")
        super().add_param_group(group)

    def _step_adamw(self, group: dict) -> None:
        params = [p for p in group['params'] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if not state:
                state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state['step'] += 1
        if not params:
            return
        states, (beta1, beta2) = [self.state[p] for p in params], group['betas']
        self.adamw_update(params, [p.grad for p in params], [s['exp_avg'] for s in states],
                          [s['exp_avg_sq'] for s in states], steps=[s['step'] for s in states],
                          lr=group['lr'], beta1=beta1, beta2=beta2, eps=group['eps'],
                          wd=group['weight_decay'])

    # Muon on one group's stack (n, rows, cols). Its buffers live in the first parameter's state,
    # as in the authors' code, so state_dict saves them like any optimiser state.
    def _step_muon(self, group: dict) -> None:
        params = group['params']
        if all(p.grad is None for p in params):
            return
        state = self.state[params[0]]
        n, (rows, cols) = len(params), params[0].shape
        if not state:
            state['momentum_buffer'] = params[0].new_zeros(n, rows, cols)
            factored = (n, rows, 1) if rows >= cols else (n, 1, cols)
            state['second_momentum_buffer'] = params[0].new_zeros(factored, dtype=torch.float32)
        # no gradient counts as a zero gradient, as in the authors' code
        g = torch.stack([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
        P = torch.stack(params)
        # an update's RMS entry is then 1/sqrt(fan_in) for every shape, tall too (METHOD.md §2)
        lr = group['lr'] * math.sqrt(max(1.0, rows / cols))
        self.muon_update(P, g, state['momentum_buffer'], state['second_momentum_buffer'],
                         momentum=group['momentum'], lr=lr, wd=group['weight_decay'],
                         beta2=group['beta2'])
        torch._foreach_copy_(params, list(P.unbind(0)))

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            (self._step_adamw if group['kind'] == 'adamw' else self._step_muon)(group)
        return loss


# -----------------------------------------------------------------------------
# Parameter groups (METHOD.md §2). Muon takes the 2-D matrices inside the blocks (prelude.,
# recur., coda.), and AdamW everything else. The injection (A_log, dt_bias, B or the adapter)
# and C_proj live outside the blocks, so the prefix alone keeps them on AdamW, as the authors do.
# The authors match substrings of their own names; this picks the same by place.

def is_muon_param(name: str, p: Tensor) -> bool:
    # names from a compiled or DDP-wrapped model too
    while name.startswith(('_orig_mod.', 'module.')):
        name = name.split('.', 1)[1]
    return p.ndim == 2 and name.startswith(('prelude.', 'recur.', 'coda.'))


def build_optimizer(model: torch.nn.Module, adamw_lr: float, muon_lr: float = 8e-3,
                    weight_decay: float = 0.2, muon: bool = True) -> MuonAdamW:
    """One AdamW group and one Muon group per matrix shape, in the model's parameter order, so a
    checkpoint loads back into the same groups; each lists its 'names'. muon=False is AdamW only."""
    adamw, matrices = {'params': [], 'names': []}, {}
    for name, p in model.named_parameters():  # a tied tensor comes once
        if not p.requires_grad:
            continue
        group = matrices.setdefault(tuple(p.shape), {'params': [], 'names': []}) \
            if muon and is_muon_param(name, p) else adamw
        group['params'].append(p)
        group['names'].append(name)
    groups = [dict(adamw, kind='adamw', lr=adamw_lr, **ADAMW_DEFAULTS)]
    groups += [dict(g, kind='muon', lr=muon_lr, weight_decay=weight_decay)
               for g in matrices.values()]
    return MuonAdamW(groups)


def optimizer_state_bytes(model: torch.nn.Module, muon: bool = True) -> int:
    """Bytes of the optimiser's state for model, which may be on the meta device. Its float32
    moments are two per AdamW parameter, one per Muon parameter, and NorMuon's per row or column."""
    total = 0
    for group in build_optimizer(model, adamw_lr=1.0, muon=muon).param_groups:
        numel = sum(p.numel() for p in group['params'])
        if group['kind'] == 'adamw':
            total += 8 * numel
        else:
            total += 4 * numel + 4 * len(group['params']) * max(group['params'][0].shape)
    return total


# -----------------------------------------------------------------------------
# Schedules (METHOD.md §2), functions of the step, as in the authors' scripts/train.py and
# nanochat's scripts/base_train.py

def lr_multiplier(step: int, total_steps: int, warmdown_frac: float = 0.5) -> float:
    """No warmup; 1.0, then linear down to 0 over the last warmdown_frac of the steps."""
    warmdown = round(warmdown_frac * total_steps)
    return 1.0 if step <= total_steps - warmdown else max(0.0, (total_steps - step) / warmdown)


def muon_momentum(step: int, warmup_steps: int = 300) -> float:
    """Muon momentum, 0.85 to 0.95 over the first 300 steps."""
    return 0.85 + min(step / warmup_steps, 1.0) * (0.95 - 0.85)


def weight_decay_at(step: int, total_steps: int, wd: float) -> float:
    """wd, linearly down to 0."""
    return wd * max(0.0, 1 - step / total_steps)


def learning_rate_for_depth(depth: int) -> float:
    """AdamW's lr per size (METHOD.md §2)."""
    return 8e-3 if depth <= 12 else 6e-3
