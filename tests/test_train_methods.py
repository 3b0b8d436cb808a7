"""SDD and GSC: their equations on tiny hand-checkable tensors, then end to end on real shards
(exact resume, per-pair diagnostics, a two-network run evaluated by averaged similarity)."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from helpers import tiny_train_config, trained_and_killed_after_first_epoch

from pairclean.errors import UserError
from pairclean.training import build_method, train
from pairclean.training.methods.gsc import (calibrated_indicator, cross_modal_indicator, intra_modal_loss,
                                        intra_modal_similarity, momentum, structure_rows)
from pairclean.training.retrieval import evaluate_retrieval
from pairclean.training.methods.sdd import confidence_weights, memory_bank, nearest, partition, self_drop, significance

pytestmark = pytest.mark.usefixtures("one_torch_thread")

E1, E2 = [1.0, 0.0], [0.0, 1.0]


def test_sdd_self_drop_keeps_pairs_strictly_above_alpha():
    assert self_drop(np.array([10.0, 20.0, 20.5, 35.0]), 20).tolist() == [False, False, True, True]


def test_sdd_significance_weight_from_the_loss_ratio():
    c, w = significance(torch.tensor([2.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([1.0, 2.0]),
                        torch.tensor([2.0, 2.0]), eps=0.0)
    assert c.tolist() == pytest.approx([0.5 * (2 / 1 + 1 / 2), 0.5])  # 1.25: the bank's loss fell -> 1
    assert w.tolist() == pytest.approx([1.0, math.tanh(0.5)])


def test_sdd_qua_partition_rules():
    labels = partition(np.array([10.0, 25.0, 40.0, 40.0, 40.0]), 20, np.array([0.9, 0.3, 0.9, 0.9, 0.9]),
                       np.array([np.nan, 2.0, 0.5, 1.0, np.nan]))
    assert labels.tolist() == ["noisy", "vague", "clean_insignificant", "clean_significant", "clean_unmeasured"]


def test_sdd_confidence_weight_is_the_high_component_posterior():
    w = confidence_weights(np.array([10.0, 11.0, 12.0, 30.0, 31.0, 32.0]))
    assert (w[:3] < 0.01).all() and (w[3:] > 0.99).all()


def test_sdd_memory_bank_is_the_nearest_clean_pair_per_side():
    s = 2 ** -0.5
    left = np.array([E1, E2, [0.99, 0.14], [0.14, 0.99]], dtype=np.float32)
    right = np.array([E2, E1, [s, s], [0.99, 0.14]], dtype=np.float32)
    image, text = memory_bank(left, right, np.array([True, True, False, False]), chunk=1)
    assert image.tolist() == [0, 1, 0, 1]
    assert text.tolist()[:2] == [0, 1] and text[3] == 1
    q = torch.randn(7, 3)
    assert torch.equal(nearest(q, q[:4], chunk=2), nearest(q, q[:4], chunk=100))


def test_gsc_cross_modal_indicator_from_a_small_similarity_matrix():
    eye = torch.eye(2)
    y = cross_modal_indicator(eye, eye, logit_scale=1.0)  # S = I: each softmax diagonal is e / (e + 1)
    assert y.tolist() == pytest.approx([math.e / (math.e + 1)] * 2)
    y = cross_modal_indicator(eye, eye.flip(0), logit_scale=1.0)  # swapped pairs: the diagonal holds the negatives
    assert y.tolist() == pytest.approx([1 / (math.e + 1)] * 2)


def test_gsc_intra_modal_similarity_masks_columns_by_label():
    left = torch.tensor([E1, E2, E1])
    right = torch.tensor([E1, E2, E2])  # pair 3 is mismatched: its image is item 1's, its text item 2's
    # S_II rows [1,0,1] [0,1,0] [1,0,1]; S_TT rows [1,0,0] [0,1,1] [0,1,1]
    s = intra_modal_similarity(left, right, torch.ones(3))
    assert s.tolist() == pytest.approx([2 ** -0.5, 2 ** -0.5, 0.5])
    s = intra_modal_similarity(left, right, torch.tensor([1.0, 1.0, 0.0]))  # pair 3's column removed
    assert s.tolist() == pytest.approx([1.0, 1.0, 0.0])


def test_gsc_intra_modal_loss_with_label_masking():
    eye = torch.eye(3)
    ce = -math.log(math.e / (math.e + 2))  # M = I / tau2: diagonal 1, off-diagonal 0
    assert float(intra_modal_loss(eye, eye, torch.ones(3), torch.ones(3), tau2=1.0)) == pytest.approx(ce)
    own = torch.tensor([1.0, 0.0, 1.0])
    assert float(intra_modal_loss(eye, eye, torch.ones(3), own, tau2=1.0)) == pytest.approx(2 * ce / 3)
    # y_3 = 0 zeroes M's third column and row: rows 1-2 see logits (1, 0, 0); row 3 sees (0, 0, 0)
    masked = float(intra_modal_loss(eye, eye, torch.tensor([1.0, 1.0, 0.0]), torch.ones(3), tau2=1.0))
    assert masked == pytest.approx((2 * ce + math.log(3)) / 3)


def test_gsc_centred_rows_leave_out_the_diagonal_and_the_common_offset():
    # three items whose cosines share an offset of 0.5: row 0 = (1, 0.7, 0.5), without its diagonal (0.7, 0.5)
    gram = torch.tensor([[1.0, 0.7, 0.5], [0.7, 1.0, 0.6], [0.5, 0.6, 1.0]])
    items = torch.linalg.cholesky(gram)  # rows whose inner products are `gram`
    rows = structure_rows(items, items, torch.ones(3), centred=True)
    assert rows[0].tolist() == pytest.approx([0.0, 0.1, -0.1], abs=1e-6)  # (0.7, 0.5) minus their mean 0.6
    weighted = structure_rows(items, items, torch.tensor([1.0, 1.0, 0.0]), centred=True)
    assert weighted[0].tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-6)  # one column left: its own mean
    assert weighted[2].tolist() == pytest.approx([-0.05, 0.05, 0.0], abs=1e-6)  # mean of (0.5, 0.6), col 2 * 0
    local = structure_rows(items[1:], items, torch.ones(3), offset=1, centred=True)  # rank 2 of 2: rows 1-2
    assert torch.allclose(local, rows[1:], atol=1e-6)


def test_gsc_centred_structure_tells_a_mismatched_pair_from_clean_ones():
    torch.manual_seed(0)
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)  # noqa: E731
    offset = unit(torch.ones(32))  # a direction every embedding shares, as a dual encoder's cosines do
    images = unit(unit(torch.randn(16, 32)) + 2 * offset)
    texts = unit(images + 0.3 * unit(torch.randn(16, 32)))  # each text near its own image
    texts[0] = texts[5]  # pair 0 is mismatched: its text is item 5's
    raw = intra_modal_similarity(images, texts, torch.ones(16))
    centred = intra_modal_similarity(images, texts, torch.ones(16), centred=True)
    assert float(raw.min()) > 0.98  # the common offset makes every raw row alike (Eq. 8 on cosines)
    assert float(centred[0]) < 0 < float(centred[1:].min())  # centred rows single out the mismatched pair


def test_gsc_calibrated_indicator_is_a_clean_posterior():
    softmax = np.array([0.01, 0.012, 0.015, 0.02, 0.011, 0.12, 0.15, 0.1, 0.13, 0.14])  # noisy ~0.01, clean ~0.13
    y = calibrated_indicator(softmax)
    assert (y[:5] < 0.05).all() and (y[5:] > 0.95).all()


def test_gsc_momentum_update_from_one():
    y = momentum(np.ones(2), np.array([0.0, 1.0]), 0.7)
    assert y.tolist() == pytest.approx([0.3, 1.0])
    assert momentum(y, np.array([0.0, 1.0]), 0.7).tolist() == pytest.approx([0.09, 1.0])


@pytest.mark.parametrize("name, options, message", [
    ("sdd", {"alpha": "30", "beta": "20"}, "beta"),
    ("gsc", {"networks": "3"}, "networks"),
    ("gsc", {"tau1": "0"}, "tau1"),
])
def test_bad_method_options_are_user_errors(name, options, message):
    with pytest.raises(UserError, match=message):
        build_method(name, options)


tiny = partial(tiny_train_config, epochs=2)


SDD_ANY = {"alpha": "-100", "beta": "-100"}  # a random tiny model: every pair kept, every pair in the bank
RESUMED = [("sdd", SDD_ANY, ["model-epoch-002.pt"]),
           ("sdd", {"alpha": "0", "beta": "0"}, ["model-epoch-002.pt"]),
           ("gsc", {}, ["model-epoch-002.pt"]),
           ("gsc", {"networks": "2"}, ["model-epoch-002.pt", "model-epoch-002-peer.pt"])]


@pytest.mark.parametrize("method, options, models", RESUMED, ids=["sdd", "sdd-drops", "gsc", "gsc-2"])
def test_killed_and_resumed_run_ends_with_the_same_weights(tmp_path, coco_shards, monkeypatch, method, options, models):
    cfg = tiny(method=method, method_options=options)
    straight = train(str(coco_shards), tmp_path / "straight", cfg)
    trained_and_killed_after_first_epoch(monkeypatch, str(coco_shards), tmp_path / "killed", cfg)
    resumed = train(str(coco_shards), tmp_path / "killed", tiny(method=method, method_options=options, resume=True))
    assert resumed.resumed_from == 1
    for name in models:
        a = torch.load(tmp_path / "straight" / name, weights_only=True)
        b = torch.load(tmp_path / "killed" / name, weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert [r["train_loss"] for r in straight.epochs] == [r["train_loss"] for r in resumed.epochs]
    a = pq.read_table(tmp_path / "straight" / "diagnostics" / "pairs-epoch-002.parquet").to_pylist()
    b = pq.read_table(tmp_path / "killed" / "diagnostics" / "pairs-epoch-002.parquet").to_pylist()
    assert repr(a) == repr(b) and len(a) == 16  # repr: NaN (no c for a dropped pair) equals NaN


def test_sdd_diagnostics_hold_the_partition_of_every_pair(tmp_path, coco_shards):
    result = train(str(coco_shards), tmp_path / "run", tiny(epochs=1, method="sdd",
                                                           method_options={"alpha": "0", "beta": "0"}))
    rows = pq.read_table(tmp_path / "run" / "diagnostics" / "pairs-epoch-001.parquet").to_pylist()
    assert len(rows) == 16 and {r["index"] for r in rows} == set(range(6)) | set(range(4))
    for r in rows:
        assert r["kept"] == (100 * r["sim"] > 0)
        assert (r["partition"] == "noisy") == (not r["kept"])
        assert (r["c"] is None or math.isnan(r["c"])) == (not r["kept"])
    assert result.epochs[0]["pairs"] == sum(r["kept"] for r in rows)  # dropped pairs are not read
    steps = pq.read_table(tmp_path / "run" / "diagnostics" / "epoch-001.parquet").to_pylist()
    assert all(s["weight"] == pytest.approx(s["w_con"] * s["w_sig"]) for s in steps)


def test_sdd_refuses_an_empty_memory_bank(tmp_path, coco_shards):
    with pytest.raises(UserError, match="memory bank is empty"):
        train(str(coco_shards), tmp_path / "run", tiny(method="sdd", method_options={"alpha": "99", "beta": "99"}))


def test_gsc_labels_start_from_a_pass_of_the_starting_model(tmp_path, coco_shards):
    """init_labels=pass: the first epoch already trains with labels (not 1), and they are the posteriors
    of the starting model's own indicators; ones: every label is 1 during the first epoch."""
    train(str(coco_shards), tmp_path / "pass", tiny(epochs=1, method="gsc"))
    train(str(coco_shards), tmp_path / "ones", tiny(epochs=1, method="gsc", method_options={"init_labels": "ones"}))
    first = pq.read_table(tmp_path / "pass" / "diagnostics" / "epoch-001.parquet").to_pylist()
    assert len({round(r["y"], 6) for r in first}) > 1 and min(r["y"] for r in first) < 1
    ones = pq.read_table(tmp_path / "ones" / "diagnostics" / "epoch-001.parquet").to_pylist()
    assert {r["y"] for r in ones} == {1.0}


