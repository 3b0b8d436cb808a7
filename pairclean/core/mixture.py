"""Gaussian-mixture cleanliness: the clean component is the one with the highest mean.

Shared by finalize (2 components over similarities, NCR/SDD style) and the robust-training
methods (2 or 3 components over min-max normalised losses or discrepancies).
"""

from __future__ import annotations

from dataclasses import dataclass, asdict
from typing import TYPE_CHECKING

import numpy as np

from pairclean.ops.records import JsonObject

if TYPE_CHECKING:  # sklearn loads when a mixture is fitted: the scores contract names FittedMixture, and
    from sklearn.mixture import GaussianMixture  # the CLI starts without sklearn (tests/test_demo.py)


@dataclass
class FittedMixture:
    means: list[float]
    variances: list[float]
    weights: list[float]
    clean_component: int
    n_fit: int

    def p_clean(self, values) -> np.ndarray:
        """Posterior of the clean (highest-mean) component for 1-D values, in closed form."""
        x = np.asarray(values, dtype=np.float64).reshape(-1, 1)
        means = np.asarray(self.means)[None, :]
        var = np.asarray(self.variances)[None, :]
        log_p = -0.5 * ((x - means) ** 2 / var + np.log(2 * np.pi * var)) + np.log(np.asarray(self.weights))[None, :]
        log_p -= log_p.max(axis=1, keepdims=True)
        p = np.exp(log_p)
        return p[:, self.clean_component] / p.sum(axis=1)

    def as_dict(self) -> JsonObject:
        return asdict(self)


def fit_similarity_mixture(values, seed: int = 0, max_iter: int = 100, tol: float = 1e-3,
                           reg_covar: float = 1e-6) -> FittedMixture:
    """Fit a 2-component 1-D GaussianMixture; finite values only."""
    from sklearn.mixture import GaussianMixture

    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)].reshape(-1, 1)
    if len(x) < 2:
        raise ValueError("need at least two finite similarities to fit the mixture")
    gmm = GaussianMixture(n_components=2, max_iter=max_iter, tol=tol, reg_covar=reg_covar, random_state=seed)
    gmm.fit(x)
    means = gmm.means_.ravel()
    return FittedMixture(
        means=means.tolist(),
        variances=gmm.covariances_.ravel().tolist(),
        weights=gmm.weights_.tolist(),
        clean_component=int(np.argmax(means)),
        n_fit=int(len(x)),
    )


def minmax(values) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    lo, hi = np.nanmin(x), np.nanmax(x)
    return (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)


def clean_posterior(values, n_components: int = 2, higher_is_clean: bool = True, seed: int = 0,
                    max_iter: int = 100, tol: float = 1e-3, reg_covar: float = 5e-4,
                    covariance_type: str = "full", column_scale=None) -> tuple[np.ndarray, GaussianMixture]:
    """Per-sample posterior of the clean component over min-max normalised values.

    `values` may be 1-D (one feature) or 2-D (n, d); with d > 1 the components are ordered by
    the sum of their mean coordinates. `column_scale` multiplies each normalised column (DiffNCL's
    zeta weighs its second feature). Returns (posteriors of every component ordered clean first,
    the fitted mixture).
    """
    from sklearn.mixture import GaussianMixture

    x = np.asarray(values, dtype=np.float64)
    x = x.reshape(len(x), -1)
    x = np.column_stack([minmax(x[:, j]) for j in range(x.shape[1])])
    if column_scale is not None:
        x = x * np.asarray(column_scale, dtype=np.float64)[None, :]
    gmm = GaussianMixture(n_components=n_components, max_iter=max_iter, tol=tol, reg_covar=reg_covar,
                          covariance_type=covariance_type, random_state=seed)
    gmm.fit(x)
    order = np.argsort(gmm.means_.sum(axis=1))
    if higher_is_clean:
        order = order[::-1]
    return gmm.predict_proba(x)[:, order], gmm


ASHMAN_D_MIN = 2.0  # Ashman's D above 2: the two components are separated (Ashman et al. 1994)
NULL_DISTANCE_MAX = 1.0  # the noisy component's mean within this many null standard deviations of the null mean
CHANCE_Z = 3.0  # the pairs called clean must outnumber the random pairings called clean by this many standard errors


def mixture_separation(mixture: FittedMixture, null_sample=None, sample=None) -> tuple[JsonObject, str | None]:
    """Does the mixture separate noise from clean pairs? (measures, None or why it does not).

    Three checks: Ashman's D = sqrt(2) |mu1 - mu2| / sqrt(var1 + var2) >= 2 (otherwise the data is
    one hump the mixture cut in two); and, when there is a null sample (in-data pairs that do not
    belong together): the noisy component must sit where random pairings sit, its mean within one
    null standard deviation of the null mean (otherwise it split the clean pairs, e.g. when the
    noise is captions of similar items, or when there is hardly any noise); and the mixture must
    call clean more of the scored pairs (`sample`) than of the random pairings, by CHANCE_Z
    standard errors (otherwise the estimator tells a pair from a random pairing no better than
    chance, as a random model on image-label pairs does, where the similarities have modes of
    their own that the mixture splits)."""
    clean = mixture.clean_component
    noisy = 1 - clean
    means, variances = np.asarray(mixture.means), np.asarray(mixture.variances)
    d = float(np.sqrt(2) * abs(means[clean] - means[noisy]) / np.sqrt(variances.sum()))
    measures = {"ashman_d": d, "noisy_mean": float(means[noisy]), "noisy_weight": float(mixture.weights[noisy])}
    null = np.asarray(null_sample if null_sample is not None else [], dtype=np.float64)
    null = null[np.isfinite(null)]
    if len(null) >= 2:
        measures.update(null_mean=float(null.mean()), null_std=float(null.std()))
    if d < ASHMAN_D_MIN:
        return measures, f"the two components overlap (Ashman's D {d:.2f} < {ASHMAN_D_MIN:g})"
    if "null_mean" in measures:
        distance = (measures["noisy_mean"] - measures["null_mean"]) / max(measures["null_std"], 1e-12)
        measures["noisy_vs_null_sd"] = float(distance)
        if abs(distance) > NULL_DISTANCE_MAX:
            return measures, (f"the noisy component (mean {measures['noisy_mean']:.3f}) is {distance:+.1f} null sd from "
                              f"random pairings (mean {measures['null_mean']:.3f}): it split pairs that are not random noise")
        values = np.asarray(sample if sample is not None else [], dtype=np.float64)
        values = values[np.isfinite(values)]
        if len(values):
            data, chance = float((mixture.p_clean(values) >= 0.5).mean()), float((mixture.p_clean(null) >= 0.5).mean())
            error = np.sqrt(data * (1 - data) / len(values) + chance * (1 - chance) / len(null))
            measures.update(clean_share=data, null_clean_share=chance)
            if data - chance <= CHANCE_Z * max(error, 1e-12):
                return measures, (f"at chance: clean {100 * data:.1f}% of pairs vs {100 * chance:.1f}% of random "
                                  "pairings")
    return measures, None
