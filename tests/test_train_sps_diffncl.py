"""SPS and DiffNCL (pairclean.training.methods.sps, pairclean.training.methods.diffncl): their equations on tiny
hand-checkable tensors, then real runs on real shards: exact resume of every piece of method state,
and the per-epoch pair tables joined with `pairclean corrupt`'s truth in one DuckDB query."""

from __future__ import annotations

import json
import math

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pairclean.errors import UserError
from pairclean.calibrate.corrupt import corrupt
from pairclean.training import TrainConfig, build_method, train
from pairclean.training import trainer as trainer_module
from pairclean.training.checkpoint import load_state
from pairclean.training.methods.diffncl import (CLEAN, NOISY, WEAK, Denoiser, consensus, cross_consistency,
                                     diffusion_discrepancy, dynamic_zeta, forward_diffusion, noise_schedules,
                                     step_weights, three_way_labels)
from pairclean.training.methods.sps import (NOISY as SPS_NOISY, QUASI_CLEAN, RELIABLE, cross_constraint, match_probability,
                                 metric_constraint, nearest_proxies, proxy_label, soft_label, three_way_partition)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------- DiffNCL equations

def test_schedules_and_step_weights_by_hand():
    alpha, beta = noise_schedules(4)
    c = [math.cos(math.pi * t / 8) for t in (1, 2, 3, 4)]
    assert alpha.tolist() == pytest.approx([x ** 2 for x in c]) and beta.tolist() == pytest.approx([x ** 3 for x in c])
    assert alpha[-1] == pytest.approx(0.0, abs=1e-12)
    # cos^3 <= cos^2: the text keeps LESS signal per step, although the paper says the cube noises it more slowly
    assert (beta <= alpha).all()
    gamma = step_weights(alpha, beta)
    raw = [(1 - a) * (1 - b) for a, b in zip(alpha.tolist(), beta.tolist())]
    assert gamma.tolist() == pytest.approx([r / sum(raw) for r in raw]) and float(gamma.sum()) == pytest.approx(1.0)
    assert torch.all(gamma[1:] > gamma[:-1])  # later steps weigh more


def test_one_step_discrepancy_is_the_squared_cosine_gap():
    # T = 1: alpha_1 = beta_1 = 0, so both sides become the shared draw (cosine 1): Psi = (1 - s_0)^2.
    e = torch.eye(3)
    f = torch.stack([e[0], e[0], e[0]])
    g = torch.stack([e[0], e[1], -e[0]])
    psi = diffusion_discrepancy(f, g, steps=1, generator=torch.Generator().manual_seed(0))
    assert psi.tolist() == pytest.approx([0.0, 1.0, 4.0], abs=1e-6)


