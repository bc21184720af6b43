"""
scaling_fit.py: the fitters of scaling.py (paper §5.2-5.3, Appendix L), with the noise the seeds measure.

- isoFLOP parabolas in ln mu_rec and their vertices, for one set of losses or thousands of resampled ones.
- power laws y = k C^g, least squares in log-log.
- a parametric bootstrap of the exponents g_mu and g_D (bootstrap_exponents says how).
- the unified law L(T | mu, D) = E + X mu^-x + Y D^-y + Z exp(-z T / mu), Huber loss and L-BFGS.

numpy does the fits; torch only the unified law's gradients.
"""

import math

import numpy as np
import torch

# -----------------------------------------------------------------------------
# isoFLOP parabolas and power laws (paper §5.2, Fig. 4)


def parabola_vertices(mu_rec, losses, tokens):
    """Fit final loss ~ a (ln mu)^2 + b ln mu + c inside one budget, per row of losses ((n,) or (B, n)).
    It returns a dict of arrays: mu_star, D_star, L_star, a, b, c and inside.
    mu_star is the vertex, at most one sampled range beyond the samples.
    When the parabola has no minimum, mu_star is the best sampled point.
    D_star is read off at the vertex, since ln D is linear in ln mu inside a budget.
    L_star is the parabola's value there; inside says the vertex lies within the sampled mu_rec."""
    x = np.log(np.asarray(mu_rec, float))
    L = np.atleast_2d(np.asarray(losses, float))
    a, b, c = np.linalg.lstsq(np.stack([x * x, x, np.ones_like(x)], 1), L.T, rcond=None)[0]
    slope, intercept = np.polyfit(x, np.log(np.asarray(tokens, float)), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        x_star = np.where(a > 0, -b / (2 * a), x[np.argmin(L, axis=1)])
    width = x.max() - x.min()  # a near-flat parabola's vertex runs off to infinity: keep it within one more range
    x_star = np.clip(x_star, x.min() - width, x.max() + width)
    return dict(mu_star=np.exp(x_star), D_star=np.exp(intercept + slope * x_star),
                L_star=a * x_star ** 2 + b * x_star + c, a=a, b=b, c=c,
                inside=(a > 0) & (x.min() <= x_star) & (x_star <= x.max()))


def parabola_optimum(mu_rec, losses, tokens):
    """One budget's vertex: mu_rec*, D*, L* (floats), the parabola [a, b, c] and whether the vertex is inside."""
    v = parabola_vertices(mu_rec, losses, tokens)
    return dict(mu_star=float(v["mu_star"][0]), D_star=float(v["D_star"][0]), L_star=float(v["L_star"][0]),
                parabola=[float(v[k][0]) for k in "abc"], vertex_inside=bool(v["inside"][0]))


def power_law(C, y):
    """y = k C^g, least squares in log-log -> (k, g): the slope the bootstrap redraws (log_log_slopes)."""
    y = np.asarray(y, float)
    g = float(log_log_slopes(C, y[None])[0])
    return math.exp(np.log(y).mean() - g * np.log(np.asarray(C, float)).mean()), g


def log_log_slopes(C, Y):
    """The power-law exponent of every row of Y (shape (B, len(C))) at once: least-squares slopes in log-log."""
    u = np.log(np.asarray(C, float))
    u = u - u.mean()
    return (np.log(Y) @ u) / (u @ u)


# -----------------------------------------------------------------------------
# Noise: the seeds' spread, and the exponents' intervals it implies


def pooled_spread(groups):
    """Seed-to-seed standard deviation pooled over the points run with several seeds: the root of the mean of
    their sample variances (ddof 1). groups: a list of loss lists, one per point. -> (sigma, degrees of freedom)."""
    several = [np.asarray(g, float) for g in groups if len(g) > 1]
    dof = sum(len(g) - 1 for g in several)
    if not dof:
        return None, 0
    return float(math.sqrt(sum(((g - g.mean()) ** 2).sum() for g in several) / dof)), dof


def bootstrap_exponents(budgets, sigma, draws=2000, level=0.9, seed=0):
    """Parametric bootstrap of g_mu and g_D over the seed spread. budgets: one dict per budget with C, mu_rec,
    loss (the mean over its seeds at each mu_rec), seeds (how many) and tokens. Each draw adds Gaussian noise of
    standard deviation sigma / sqrt(seeds) to every mean loss, refits every parabola and both power laws.
    -> {"mu_rec": (low, high), "D": (low, high)}: the central `level` interval of the redrawn exponents."""
    rng = np.random.default_rng(seed)
    C = [b["C"] for b in budgets]
    mu_star, D_star = np.empty((draws, len(C))), np.empty((draws, len(C)))
    for j, b in enumerate(budgets):
        loss = np.asarray(b["loss"], float)
        noise = sigma / np.sqrt(np.asarray(b["seeds"], float)) * rng.standard_normal((draws, loss.size))
        v = parabola_vertices(b["mu_rec"], loss + noise, b["tokens"])
        mu_star[:, j], D_star[:, j] = v["mu_star"], v["D_star"]
    tails = [100 * (1 - level) / 2, 100 * (1 + level) / 2]
    return {label: tuple(float(q) for q in np.percentile(log_log_slopes(C, Y), tails))
            for label, Y in (("mu_rec", mu_star), ("D", D_star))}


# -----------------------------------------------------------------------------
# The unified law (paper §5.3, App. L)

HUBER_DELTA = 1e-3  # on log-loss residuals, as in Chinchilla's fits (Hoffmann et al. 2022, §3.3)


def unified_log_terms(theta, mu, D, T):
    """Compute the four log-terms of L(T | mu, D) = E + X mu^-x + Y D^-y + Z exp(-z T / mu).
    Every term is positive, so ln L is the logsumexp of the four.
    theta follows Chinchilla's parametrisation: ln E, ln X, x, ln Y, y, ln Z, z."""
    e, lx, x, ly, y, lz, z = theta
    return torch.stack([e.expand_as(mu), lx - x * mu.log(), ly - y * D.log(), lz - z * T / mu])


def unified_predict(p, mu, D, T):
    """The unified law at (mu, D, T) for fitted parameters p (a dict)."""
    mu, D, T = (np.asarray(v, float) for v in (mu, D, T))
    return p["E"] + p["X"] * mu ** -p["x"] + p["Y"] * D ** -p["y"] + p["Z"] * np.exp(-p["z"] * T / mu)


def fit_unified(mu, D, T, losses, max_iter=100):
    """Huber loss (delta 1e-3) on ln L residuals, minimised by L-BFGS from a grid of starts; the best is kept."""
    mu, D, T, L = (torch.tensor(np.asarray(v, float), dtype=torch.float64) for v in (mu, D, T, losses))
    log_L, L_min, lnD = L.log(), float(L.min()), float(D.log().mean())
    best = (math.inf, None)
    for x0 in (0.2, 0.6, 1.2):
        for y0 in (0.1, 0.3, 0.6):
            for z0 in (0.5, 2.0):
                start = [math.log(0.8 * L_min), math.log(0.1 * L_min), x0, math.log(0.1 * L_min) + y0 * lnD, y0,
                         math.log(0.1 * L_min), z0]
                theta = torch.tensor(start, dtype=torch.float64, requires_grad=True)
                opt = torch.optim.LBFGS([theta], lr=1, max_iter=max_iter, line_search_fn="strong_wolfe")

                def objective():
                    opt.zero_grad()
                    residual = torch.logsumexp(unified_log_terms(theta, mu, D, T), 0) - log_L
                    # Huber(r, delta) / delta^2: the same minimiser, at a scale L-BFGS's stopping tolerances suit
                    loss = torch.nn.functional.huber_loss(residual / HUBER_DELTA, torch.zeros_like(residual),
                                                          delta=1.0, reduction="sum")
                    loss.backward()
                    return loss

                opt.step(objective)
                value = objective().item()  # step() returns the loss at the start, not at the end
                if math.isfinite(value) and value < best[0]:
                    best = (value, theta.detach().clone())
    e, lx, x, ly, y, lz, z = best[1].tolist()
    return dict(E=math.exp(e), X=math.exp(lx), x=x, Y=math.exp(ly), y=y, Z=math.exp(lz), z=z, huber=best[0])


def mean_relative_error(predicted, observed):
    predicted, observed = np.asarray(predicted, float), np.asarray(observed, float)
    return float(np.mean(np.abs(predicted - observed) / observed))


# -----------------------------------------------------------------------------
# Paired differences: a t-interval and a verdict (evidence.py's claims, scaling.py's frontier)

def t_quantile(p, dof, points=4001):
    """The p-quantile (p > 0.5) of Student's t with dof degrees of freedom, without scipy: its density
    integrated by Simpson's rule on [0, t], then bisection. Accurate to ~1e-7 for dof >= 1."""
    log_norm = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)

    def cdf(t):
        x = np.linspace(0.0, t, points)
        density = np.exp(log_norm - (dof + 1) / 2 * np.log1p(x * x / dof))
        weights = np.ones(points)
        weights[1:-1:2], weights[2:-1:2] = 4, 2
        return 0.5 + float(weights @ density) * (x[1] - x[0]) / 3

    low, high = 0.0, 1.0
    while cdf(high) < p:
        low, high = high, 2 * high
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def t_interval(mean, standard_error, dof, level=0.9):
    """mean +- t_{(1+level)/2, dof} * standard_error, as a [low, high] list."""
    half = t_quantile((1 + level) / 2, dof) * standard_error
    return [mean - half, mean + half]


