"""The maths of speculative acceptance: total variation, the mentored mix, the accept test and
the residual a rejected draft's replacement is drawn from. Pure tensor functions; the
distributions they take come from engine/worker/sampling.py's probs_for."""
from __future__ import annotations

import torch
from torch import Tensor


def total_variation(p: Tensor, q: Tensor) -> Tensor:
    """TV(p, q) = 1/2 sum |p - q| over the last dim."""
    return 0.5 * (p - q).abs().sum(-1)


def mentored_mix(p: Tensor, q: Tensor, tv_budget: float) -> tuple[Tensor, Tensor]:
    """π = (1 - θ) p + θ q with θ = min(1, D / TV(p, q)) (θ = 1 when p == q): TV(π, p) <= D."""
    if not 0.0 <= tv_budget <= 1.0:
        raise ValueError(f"tv_budget must be in [0, 1], got {tv_budget}")
    d = total_variation(p, q)
    theta = torch.where(d > 0, (tv_budget / d).clamp(max=1.0), torch.ones_like(d))
    theta_ = theta.unsqueeze(-1)
    return (1 - theta_) * p + theta_ * q, theta


def speculative_accept(target: Tensor, q: Tensor, x: Tensor | int, u: Tensor | float) -> Tensor:
    """Accept draft token x ~ q with probability min(1, target(x) / q(x)), using u ~ U[0, 1).

    target is p (lossless) or π (mentored). target, q [..., V]; x, u [...]. Returns bool [...].
    """
    x = torch.as_tensor(x, dtype=torch.int64, device=q.device).unsqueeze(-1)
    u = torch.as_tensor(u, dtype=torch.float64, device=q.device)
    tx = target.gather(-1, x).squeeze(-1).double()
    qx = q.gather(-1, x).squeeze(-1).double()
    return u * qx < tx   # = u < tx / qx without dividing by qx


def residual(target: Tensor, q: Tensor) -> Tensor:
    """Where a rejected draft's replacement is drawn from: normalize(max(target - q, 0)).

    Why the target: x ~ q accepted with min(1, t/q) gives P(x) = min(q, t)(x) + P(reject) r(x),
    with P(reject) = 1 - sum min(q, t) = sum max(t - q, 0). P = t for every x iff
    r = max(t - q, 0) / sum max(t - q, 0): the residual must be built from the target, so
    max(π - q, 0) for mentored decoding. The article's max(p - q, 0) is the same
    distribution: π - q = (1 - θ)(p - q), a positive multiple of p - q whenever θ < 1, and at
    θ = 1 (π = q) nothing is ever rejected. Passing p or π is therefore equally exact; p
    avoids the cancellation in π - q when θ is close to 1.
    When target <= q everywhere nothing is rejected either (in exact arithmetic); target
    itself is returned so the caller never divides by zero.
    """
    r = (target - q).clamp(min=0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp(min=torch.finfo(r.dtype).tiny),
                       target / target.sum(-1, keepdim=True))
