"""How well the trainer's recomputed log-probs agree with the sampler's, on the trained tokens, before the
update (the rollout–training mismatch the field reports: a Pearson correlation of token probabilities above
0.99 when the rollouts were sampled by the weights being trained, with the same temperature and numerics).

The metrics keep verl's names (``training/rollout_probs_diff_*``, ``training/rollout_actor_probs_pearson_corr``)
so a run here and a verl run read alike. Sums are accumulated in float64 over micro-batches, so the figure
does not depend on how the rows were split.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

CORR = "training/rollout_actor_probs_pearson_corr"


@dataclass
class Agreement:
    """Running sums over trained tokens of p = exp(trainer log-prob) and q = exp(sampler log-prob)."""

    n: int = 0
    abs_diff: float = 0.0
    max_diff: float = 0.0
    sp: float = 0.0
    sq: float = 0.0
    spp: float = 0.0
    sqq: float = 0.0
    spq: float = 0.0
    sd2: float = 0.0

    def add(self, lp_trainer: torch.Tensor, lp_sampler: torch.Tensor, mask: torch.Tensor) -> None:
        """``lp_trainer``, ``lp_sampler``: (R, Lc) log-probs; ``mask``: (R, Lc) bool, True = trained token."""
        m = mask.bool()
        p = lp_trainer.detach()[m].double().exp()  # (N,)
        q = lp_sampler.detach()[m].double().exp()
        if p.numel() == 0:
            return
        d = p - q
        self.n += int(p.numel())
        self.abs_diff += float(d.abs().sum())
        self.max_diff = max(self.max_diff, float(d.abs().max()))
        self.sd2 += float((d * d).sum())
        self.sp, self.sq = self.sp + float(p.sum()), self.sq + float(q.sum())
        self.spp, self.sqq, self.spq = self.spp + float((p * p).sum()), self.sqq + float((q * q).sum()), \
            self.spq + float((p * q).sum())

    def corr(self) -> float:
        """Pearson correlation of p and q; NaN with fewer than two tokens or a constant side."""
        if self.n < 2:
            return math.nan
        n = self.n
        cov = self.spq - self.sp * self.sq / n
        vp, vq = self.spp - self.sp**2 / n, self.sqq - self.sq**2 / n
        if vp <= 0 or vq <= 0:
            return math.nan
        return cov / math.sqrt(vp * vq)

    def metrics(self, warn_below: float) -> dict[str, float]:
        """The figures, and ``training/rollout_agreement_warn`` = 1 when the correlation is below ``warn_below``."""
        if self.n == 0:
            return {}
        mean = self.abs_diff / self.n
        var = max(0.0, self.sd2 / self.n - (self.abs_diff / self.n) ** 2)
        c = self.corr()
        return {"training/rollout_probs_diff_mean": mean, "training/rollout_probs_diff_max": self.max_diff,
                "training/rollout_probs_diff_std": math.sqrt(var), CORR: c,
                "training/rollout_agreement_tokens": float(self.n),
                "training/rollout_agreement_warn": float(c < warn_below)}  # (NaN: too few or constant: no verdict)


def warn_if_low(m: dict[str, float], threshold: float) -> None:
    """One line on stderr when :meth:`Agreement.metrics` flagged the correlation as below ``threshold``."""
    if m.get("training/rollout_agreement_warn"):
        print(f"[mosaic] warning: trainer and sampler token probabilities agree at Pearson {m[CORR]:.4f} < "
              f"rollout.agreement_warn_corr={threshold:g} (mean |dp| {m['training/rollout_probs_diff_mean']:.4f} over "
              f"{int(m['training/rollout_agreement_tokens'])} trained tokens): the rollouts were not sampled by the "
              "weights being trained as they are trained (temperature, weights, numerics or tokens differ)",
              file=sys.stderr, flush=True)
