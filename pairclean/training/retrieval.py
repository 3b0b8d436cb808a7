"""Retrieval evaluation: R@1/5/10 in both directions and rSum, with the multi-caption protocol.

Pairs whose left items have the same content (one image under five captions) form one query
item: left->right (i2t) is a hit at K if ANY of the item's right items is among the top K;
right->left (t2i) is a hit if the item is among the top K. rSum is the sum of the six recalls
(in percent, so 600 is perfect). Similarities are computed in chunks of queries, so memory is
the embeddings plus one chunk x N block; the embeddings of a validation set (1K-25K pairs) stay
in memory by design.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from pairclean.ops.worker_memory import steady_worker_memory
from pairclean.config import COUNT, at_least, declare
from pairclean.errors import UserError
from pairclean.data.dataset import Dataset, as_dataset
from pairclean.data.spec import DatasetSpec, modalities
from pairclean.ops.records import JsonObject

KS = (1, 5, 10)
METRIC_NAMES = tuple(f"{d}_r{k}" for d in ("i2t", "t2i") for k in KS) + ("rsum",)


@dataclass
class RetrievalEmbeddings:
    left: torch.Tensor  # (M, d) one row per distinct left item
    right: torch.Tensor  # (N, d) one row per pair
    owner: torch.Tensor  # (N,) the left item of each right item
    skipped: int = 0  # pairs that could not be read or decoded


@dataclass(frozen=True)
class RetrievalMetrics:
    """R@1/5/10 left->right (i2t: one query per distinct left item) and right->left (t2i: one per
    pair), in %, their sum (rSum, 600 at best), each direction's queries, and the pairs that could
    not be read (`skipped`). As JSON (`to_json`): `evaluate retrieval --json`, and each epoch's
    `val_` entries of metrics.jsonl, in this order."""

    i2t_r1: float
    i2t_r5: float
    i2t_r10: float
    t2i_r1: float
    t2i_r5: float
    t2i_r10: float
    rsum: float
    queries_i2t: int
    queries_t2i: int
    skipped: int = 0

    def to_json(self) -> JsonObject:
        return asdict(self)


def recall_metrics(left: torch.Tensor, right: torch.Tensor, owner: torch.Tensor, chunk: int = 1024) -> RetrievalMetrics:
    """R@K both ways (K in KS) and rSum from L2-normalised embeddings; ranks count strictly better candidates."""
    left, right, owner = left.float(), right.float(), owner.long()
    m, n = left.shape[0], right.shape[0]
    if m == 0 or n == 0:
        raise UserError("no readable pairs to evaluate")
    l2r_rank = torch.empty(m, dtype=torch.long)
    for start in range(0, m, chunk):
        sims = left[start:start + chunk] @ right.T  # (c, N)
        ids = torch.arange(start, min(start + chunk, m))
        own = owner[None, :] == ids[:, None]
        best = sims.masked_fill(~own, float("-inf")).max(dim=1).values
        l2r_rank[start:start + chunk] = (sims > best[:, None]).sum(1)
    r2l_rank = torch.empty(n, dtype=torch.long)
    for start in range(0, n, chunk):
        sims = right[start:start + chunk] @ left.T  # (c, M)
        own = sims.gather(1, owner[start:start + chunk, None])
        r2l_rank[start:start + chunk] = (sims > own).sum(1)
    recalls = {**{f"i2t_r{k}": 100.0 * float((l2r_rank < k).float().mean()) for k in KS},
               **{f"t2i_r{k}": 100.0 * float((r2l_rank < k).float().mean()) for k in KS}}
    return RetrievalMetrics(**recalls, rsum=sum(recalls.values()), queries_i2t=m, queries_t2i=n)


def _select(batch, idx: list[int]):
    if isinstance(batch, torch.Tensor):
        return batch[idx]
    if isinstance(batch, dict):
        return {k: _select(v, idx) for k, v in batch.items()}
    return [batch[i] for i in idx]


@torch.no_grad()
def embed_pairs(target, data: Dataset, batch_size: int = 256, workers: int = 0,
                autocast=None) -> RetrievalEmbeddings:
    """Encode every pair of `data` once, each distinct left item once."""
    from pairclean.training.data import BatchPlan, TrainBatches  # pairclean.train imports this module

    spec = data.spec
    left_mod, right_mod = modalities(spec.pair)
    dataset = TrainBatches(data, target.preparer, batch_size, seed=0, shuffle=False, plan=BatchPlan(left_digest=True))
    workers = min(workers, len(dataset.units))
    loader = DataLoader(dataset, batch_size=None, num_workers=workers, worker_init_fn=steady_worker_memory)
    item_of: dict[str, int] = {}
    lefts, rights, owners, skipped = [], [], [], 0
    was_training = target.module.training
    target.module.eval()
    try:
        for batch in loader:
            skipped += batch["stats"].errors + len(batch["stats"].failures)
            if not batch["key"]:
                continue
            new = []
            for pos, digest in enumerate(batch["left_digest"]):
                if digest not in item_of:
                    item_of[digest] = len(item_of)
                    new.append(pos)
            with autocast or nullcontext():
                if new:
                    lefts.append(target.encode(left_mod, _select(batch["left"], new)).float().cpu())
                rights.append(target.encode(right_mod, batch["right"]).float().cpu())
            owners.extend(item_of[d] for d in batch["left_digest"])
    finally:
        target.module.train(was_training)
    if not rights:
        raise UserError(f"no readable pairs in {', '.join(spec.shards[:3])}")
    return RetrievalEmbeddings(torch.cat(lefts), torch.cat(rights), torch.tensor(owners), skipped)


class JointTarget:
    """Several dual encoders with one preprocessing evaluated as one: the concatenated embeddings
    scaled by 1/sqrt(n) have as inner product the average of the networks' cosine similarities."""

    def __init__(self, targets: list):
        self.targets = targets
        self.preparer, self.device = targets[0].preparer, targets[0].device
        self.module = torch.nn.ModuleList([t.module for t in targets])  # eval()/train() reach every network

    def encode(self, modality: str, batch) -> torch.Tensor:
        if len(self.targets) == 1:
            return self.targets[0].encode(modality, batch)
        return torch.cat([t.encode(modality, batch) for t in self.targets], dim=-1) / len(self.targets) ** 0.5