def test_forward_diffusion_scales_by_sqrt_d_and_shares_the_noise():
    f, g = torch.eye(4)[:1], torch.eye(4)[1:2]
    fs, gs = forward_diffusion(f, g, steps=2, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(fs[0], 2 * f) and len(fs) == len(gs) == 3
    assert torch.allclose(fs[-1], gs[-1])  # step T: signal gone on both sides, the same draw left


def test_shared_noise_gives_a_clean_pair_a_smaller_psi_than_a_mismatched_one():
    e = torch.eye(64)
    f, clean, mismatched = e[0].expand(500, 64), e[0].expand(500, 64), e[1].expand(500, 64)
    psi = {shared: (diffusion_discrepancy(f, clean, 4, shared, torch.Generator().manual_seed(0)).mean(),
                    diffusion_discrepancy(f, mismatched, 4, shared, torch.Generator().manual_seed(0)).mean())
           for shared in (True, False)}
    assert psi[True][0] < psi[True][1]  # the paper's ordering
    assert psi[False][0] > psi[False][1]  # independent draws reverse it (why shared is the default)


def test_consensus_of_two_networks():
    a = np.array([CLEAN, CLEAN, NOISY, NOISY, WEAK, CLEAN])
    b = np.array([CLEAN, WEAK, NOISY, CLEAN, WEAK, NOISY])
    assert consensus(a, b).tolist() == [CLEAN, WEAK, NOISY, WEAK, WEAK, WEAK]


def test_three_way_labels_order_components_by_their_means():
    rng = np.random.default_rng(0)
    centres = {CLEAN: (1.0, 0.1), WEAK: (5.0, 0.5), NOISY: (9.0, 0.9)}
    truth = np.repeat([NOISY, CLEAN, WEAK], 60)
    points = np.array([centres[k] for k in truth]) + rng.normal(0, [0.3, 0.02], size=(len(truth), 2))
    labels, post = three_way_labels(points[:, 0], points[:, 1], zeta=0.5)
    assert labels.tolist() == truth.tolist()
    assert post.shape == (180, 3) and np.allclose(post.sum(1), 1.0)
    assert dynamic_zeta([np.zeros(4), np.zeros(2)]) == pytest.approx(0.5)  # sigmoid(0)


def test_denoiser_shares_its_weights_across_steps_and_cross_loss_by_hand():
    torch.manual_seed(0)
    den = Denoiser(dim=8, hidden=4)
    params = sum(p.numel() for p in den.parameters())
    f, g = torch.randn(3, 8), torch.randn(3, 8)
    one, four = den(f, g, f, g, steps=1), den(f, g, f, g, steps=4)
    assert one[0].shape == four[0].shape == (3, 8) and not torch.allclose(one[0], four[0])
    assert params == sum(p.numel() for p in den.parameters())  # no per-step weights
    u = torch.nn.functional.normalize(torch.randn(1, 4), dim=-1)
    v, uh, vh = (torch.nn.functional.normalize(torch.randn(1, 4), dim=-1) for _ in range(3))
    expected = math.log(math.exp(float(uh @ v.T)) + math.exp(float(vh @ u.T))) - float(uh @ vh.T)
    assert float(cross_consistency(uh, vh, u, v, 1.0, form="as-written")) == pytest.approx(expected, abs=1e-5)


def test_cross_loss_as_written_pushes_the_pairs_own_originals_apart_and_detached_leaves_them_alone():
    f = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1).requires_grad_()
    g = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1).requires_grad_()
    f_hat, g_hat = f.detach() * 0.9 + 0.1, g.detach() * 0.9 + 0.1  # the denoised pair, near its originals
    as_written = cross_consistency(f_hat, g_hat, f, g, 10.0, form="as-written")
    as_written.backward()
    # descent moves g_i along -grad: away from f_hat_i (the pair's own denoised image sits in the denominator)
    assert float((-g.grad * f_hat).sum(-1).min()) < 0
    f.grad = g.grad = None
    detached = cross_consistency(f_hat, g_hat, f, g, 10.0, detach_originals=True, form="as-written")
    assert float(detached.detach()) == pytest.approx(float(as_written.detach())) and not detached.requires_grad


def test_cross_loss_per_the_prose_by_hand_leaves_out_the_pairs_own_originals():
    # two pairs, scale 1: row i's softmax holds the positive <f_hat_i, g_hat_i> and the OTHER pair's originals
    f, g = torch.eye(3)[:2], torch.eye(3)[1:]
    f_hat, g_hat = torch.eye(3)[[2, 0]], torch.eye(3)[[2, 1]]
    logits = [[1.0, float(f_hat[0] @ g[1]), float(g_hat[0] @ f[1])], [float(f_hat[1] @ g_hat[1]), float(f_hat[1] @ g[0]),
                                                                       float(g_hat[1] @ f[0])]]
    expected = sum(math.log(sum(math.exp(x) for x in row)) - row[0] for row in logits) / 2
    assert float(cross_consistency(f_hat, g_hat, f, g, 1.0)) == pytest.approx(expected, abs=1e-6)
    # a pair's own originals move nothing: the loss is the same whatever they are
    moved_f, moved_g = f.clone(), g.clone()
    moved_f[0], moved_g[0] = -f[0], torch.tensor([0.6, 0.8, 0.0])
    assert float(cross_consistency(f_hat[:1], g_hat[:1], moved_f[:1], moved_g[:1], 1.0)) == pytest.approx(0.0)
    # gradient: descent pulls the denoised pair together (never pushes its own originals away: they get none)
    f_var = f.clone().requires_grad_()
    g_var = g.clone().requires_grad_()
    fh, gh = f_hat.clone().requires_grad_(), g_hat.clone().requires_grad_()
    cross_consistency(fh, gh, f_var, g_var, 5.0).backward()
    assert float((-fh.grad * gh.detach()).sum()) > 0
    assert float((g_var.grad[0] * fh.detach()[0]).abs().sum()) == 0.0  # g_0 sits only in row 1's denominator