def paired_interval(differences, level=0.9):
    """A two-sided t-interval for the mean of paired differences (one per seed, arm A minus arm B, everything
    else shared). -> dict(measured, ci90, n, sd); with fewer than 2 pairs the interval is None."""
    d = np.asarray(differences, float)
    n = int(d.size)
    out = dict(measured=float(d.mean()) if n else None, ci90=None, n=n, sd=None)
    if n >= 2:
        out["sd"] = float(d.std(ddof=1))
        out["ci90"] = t_interval(out["measured"], out["sd"] / math.sqrt(n), n - 1, level)
    return out


def interval_verdict(ci, expected_sign):
    """Judge an interval against the side the paper predicts (expected_sign +1 or -1).
    It is 'shown' when the interval excludes 0 on that side, 'opposite' when it excludes 0 on the other.
    It is 'not shown' when it holds 0, or when there is no interval."""
    if ci is None or ci[0] <= 0 <= ci[1]:
        return "not shown"
    return "shown" if (ci[0] > 0) == (expected_sign > 0) else "opposite"


def drift_check(fractions, differences, level=0.9):
    """Is a paired comparison long enough to judge? differences[k][i]: arm A minus arm B of seed i at the eval at
    fractions[k] of training (0.6 ... 1.0, the last the final difference). It is when the seed-mean difference has
    one sign at every eval and the interval of its drift, final minus 80%, lies within half the final difference.
    A schedule that moves both arms alike (the warmdown) moves neither; a gap still closing trips it.
    -> dict(by_fraction (the seed means), one_sign, drift (paired_interval), limit, long_enough, reason)."""
    d = np.asarray(differences, float)
    means = d.mean(axis=1)
    drift = paired_interval(d[-1] - d[list(fractions).index(0.8)], level)
    limit = abs(float(means[-1])) / 2
    within = drift["ci90"] is not None and -limit <= drift["ci90"][0] and drift["ci90"][1] <= limit
    one_sign = bool(np.all(means > 0) or np.all(means < 0))
    reason = None
    if not one_sign:
        reason = f"the mean difference changes sign between {fractions[0]:.0%} and 100% of training"
    elif not within:
        reason = "still drifting: final minus 80% is " + ("-" if drift["ci90"] is None else
                                                          f"[{drift['ci90'][0]:+.3f}, {drift['ci90'][1]:+.3f}]") \
                 + f", not within ±{limit:.3f} (half the final difference)"
    return dict(by_fraction=dict(zip((f"{f:g}" for f in fractions), map(float, means))), one_sign=one_sign,
                drift=drift, limit=limit, long_enough=reason is None, reason=reason)


def seeds_needed(sd, effect, floor=3, cap=5, level=0.9):
    """Fix the paired seeds of an experiment from a pilot's spread, before it runs.
    It is the fewest n in [floor, cap] whose interval's half-width t sd / sqrt(n) is at most half the effect.
    It is cap when no n is enough."""
    q = 1 - (1 - level) / 2
    return next((n for n in range(floor, cap + 1) if t_quantile(q, n - 1) * sd / math.sqrt(n) <= abs(effect) / 2),
                cap)
