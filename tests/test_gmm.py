import numpy as np
from sklearn.mixture import GaussianMixture

from pairclean.core.mixture import clean_posterior, fit_similarity_mixture


def test_closed_form_posterior_equals_sklearn_and_clean_is_higher_mean():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0.05, 0.03, 500), rng.normal(0.3, 0.05, 500)])
    mix = fit_similarity_mixture(x, seed=0)
    assert mix.means[mix.clean_component] > mix.means[1 - mix.clean_component]
    reference = GaussianMixture(2, random_state=0, reg_covar=1e-6, tol=1e-3).fit(x.reshape(-1, 1))
    clean = int(np.argmax(reference.means_.ravel()))
    np.testing.assert_allclose(mix.p_clean(x), reference.predict_proba(x.reshape(-1, 1))[:, clean], atol=1e-6)
    assert mix.p_clean(np.array([0.35]))[0] > 0.99 and mix.p_clean(np.array([0.0]))[0] < 0.01


def test_clean_posterior_orders_components_and_minmax_normalises():
    rng = np.random.default_rng(1)
    losses = np.concatenate([rng.normal(10, 1, 300), rng.normal(50, 2, 100)])
    post, _ = clean_posterior(losses, higher_is_clean=False)
    assert post.shape == (400, 2)
    assert post[:300, 0].mean() > 0.95 and post[300:, 0].mean() < 0.05