def test_dynamic_zeta_on_the_normalised_loss_does_not_depend_on_its_scale():
    loss = np.array([1.0, 2.0, 4.0, 9.0])
    assert dynamic_zeta([loss], normalised=True) == pytest.approx(dynamic_zeta([loss * 50], normalised=True))
    raw = dynamic_zeta([loss * 50])
    assert raw < 1e-3 < dynamic_zeta([loss * 50], normalised=True)  # the paper's form shrinks with the scale


def test_three_way_labels_ordered_by_loss_when_psi_runs_the_other_way():
    rng = np.random.default_rng(0)
    # independent noise: Psi grows with a pair's similarity, so clean pairs (low loss) have the HIGHEST Psi
    centres = {CLEAN: (1.0, 0.9), WEAK: (5.0, 0.5), NOISY: (9.0, 0.1)}
    truth = np.repeat([NOISY, CLEAN, WEAK], 60)
    points = np.array([centres[k] for k in truth]) + rng.normal(0, [0.3, 0.02], size=(len(truth), 2))
    labels, _ = three_way_labels(points[:, 0], points[:, 1], zeta=1.0, order_by="loss")
    assert (labels == truth).mean() > 0.95


def test_partial_forward_diffusion_keeps_signal_for_the_denoiser():
    f, g = torch.eye(64)[:1].expand(200, 64), torch.eye(64)[1:2].expand(200, 64)
    full, _ = forward_diffusion(f, g, 4, shared_noise=False, generator=torch.Generator().manual_seed(0))
    part, _ = forward_diffusion(f, g, 3, shared_noise=False, generator=torch.Generator().manual_seed(0), total=4)
    signal = lambda x: float((x[:, 0] / 8).mean())  # noqa: E731  the component along f, on the unit scale
    assert abs(signal(full[-1])) < 0.05  # step T of 4: alpha_T = 0, nothing of f is left
    alpha, _ = noise_schedules(4)
    assert signal(part[-1]) == pytest.approx(float(alpha[:3].prod().sqrt()), abs=0.05)  # step 3: sqrt(prod alpha)


# ---------------------------------------------------------------- SPS equations

def test_stable_space_constraints_by_hand():
    u = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    v = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    # S = U V^T = [[1, 1], [0, 0]]: (S - S^T)^2 = [[0, 1], [1, 0]]
    assert float(cross_constraint(u, v)) == pytest.approx(0.5)
    assert float(cross_constraint(u, v, alpha=0.6)) == pytest.approx(0.2)
    assert float(cross_constraint(u, v, scale=2.0)) == pytest.approx(2.0)  # on the logits: (2 * 1)^2 / 2
    # U U^T = I, V V^T = all ones: squared gaps [[0, 1], [1, 0]]
    assert float(metric_constraint(u, v)) == pytest.approx(0.5)
    assert float(metric_constraint(u, u)) == 0.0


def test_soft_label_proxy_search_and_proxy_label():
    assert float(soft_label(torch.tensor(0.5), torch.tensor(0.2))) == pytest.approx(0.6)
    noisy = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    reliable = torch.tensor([[0.0, 1.0], [0.8, 0.6], [1.0, 0.0]])
    position, cos = nearest_proxies(noisy, reliable)
    assert position.tolist() == [2, 1] and cos.tolist() == pytest.approx([1.0, 0.96])
    y = proxy_label(torch.tensor([0.9, 0.6]), torch.tensor([0.9, 0.5]))
    assert y.tolist() == pytest.approx([0.81, 0.0])  # 0.3 is below 0.5: zeroed
    paper = proxy_label(torch.tensor([0.9]), torch.tensor([0.5]), form="paper", gamma=1.0, beta=2.0)
    assert float(paper) == pytest.approx(1 / (1 + math.exp(-1.0)))
    # y_hat of a perfectly aligned batch at a sharp temperature is ~1 for every pair
    e = torch.eye(3)
    assert match_probability(e, e, 100.0).tolist() == pytest.approx([1.0, 1.0, 1.0], abs=1e-6)


def test_three_way_partition_and_the_percentile_rule():
    p = np.array([0.995, 0.7, 0.3, 0.5])
    assert three_way_partition(p, 0.99, 0.5).tolist() == [RELIABLE, QUASI_CLEAN, SPS_NOISY, SPS_NOISY]
    high = np.linspace(0.6, 1.0, 101)  # every p above eps2: the 1st percentile becomes the noisy bound
    part = three_way_partition(high, 0.99, 0.5)
    assert part[:2].tolist() == [SPS_NOISY, SPS_NOISY] and part[2] == QUASI_CLEAN and part[-1] == RELIABLE