def test_two_network_gsc_run_is_evaluated_with_both_networks(tmp_path, coco_shards):
    result = train(str(coco_shards), tmp_path / "run", tiny(epochs=1, method="gsc", method_options={"networks": "2"}),
                   val=str(coco_shards))
    assert (tmp_path / "run" / "model-best-peer.pt").is_file()
    averaged = evaluate_retrieval(tmp_path / "run", str(coco_shards), workers=0)
    assert averaged.rsum == pytest.approx(result.epochs[0]["val_rsum"], abs=1e-6)
    (tmp_path / "run" / "model-best-peer.pt").unlink()
    with pytest.raises(UserError, match="model-best-peer.pt is missing"):
        evaluate_retrieval(tmp_path / "run", str(coco_shards), workers=0)
    rows = pq.read_table(tmp_path / "run" / "diagnostics" / "pairs-epoch-001.parquet").to_pylist()
    for r in rows:
        assert r["y"] == pytest.approx(min(r["y_cm"], r["y_im"]))
        assert r["partition"] == ("clean" if (r["y"] + r["y_peer"]) / 2 >= 0.5 else "noisy")


def test_method_option_help_lists_every_method_with_its_defaults(capsys):
    from pairclean.cli import main

    main(["train", "--method-option", "help"])  # no data, no --out: the listing comes first
    out = capsys.readouterr().out
    for text in ("sdd", "alpha=20.0", "beta=30.0", "gsc", "tau1=0.07", "gamma=0.01", "networks=1", "osa-weights"):
        assert text in out


@pytest.mark.parametrize("order", [["--method-option", "help", "--method", "sps", "--epochs", "7"],
                                   ["--epochs", "7", "--method", "sps", "--method-option", "help"],
                                   ["--method", "sps", "--method-option", "help", "--epochs", "7"]])
def test_method_option_help_shows_the_schedule_at_the_epochs_given_wherever_they_stand(order, capsys):
    """Before: `--method-option help --epochs 4` listed the schedule at 5 epochs (the default): the
    options were read in the order given and the listing came before --epochs was."""
    from pairclean.cli import main

    main(["train", *order])
    out = capsys.readouterr().out
    assert "schedule at --epochs 7" in out and "warmup_epochs=1, e_qc=3, e_n=4" in out
