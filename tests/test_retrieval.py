"""R@K / rSum with the multi-caption protocol, on hand-built embeddings with known ranks."""

from __future__ import annotations

import pytest
import torch

from pairclean.errors import UserError
from pairclean.training.retrieval import recall_metrics


def _unit(*rows):
    return torch.nn.functional.normalize(torch.tensor(rows, dtype=torch.float32), dim=-1)


def test_perfect_embeddings_score_600():
    eye = torch.eye(4)
    m = recall_metrics(eye, eye, torch.arange(4))
    assert m.rsum == pytest.approx(600.0)
    assert m.queries_i2t == 4 and m.queries_t2i == 4


def test_image_hits_if_any_of_its_captions_is_retrieved():
    # Two images; image 0 owns captions 0 and 1, image 1 owns captions 2 and 3.
    images = _unit([1, 0, 0], [0, 1, 0])
    captions = _unit([0.2, 1, 0],    # caption 0 (image 0) looks like image 1
                     [1, 0.1, 0],    # caption 1 (image 0) is image 0's best match
                     [0, 1, 0.1],    # caption 2 (image 1)
                     [1, 0.3, 0.2])  # caption 3 (image 1) looks like image 0
    owner = torch.tensor([0, 0, 1, 1])
    m = recall_metrics(images, captions, owner)
    # i2t: image 0's top caption is caption 1 (its own) -> hit; image 1's top is caption 0 or 2:
    # sims of image 1: c0=0.98, c1=0.0995, c2=0.995, c3=0.28 -> caption 2 (own) is first -> hit.
    assert m.i2t_r1 == pytest.approx(100.0)
    # t2i: caption 0 -> image 1 (miss), caption 1 -> image 0 (hit), caption 2 -> image 1 (hit), caption 3 -> image 0 (miss).
    assert m.t2i_r1 == pytest.approx(50.0)
    assert m.t2i_r5 == pytest.approx(100.0)  # with two images everything is within the top 5
    assert m.rsum == pytest.approx(100 + 100 + 100 + 50 + 100 + 100)


def test_without_grouping_each_caption_would_be_its_own_query():
    images = _unit([1, 0], [0, 1])
    captions = _unit([0, 1], [1, 0])  # both captions describe the other image
    m = recall_metrics(images, captions, torch.tensor([0, 1]))
    assert m.i2t_r1 == 0.0 and m.t2i_r1 == 0.0


def test_chunking_does_not_change_the_result():
    g = torch.Generator().manual_seed(3)
    left = torch.nn.functional.normalize(torch.randn(50, 16, generator=g), dim=-1)
    owner = torch.randint(0, 50, (120,), generator=g)
    right = torch.nn.functional.normalize(left[owner] + 0.8 * torch.randn(120, 16, generator=g), dim=-1)
    assert recall_metrics(left, right, owner, chunk=7) == recall_metrics(left, right, owner, chunk=1000)


def test_empty_input_is_a_user_error():
    with pytest.raises(UserError):
        recall_metrics(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