@pytest.mark.parametrize("name, options, message", [
    ("sps", {"warmup_epochs": "3", "e_qc": "2"}, "warmup_epochs < e_qc"),
    ("sps", {"eps1": "0.4"}, "eps2 <= eps1"),
    ("sps", {"proxy_label": "soft"}, "proxy_label"),
    ("diffncl", {"steps": "0"}, "steps must be at least 1"),  # declared once (config.setting), issue 25
    ("diffncl", {"zeta": "-1"}, "zeta must be above 0"),
    ("diffncl", {"cross_weight": "-0.5"}, "cross_weight must be at least 0"),
    ("diffncl", {"weak_loop": "twice"}, "weak_loop"),
    ("sps", {"epoch": "clean"}, "epoch"),
])
def test_bad_options_are_user_errors(name, options, message):
    with pytest.raises(UserError, match=message):
        build_method(name, options)


# ---------------------------------------------------------------- real runs

SHORT = {"sps": {"warmup_epochs": 1, "e_qc": 2, "e_n": 2, "eps1": 0.6}, "diffncl": {"warmup_epochs": 1}}


def _config(method: str, **overrides) -> TrainConfig:
    base = dict(model="pairclean-tiny", pretrained="none", epochs=3, batch_size=8, lr=1e-3, warmup_steps=1,
                workers=0, shuffle_buffer=8, log_every=1, method=method, method_options=SHORT[method])
    return TrainConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def mixed_noise(tmp_path_factory, coco_shards):
    """coco-mini with 25% shuffled and 25% weakened captions, and its truth."""
    return corrupt(str(coco_shards), tmp_path_factory.mktemp("mixed") / "noisy", 0.25, seed=0, mode="mixed",
                   weak_ratio=0.25)


