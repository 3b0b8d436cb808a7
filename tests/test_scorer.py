"""The scoring functions against the OSA paper's formulas (Eq. 3-5, Appendix F.1, official code)."""

import math

import numpy as np
import pytest
import torch

from pairclean.core.scorer import (CUBIC_PEAK, beta_noisy, cone_weight, cosine_similarity, debias,
                              normalised_weight)


def test_cosine_is_eq3_on_unnormalised_inputs():
    a = np.array([[3.0, 4.0], [1.0, 0.0]])
    b = np.array([[6.0, 8.0], [0.0, 2.0]])
    np.testing.assert_allclose(cosine_similarity(a, b), [1.0, 0.0])


def test_debias_moves_origin_to_cone_centre():
    np.testing.assert_allclose(debias(np.array([0.3, 0.1]), 0.2), [0.1, -0.1])


@pytest.mark.parametrize("s", [-0.5, -1e-9, 0.0])
def test_cubic_is_zero_outside_the_boundary(s):
    assert cone_weight(np.array([s]), "cubic")[0] == 0.0


def test_cubic_matches_eq5_and_peaks_at_two_thirds():
    s = np.array([0.1, 0.5, 2 / 3, 0.9])
    np.testing.assert_allclose(cone_weight(s, "cubic"), s**2 * (1 - s))
    grid = np.linspace(0, 1, 10001)
    w = cone_weight(grid, "cubic")
    assert abs(grid[w.argmax()] - 2 / 3) < 1e-3
    assert abs(w.max() - 4 / 27) < 1e-8
    np.testing.assert_allclose(normalised_weight(np.array([CUBIC_PEAK]), "cubic"), [1.0])


def test_linear_and_cosine_variants_of_appendix_f1():
    s = np.array([-0.2, 0.25, 0.5, 1.0])
    np.testing.assert_allclose(cone_weight(s, "linear"), [0.0, 0.25, 0.5, 1.0])
    expected = [0.0] + [(math.cos(math.pi * (x - 1)) + 1) / 2 for x in s[1:]]
    np.testing.assert_allclose(cone_weight(s, "cosine"), expected)
    np.testing.assert_allclose(normalised_weight(cone_weight(s, "linear"), "linear", beta=0.2), [0, 0.3125, 0.625, 1.0])


def test_official_normalises_by_the_maximum_then_x2_one_minus_x2():
    s = np.array([-0.1, 0.2, 0.4])
    x = np.array([0.0, 0.5, 1.0])
    np.testing.assert_allclose(cone_weight(s, "official"), x**2 * (1 - x**2))
    np.testing.assert_allclose(cone_weight(s, "official", scale=0.8), (s.clip(0) / 0.8) ** 2 * (1 - (s.clip(0) / 0.8) ** 2))
    np.testing.assert_allclose(normalised_weight(np.array([0.25]), "official"), [1.0])


def test_torch_in_torch_out_with_gradients_untouched():
    s = torch.tensor([0.1, -0.3, 0.5], dtype=torch.float32)
    w = cone_weight(s, "cubic")
    assert isinstance(w, torch.Tensor) and w.dtype == torch.float32
    np.testing.assert_allclose(w.numpy(), cone_weight(s.double().numpy(), "cubic"), rtol=1e-6)


def test_beta_decision_is_s_tilde_le_zero():
    assert beta_noisy(np.array([-0.1, 0.0, 0.1])).tolist() == [True, True, False]


def test_unknown_weight_function_is_rejected():
    with pytest.raises(ValueError, match="unknown weight function"):
        cone_weight(np.array([0.1]), "quartic")
