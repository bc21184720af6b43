"""
depths.py: the recurrence depths of a training forward (METHOD.md §2). Each sequence runs n_i loop steps
without gradient, then k_i with it; Parcae draws T_i = max(1, Poisson(mu_rec)) per sequence and splits it
into n_i = T_i - k_i and k_i = min(T_i, mu_bwd). SAMPLINGS names the other samplers (the per-batch
ablation, the authors' other schemes); config.sampling picks one, and Parcae.forward draws from it in
training (model.py).

    n, k = sample_depths(config, batch_size, generator)   # then model(x, y, depths=(n, k)) replays the draw
    mean_n, mean_k = mean_steps(config)                   # what a draw runs on average (executed FLOPs, MFU)
"""

import math

import torch

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


# -----------------------------------------------------------------------------
# Drawing depths

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


# -----------------------------------------------------------------------------
# Expected depths

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