@pytest.mark.parametrize("method", ["sps", "diffncl"])
def test_resumed_run_restores_both_networks_optimisers_and_denoisers(method, tmp_path, mixed_noise, monkeypatch):
    data = str(mixed_noise.manifest)
    straight = train(data, tmp_path / "straight", _config(method))
    real_save, saves = trainer_module.save_state, []

    def killed_after_second_epoch(run_dir, state):
        real_save(run_dir, state)
        saves.append(state["epoch"])
        if state["epoch"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(trainer_module, "save_state", killed_after_second_epoch)
    with pytest.raises(KeyboardInterrupt):
        train(data, tmp_path / "killed", _config(method))
    monkeypatch.setattr(trainer_module, "save_state", real_save)
    resumed = train(data, tmp_path / "killed", _config(method, resume=True))
    assert saves == [1, 2] and resumed.resumed_from == 2
    for name in ("model-epoch-003.pt", "model-epoch-003-peer.pt"):
        a = torch.load(tmp_path / "straight" / name, weights_only=True)
        b = torch.load(tmp_path / "killed" / name, weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    state_a, state_b = load_state(tmp_path / "straight")["method"], load_state(tmp_path / "killed")["method"]

    def tensors(tree, prefix=""):
        if isinstance(tree, torch.Tensor):
            yield prefix, tree
        elif isinstance(tree, dict):
            for k, v in tree.items():
                yield from tensors(v, f"{prefix}/{k}")
        elif isinstance(tree, (list, tuple)):
            for i, v in enumerate(tree):
                yield from tensors(v, f"{prefix}/{i}")

    a, b = dict(tensors(state_a)), dict(tensors(state_b))
    assert a.keys() == b.keys() and len(a) > 10
    assert all(torch.equal(a[k], b[k]) for k in a)  # peer weights and optimiser, denoisers and theirs
    assert [r["train_loss"] for r in straight.epochs] == [r["train_loss"] for r in resumed.epochs]
    pairs = pq.read_table(tmp_path / "killed" / "diagnostics" / "pairs-epoch-003.parquet").to_pylist()
    reference = pq.read_table(tmp_path / "straight" / "diagnostics" / "pairs-epoch-003.parquet").to_pylist()
    assert pairs == reference


@pytest.mark.parametrize("method, columns", [
    ("sps", ["p", "p_peer", "partition", "partition_peer", "y_qc", "y_proxy", "proxy_shard", "proxy_index"]),
    ("diffncl", ["partition", "loss", "psi", "label", "p_clean", "p_weak", "p_noisy", "psi_peer", "label_peer", "zeta"]),
])
def test_pair_tables_join_the_corrupt_truth_in_one_query(method, columns, tmp_path, mixed_noise):
    run = tmp_path / "run"
    result = train(str(mixed_noise.manifest), run, _config(method, epochs=2))
    assert result.epochs[0].get(f"{method}_noisy") is None  # warm-up epoch: no partition yet
    table = run / "diagnostics" / "pairs-epoch-002.parquet"
    names = pq.read_schema(table).names
    assert set(columns) <= set(names) and names[:3] == ["shard", "index", "epoch"]
    rows = duckdb.execute(f"""SELECT t.noise, d.partition, count(*) FROM '{table}' d
                              JOIN '{mixed_noise.truth}' t USING (shard, "index") GROUP BY ALL""").fetchall()
    assert sum(n for _, _, n in rows) == 16  # every pair, each once
    assert {kind for kind, _, _ in rows} <= {"clean", "weak", "shuffle"}
    expected = {"sps": {"reliable", "quasi_clean", "noisy"}, "diffncl": {"clean", "weak", "noisy"}}[method]
    assert {part for _, part, _ in rows} <= expected
    assert result.epochs[1][f"{method}_noisy"] == sum(n for _, part, n in rows if part == "noisy")
    if method == "sps":  # proxies are reliable pairs of the batch, with labels in [0, 1]
        proxies = duckdb.execute(f"""SELECT p.partition, d.partition, d.y_proxy FROM '{table}' d
                                     JOIN '{table}' p ON p.shard = d.proxy_shard AND p."index" = d.proxy_index
                                     """).fetchall()
        assert all(proxy == "reliable" and own == "noisy" and 0.0 <= y <= 1.0 for proxy, own, y in proxies)
        unlabelled = duckdb.execute(f"SELECT count(*) FROM '{table}' WHERE partition = 'reliable' "
                                    "AND (y_qc IS NOT NULL OR y_proxy IS NOT NULL)").fetchone()[0]
        assert unlabelled == 0  # soft and proxy labels are NULL where they do not apply


# ---------------------------------------------------------------- loops, schedules, short runs

@pytest.mark.parametrize("method, count", [("sps", "sps_reliable"), ("diffncl", "diffncl_clean")])
def test_an_epoch_after_the_warm_up_is_one_pass_over_the_pairs_that_drive_it(method, count, tmp_path, mixed_noise):
    """As the authors run them: the main network's loader reads only SPS's reliable / DiffNCL's clean pairs
    (the other kinds come in batches of their own), and the step log's rows are all of that kind."""
    result = train(str(mixed_noise.manifest), tmp_path / "run", _config(method, epochs=2))
    assert result.epochs[0]["pairs"] == 16  # warm-up: every pair
    assert result.epochs[1]["pairs"] == result.epochs[1][count] < 16
    steps = pq.read_table(tmp_path / "run" / "diagnostics" / "epoch-002.parquet").to_pylist()
    assert {r["partition_code"] for r in steps} == {0.0}  # RELIABLE / CLEAN


@pytest.mark.parametrize("method, count", [("sps", "sps_reliable"), ("diffncl", "diffncl_clean")])
def test_epoch_all_re_reads_the_chosen_pairs_for_as_many_steps_as_plain_training(method, count, tmp_path,
                                                                                   mixed_noise):
    """epoch=all: the pairs that drive an epoch are read again, in a new order, until the epoch has as many
    steps as a pass over every pair (16 pairs, batch 8: 2 steps), and only they are read."""
    options = {**SHORT[method], "epoch": "all"}
    result = train(str(mixed_noise.manifest), tmp_path / "run", _config(method, epochs=2, method_options=options))
    assert result.epochs[1][count] < 8 and result.epochs[1]["steps"] == result.epochs[0]["steps"] == 2
    steps = pq.read_table(tmp_path / "run" / "diagnostics" / "epoch-002.parquet").to_pylist()
    assert len(steps) > result.epochs[1][count] and {r["partition_code"] for r in steps} == {0.0}
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["method"]["epoch"] == "all"


@pytest.mark.parametrize("weak_loop", ["cycle", "once", "none"])
def test_diffncl_weak_loop_cycles_passes_once_or_not_at_all(weak_loop, tmp_path, mixed_noise, monkeypatch):
    """The weak pairs' steps per network: one after every clean batch (cycle), one pass over them (once,
    Algorithm 1), or none. The consensus keeps two pairs weak (one batch), the others it called weak are
    noisy; epoch=all gives the epoch 2 clean steps."""
    from pairclean.training.methods import diffncl as diffncl_module

    real_consensus, real_loss, calls = diffncl_module.consensus, diffncl_module.Diffncl._weak_loss, []

    def two_weak(labels_a, labels_b):
        out = real_consensus(labels_a, labels_b)
        out[np.flatnonzero(out == WEAK)[2:]] = diffncl_module.NOISY
        return out

    def counted(self, left, right, net, denoiser):
        calls.append(len(left))
        return real_loss(self, left, right, net, denoiser)

    monkeypatch.setattr(diffncl_module, "consensus", two_weak)
    monkeypatch.setattr(diffncl_module.Diffncl, "_weak_loss", counted)
    options = {**SHORT["diffncl"], "weak_loop": weak_loop, "epoch": "all"}
    result = train(str(mixed_noise.manifest), tmp_path / "run", _config("diffncl", epochs=2, method_options=options))
    assert result.epochs[1]["diffncl_weak"] == 2 and result.epochs[1]["steps"] == 2
    assert calls == {"cycle": [2] * 4, "once": [2, 2], "none": []}[weak_loop]  # both networks


def test_the_schedule_is_replanned_to_end_with_the_run(tmp_path, mixed_noise):
    """An epoch that trains fewer pairs than planned moves the cosine's end: the schedule reaches lr 0
    exactly when the run's last step is taken (each step logs the lr it used, the state the lr after it)."""
    from pairclean.training.checkpoint import load_state

    result = train(str(mixed_noise.manifest), tmp_path / "run", _config("diffncl", epochs=2, min_lr_ratio=0.0))
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["event"] == "step"]
    after_last = load_state(tmp_path / "run")["optimizer"]["param_groups"][0]["lr"]
    assert result.epochs[1]["pairs"] < 16 and steps[-1]["lr"] > 0 and after_last == pytest.approx(0.0, abs=1e-12)


def test_schedules_scale_with_the_run_and_keep_given_values():
    sps, diffncl = build_method("sps"), build_method("diffncl")
    assert sps.schedule(45) == {"warmup_epochs": 5, "e_qc": 16, "e_n": 21}  # the authors' code
    assert sps.schedule(4) == {"warmup_epochs": 0, "e_qc": 2, "e_n": 3}
    assert build_method("sps", {"e_n": "4"}).schedule(4) == {"warmup_epochs": 0, "e_qc": 2, "e_n": 4}
    assert diffncl.schedule(45) == {"warmup_epochs": 5} and diffncl.schedule(4) == {"warmup_epochs": 0}
    assert build_method("diffncl", {"warmup_epochs": "2"}).schedule(4) == {"warmup_epochs": 2}


@pytest.mark.parametrize("method, options, said", [
    ("sps", {"warmup_epochs": "1", "e_qc": "2", "e_n": "2"}, "covers the whole 1-epoch run"),
    ("diffncl", {"warmup_epochs": "3"}, "covers the whole 1-epoch run"),
    ("sps", {"e_qc": "2", "e_n": "3"}, "ends before e_qc=2 (quasi-clean pairs), e_n=3 (noisy pairs) starts"),
])
def test_a_run_too_short_for_the_method_says_so(method, options, said, tmp_path, mixed_noise, caplog):
    train(str(mixed_noise.manifest), tmp_path / "run", _config(method, epochs=1, method_options=options))
    assert any(said in r.getMessage() for r in caplog.records if r.name == "pairclean")


@pytest.mark.parametrize("method", ["sps", "diffncl"])
def test_a_finished_run_leaves_no_loader_workers_behind(method, tmp_path, mixed_noise):
    """The method's own loaders close their passes at each epoch's end: a process that trains several runs
    (a benchmark) does not keep a DataLoader worker per loader and run alive."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    train(str(mixed_noise.manifest), tmp_path / "run", _config(method, epochs=2, workers=1))
    assert set(multiprocessing.active_children()) - before == set()
