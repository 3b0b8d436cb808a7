"""The weighted symmetric InfoNCE: plain case = CLIP's loss, weights act per pair, gathered columns."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pairclean.training.loss import infonce_terms, weighted_infonce
from pairclean.training.trainer import cosine_lr


def _embeddings(n=6, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (F.normalize(torch.randn(n, d, generator=g), dim=-1), F.normalize(torch.randn(n, d, generator=g), dim=-1))


def test_plain_loss_is_twice_open_clip_loss():
    from open_clip.loss import ClipLoss

    u, v = _embeddings()
    scale = torch.tensor(14.0)
    loss, per_pair = weighted_infonce(u, v, scale)
    reference = ClipLoss()(u, v, scale)  # mean of the two directions' batch-mean CE
    assert torch.allclose(loss, 2 * reference, atol=1e-5)
    assert per_pair.shape == (6,)


def test_weights_multiply_each_pairs_terms():
    u, v = _embeddings()
    scale = 10.0
    _, per_pair = weighted_infonce(u, v, scale)
    w = torch.tensor([1.0, 0.5, 0.0, 0.0, 2.0, 1.0])
    loss, _ = weighted_infonce(u, v, scale, w)
    assert math.isclose(float(loss), float((w * per_pair).sum() / 6), rel_tol=1e-6)
    loss_ws, _ = weighted_infonce(u, v, scale, w, reduction="weight-sum")
    assert math.isclose(float(loss_ws), float((w * per_pair).sum() / w.sum()), rel_tol=1e-6)


def test_zero_weight_pair_stays_a_negative_but_gets_no_positive_pull():
    u, v = _embeddings(4)
    u.requires_grad_(True)
    v.requires_grad_(True)
    w = torch.tensor([1.0, 1.0, 1.0, 0.0])
    loss, _ = weighted_infonce(u, v, 10.0, w)
    loss.backward()
    # Pair 3's own terms are weighted out, but its left and right items still receive gradient as negatives.
    assert float(u.grad[3].norm()) > 0 and float(v.grad[3].norm()) > 0
    u2, v2 = _embeddings(4)
    terms = infonce_terms(u2, v2, 10.0)
    manual = (terms.per_sample[:3]).sum() / 4
    assert torch.allclose(loss.detach(), manual, atol=1e-6)


def test_weights_get_no_gradient():
    u, v = _embeddings()
    w = torch.rand(6, requires_grad=True)
    loss, _ = weighted_infonce(u.requires_grad_(True), v, 10.0, w)
    loss.backward()
    assert w.grad is None and u.grad is not None


def test_gathered_columns_give_the_local_rows_of_the_full_batch():
    u, v = _embeddings(8)
    full = infonce_terms(u, v, 12.0)
    local = infonce_terms(u[4:], v[4:], 12.0, all_left=u, all_right=v, offset=4)
    assert torch.allclose(local.left_to_right, full.left_to_right[4:], atol=1e-6)
    assert torch.allclose(local.right_to_left, full.right_to_left[4:], atol=1e-6)


def test_unknown_reduction_is_refused():
    u, v = _embeddings()
    with pytest.raises(ValueError):
        weighted_infonce(u, v, 1.0, torch.ones(6), reduction="sum")


def test_schedule_warms_up_then_decays_to_the_floor():
    values = [cosine_lr(s, warmup=4, total=20, min_ratio=0.1) for s in range(25)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert values[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[4:], values[5:]))
    assert values[20] == pytest.approx(0.1) and values[24] == pytest.approx(0.1)