def evaluate_target(target, data: Dataset, batch_size: int = 256, workers: int = 0,
                    autocast=None) -> RetrievalMetrics:
    emb = embed_pairs(target, data, batch_size, workers, autocast)
    return replace(recall_metrics(emb.left, emb.right, emb.owner), skipped=emb.skipped)


def load_trained(model: str | Path, arch: str | None = None, device: str = "auto"):
    """A model to evaluate: a `pairclean train` run directory or checkpoint, a sentence-transformers
    directory or bundled name, or (with `arch`) an open_clip checkpoint path or pretrained tag."""
    from pairclean.backends import detect_backend, load_exported, load_target
    from pairclean.training.checkpoint import extra_network_files, resolve_trained_model

    path = Path(model)
    if arch is not None:
        target = load_target(arch, pretrained=str(model), backend="open_clip", device=device)
    elif not path.exists() and detect_backend(str(model)) == "sentence-transformers":  # e.g. all-MiniLM-L6-v2, untrained
        target = load_target(str(model), backend="sentence-transformers", device=device)
    else:
        desc, weights = resolve_trained_model(path)
        target = load_exported(desc, weights, device=device)
        peers = [load_exported(desc, extra, device=device) for extra in extra_network_files(weights)]
        if peers:  # a run that trained several networks is evaluated with their averaged similarity
            target = JointTarget([target, *peers])
    target.module.eval()
    return target


@declare(batch_size=COUNT, workers=at_least(0))
def evaluate_retrieval(model: str | Path, data: str | list[str] | DatasetSpec | Dataset, arch: str | None = None,
                       pair: str | None = None, batch_size: int = 256, workers: int = 0,
                       device: str = "auto") -> RetrievalMetrics:
    """`pairclean evaluate retrieval`: load a trained model and score retrieval on `data`."""
    dataset = as_dataset(data, pair=pair)
    target = load_trained(model, arch=arch, device=device)
    return evaluate_target(target, dataset, batch_size=batch_size, workers=workers)
