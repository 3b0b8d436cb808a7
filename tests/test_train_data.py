"""The training data path: shard index = the reader's indexes, deterministic per-epoch order, worker split."""

from __future__ import annotations

import io
import tarfile

import pytest
import torch
from torch.utils.data import DataLoader

from pairclean.backends.open_clip import OpenClipEstimator
from pairclean.data.dataset import open_dataset
from pairclean.data.spec import UnitFailure
from pairclean.training.data import TrainBatches, index_shards


def _tar(path, members):
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_header_listing_matches_the_reader_even_with_repeated_keys(tmp_path):
    shard = tmp_path / "odd.tar"
    _tar(shard, [("a.txt", b"x"), ("a.txt2", b"y"), ("a.txt", b"z"), ("a.txt2", b"w"), ("__meta__", b""),
                 ("b.txt", b"q"), ("b.txt2", b"r"), ("c.json", b"{}")])
    spec = open_dataset(str(shard), pair="text-text")
    read = [item.key for item in spec.read(str(shard)) if not isinstance(item, UnitFailure)]
    keys, (rows, failure) = spec.keys(str(shard)), spec.rows(str(shard))
    assert keys == read == ["a", "a", "b", "c"] and failure is None
    assert index_shards(spec)[0].rows == rows == 4


def test_truncated_shard_counts_what_is_readable(tmp_path, coco_shards):
    whole = sorted(coco_shards.glob("*.tar"))[0]
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole.read_bytes()[:len(whole.read_bytes()) // 2])
    rows, failure = open_dataset(str(cut)).rows(str(cut))
    assert failure is not None and 0 < rows < 6


@pytest.fixture(scope="module")
def preparer():
    torch.manual_seed(0)
    return OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu").preparer


def _order(spec, preparer, epoch, workers=0, seed=0):
    data = TrainBatches(spec, preparer, batch_size=5, seed=seed, shuffle_buffer=4)
    data.set_epoch(epoch)
    loader = DataLoader(data, batch_size=None, num_workers=workers)
    return [(s, int(i)) for batch in loader for s, i in zip(batch["shard"], batch["index"])]


def test_order_depends_on_seed_and_epoch_only(coco_shards, preparer):
    spec = open_dataset(str(coco_shards))
    first = _order(spec, preparer, epoch=1)
    assert first == _order(spec, preparer, epoch=1)
    assert first != _order(spec, preparer, epoch=2)
    assert sorted(first) == sorted(_order(spec, preparer, epoch=2)) and len(set(first)) == 16


def test_workers_split_the_units_without_overlap(coco_shards, preparer):
    spec = open_dataset(str(coco_shards))
    pairs = _order(spec, preparer, epoch=1, workers=2)
    assert len(pairs) == 16 and len(set(pairs)) == 16


def test_batches_are_the_pairs_that_prepare_in_stream_order_cut_at_the_batch_size(tmp_path, coco_src, preparer):
    """Pairs are prepared as many at a time as the batch still needs (their images a run at a
    time): the batches are those of one pair at a time - the pairs that prepare, in the stream's
    order, every `batch_size` of them - and each batch counts the failures read before it."""
    from pairclean.lab.coco import read_pairs

    pairs = read_pairs(coco_src)[:12]
    broken = {1, 4, 5, 9}  # JPEGs that are not: `prepare` raises
    shard = tmp_path / "mixed-000000.tar"
    _tar(shard, [member for i, p in enumerate(pairs) for member in (
        (f"k{i:02d}.jpg", b"\xff\xd8\xff" + b"x" * 50 if i in broken else (coco_src / p["image"]).read_bytes()),
        (f"k{i:02d}.txt", p["caption"].encode()))])
    batches = list(TrainBatches(open_dataset(str(shard)), preparer, batch_size=3, seed=0, shuffle=False))
    expected, errors, rows = [], 0, []
    for i in range(len(pairs)):
        if i in broken:
            errors += 1
            continue
        rows.append(f"k{i:02d}")
        if len(rows) == 3:
            expected.append((rows, errors))
            rows, errors = [], 0
    expected.append((rows, errors))  # the last, short batch
    assert [(b["key"], b["stats"].errors) for b in batches] == expected  # [k00 k02 k03] 1, [k06 k07 k08] 2, ...
    assert [b["left"].shape[0] for b in batches] == [3, 3, 2]
