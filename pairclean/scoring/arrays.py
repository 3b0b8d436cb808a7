"""Scoring embeddings held in memory: two arrays in, the scores file's per-pair columns out.

The cleanlab habit (`find_label_issues(labels, pred_probs)`): no files, no run to resume. The
rows take the steps `score --from-embeddings` takes on the same vectors saved as two .npy files:
units and batches of the same sizes (`EmbeddingScoreConfig`), the cosine of each batch and the
null pairs of each unit (`scoring.embeddings.score_unit`), the part's columns (`scoring.parts.part_table`),
the samples the rules are fitted on and the per-pair columns (`scoring.finalize`). So for the
same beta both give the same `sim`, `weight` and rule columns.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import torch

from pairclean import __version__
from pairclean.core.beta import BETA_GIVEN, BetaEstimate, shuffled_beta
from pairclean.data.embeddings import ArrayRows, EmbeddingBatch
from pairclean.errors import ConfigError
from pairclean.scorefile.contract import Provenance, Summary, flagged_summary, provenance_metadata, summary_metadata
from pairclean.scorefile.rules import DEFAULT_RULES, build_rules
from pairclean.scoring.embeddings import EmbeddingScoreConfig, score_unit
from pairclean.scoring.finalize import PairColumns, null_quantiles, random_pairing_share, similarity_samples
from pairclean.scoring.parts import part_table

FLOATS = (np.float16, np.float32, np.float64)  # what the scorer's float32 arithmetic takes as it is stored
SHUFFLED = "mean cosine of shuffled pairs of the arrays (a diagnostic: it sits inside the noisy distribution)"


def _rows(array, field: str) -> np.ndarray:
    """An N x D float array from numpy or torch (a tensor is detached and copied to the host;
    bfloat16, which numpy lacks, becomes float32); anything else is refused naming `field`."""
    if isinstance(array, torch.Tensor):
        tensor = array.detach().cpu()
        array = (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
    array = np.asarray(array)
    if array.ndim != 2 or 0 in array.shape:
        raise ConfigError(f"`{field}` must be an N x D array, one row per pair (got shape {array.shape})", field)
    if array.dtype.type not in FLOATS:
        raise ConfigError(f"`{field}` must hold float16, float32 or float64 values (got {array.dtype})", field)
    return array


def score_embeddings(left, right, *, beta: float | None = None, weight_fn: str = "cubic",
                     rules: Sequence[str] = DEFAULT_RULES, seed: int = 0, keys: Sequence[str] | None = None,
                     gmm_sample: int = EmbeddingScoreConfig.gmm_sample) -> pa.Table:
    """Score the pairs (left[i], right[i]) of two N x D arrays (numpy or torch; they need not be
    normalised) and return one row per pair: `key`, `index`, `sim`, `sim_debiased`, `weight`,
    `weight_norm`, each rule's columns, `error` (a zero or non-finite vector: NULL similarity,
    weight 0, the reason here). `beta`: the cone bias (a run's `provenance.beta`, or your own);
    None takes the mean cosine of shuffled pairs of these arrays (the `shuffled` beta mode).
    `keys`: one per row (default: the row number). The table's metadata holds the provenance and
    summary (`read_provenance(table)`, `read_summary(table)`)."""
    cfg = EmbeddingScoreConfig(beta_mode="shuffled" if beta is None else "fixed", beta=beta, weight_fn=weight_fn,
                               seed=seed, rules=tuple(rules), gmm_sample=gmm_sample)
    left, right = _rows(left, "left"), _rows(right, "right")
    if left.shape != right.shape:
        raise ConfigError(f"`left` and `right` must have the same shape (got {left.shape} and {right.shape})",
                          "left", "right")
    n = len(left)
    if keys is not None and len(keys) != n:
        raise ConfigError(f"`keys` holds {len(keys)} keys for {n} rows", "keys")
    parts, states = [], []
    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)  # as the embeddings producer scores: the shuffled sums add up in its order
    try:
        for start in range(0, n, cfg.unit_rows):  # units and batches as the numpy layout cuts them
            stop = min(start + cfg.unit_rows, n)
            batches = (EmbeddingBatch("", np.arange(a, min(a + cfg.batch_rows, stop), dtype=np.int64), None,
                                      ArrayRows(left[a:a + cfg.batch_rows], right[a:a + cfg.batch_rows]))
                       for a in range(start, stop, cfg.batch_rows))
            columns, record = score_unit(batches, None, shuffled=beta is None)
            if record["failure"]:  # arrays in memory do not break as files do: a failure here is a bug
                raise RuntimeError(f"scoring rows {start}-{stop} failed: {record['failure']}")
            states.append(record["shuffled"])
            parts.append(part_table({**columns, "shard": pa.nulls(len(columns["index"]), pa.string()),
                                     "key": pa.array(list(keys[start:stop]) if keys is not None
                                                     else [str(i) for i in range(start, stop)], pa.string())}))
    finally:
        torch.set_num_threads(intra_op)
    part = pa.concat_tables([p.table for p in parts])
    errors, n_null = sum(p.errors for p in parts), sum(p.null_rows for p in parts)
    if beta is None:
        estimate, source = shuffled_beta(states), SHUFFLED
    else:
        estimate, source = BetaEstimate("fixed", cfg.beta, None, None), BETA_GIVEN
    deciders = build_rules(cfg.rules)
    sample, null_sample, max_sim = similarity_samples(part.select(["sim", "null_sim"]).to_batches(), n - errors,
                                                      n_null, cfg.gmm_sample, cfg.seed)
    scorer = PairColumns.fit(deciders, sample, null_sample, max_sim, estimate.beta, cfg.weight_fn, cfg.seed)
    sim = part.column("sim").to_numpy().astype(np.float64)  # nulls -> NaN
    derived = scorer.table(sim)
    records = [rule.record() for rule in deciders]
    provenance = Provenance(
        estimator={"backend": "arrays", "embedding_dim": int(left.shape[1]), "dtype": [str(left.dtype)]},
        seed=cfg.seed, pairclean_version=__version__, beta=estimate.beta, beta_std=estimate.std, beta_k=estimate.k,
        beta_mode=estimate.mode, beta_source=source, weight_fn=cfg.weight_fn, official_scale=scorer.official_scale,
        **{key: value for rule in deciders for key, value in rule.provenance().items()},
        gmm_sample=len(sample), null_sample=len(null_sample), null_quantiles=null_quantiles(null_sample),
        rules=records)
    summary = Summary(pairs=n, scored=n - errors, errors=errors, units=len(parts), beta=estimate.beta,
                      beta_std=estimate.std, beta_k=estimate.k, beta_mode=estimate.mode, beta_source=source,
                      **random_pairing_share(sample, null_sample),
                      **flagged_summary(records, {rule.name: count for rule, count in
                                                  zip(deciders, scorer.flagged(derived))}, n - errors))
    table = pa.table({"key": part.column("key"), "index": part.column("index"), "sim": part.column("sim"),
                      **dict(zip(derived.column_names, derived.columns)), "error": part.column("error")})
    return table.replace_schema_metadata({**provenance_metadata(provenance), **summary_metadata(summary)})
