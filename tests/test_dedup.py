"""`pairclean dedup`: SemDeDup over saved embeddings, keeping the cleanest copy. The within-cluster
search against a brute-force matrix, k-means, the whole run on real .npy files and scores files
(keep orders, joins, the predicate that uses it), exact resume after SIGKILL, and errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import forked, run_cli

from pairclean.data.embeddings import write_embeddings
from pairclean.dedup import DedupConfig, dedup
from pairclean.dedup.kmeans import nearest_centroid, train_kmeans
from pairclean.dedup.pairwise import cluster_duplicates
from pairclean.errors import ConfigError, UserError
from pairclean.dedup.run import read_dedup_metadata

DIM = 16


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def brute_force(sides: list[np.ndarray], threshold: float):
    """The whole matrix at once and SemDeDup's rule member by member: what the blocked search must reproduce."""
    sims = np.minimum.reduce([s @ s.T for s in sides])
    n = len(sims)
    np.fill_diagonal(sims, -np.inf)
    earlier = np.array([sims[j, :j].max() if j else -np.inf for j in range(n)])
    removed = earlier > threshold
    root = list(range(n))
    for j in range(n):
        if removed[j]:
            kept = [i for i in range(j) if not removed[i] and sims[j, i] > threshold]
            parent = max(kept, key=lambda i: (sims[j, i], -i)) if kept else int(np.argmax(sims[j, :j]))
            root[j] = root[parent]
    return sims.max(1), sims.argmax(1), earlier, removed, np.array(root)


@pytest.mark.parametrize("block_rows, sides", [(7, 1), (64, 1), (5, 2), (1, 2)])
def test_blocked_search_equals_the_whole_matrix(block_rows, sides):
    rng = np.random.default_rng(block_rows)
    base = rng.standard_normal((40, DIM))
    copies = base[[3, 3, 10, 25]] + 0.02 * rng.standard_normal((4, DIM))  # a group of three, two pairs
    vectors = [unit(np.concatenate([base, copies]) + (0.01 * rng.standard_normal((44, DIM)) if s else 0))
               for s in range(sides)]
    found = cluster_duplicates(lambda a, b: [v[a:b] for v in vectors], 44, 0.9, block_rows)
    best, arg, earlier, removed, root = brute_force(vectors, 0.9)
    np.testing.assert_allclose(found.nearest_sim, best, atol=1e-5)
    np.testing.assert_array_equal(found.nearest, arg)
    np.testing.assert_allclose(found.earlier_sim, earlier, atol=1e-5)
    np.testing.assert_array_equal(found.removed, removed)
    np.testing.assert_array_equal(found.root, root)
    assert removed.sum() == 4 and sorted(np.bincount(root).tolist())[-3:] == [2, 2, 3]
    assert all(not found.removed[r] for r in found.root)  # every group is named after its kept member


def test_semdedup_rule_removes_a_chain_by_order():
    """SemDeDup removes a member whose cosine to any earlier member passes, removed or not: in the
    chain a~b~c (a !~ c) ordered a, b, c both b and c go, c in a's group through b; ordered a, c, b
    only b does, and joins the kept member it is closest to (a tie: the earlier one)."""
    a = np.array([1.0, 0.0])
    b = np.array([np.cos(0.3), np.sin(0.3)])
    c = np.array([np.cos(0.6), np.sin(0.6)])
    for order, removed, root in (([a, b, c], [False, True, True], [0, 0, 0]),
                                 ([a, c, b], [False, False, True], [0, 1, 0])):
        x = unit(np.array(order))
        found = cluster_duplicates(lambda i, j: [x[i:j]], 3, float(np.cos(0.45)), 2)
        assert found.removed.tolist() == removed and found.root.tolist() == root


def test_torch_kmeans_finds_separated_clusters_and_is_seeded():
    rng = np.random.default_rng(0)
    centres = unit(rng.standard_normal((5, DIM)))
    points = unit(np.repeat(centres, 60, axis=0) + 0.05 * rng.standard_normal((300, DIM)))
    found = train_kmeans(points, 5, 20, seed=3, backend="torch")
    labels, sims = nearest_centroid(points, found, "torch")
    assert len(set(labels.tolist())) == 5 and sims.min() > 0.9
    for block in range(5):  # each true cluster lands in one found cluster
        assert len(set(labels[block * 60:(block + 1) * 60].tolist())) == 1
    np.testing.assert_array_equal(found, train_kmeans(points, 5, 20, seed=3, backend="torch"))
    # more clusters than distinct points: the empty ones split large ones instead of staying empty
    many = train_kmeans(np.repeat(centres, 10, axis=0), 8, 5, seed=0, backend="torch")
    assert np.isfinite(many).all() and np.allclose(np.linalg.norm(many, axis=1), 1, atol=1e-5)


# -- the run on real files ------------------------------------------------------------------------


def planted(tmp_path: Path, n: int = 600, copies: int = 40, noisy_copies: int = 20, seed: int = 0):
    """Embeddings where the last `copies` pairs copy the first ones (image vector nearly equal);
    the first `noisy_copies` copies carry another pair's text vector (a shuffled caption), so their
    image-text cosine is low. Two .npy file pairs, keys in metadata. Returns (dir, truth dict)."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((n, DIM))
    texts = images + 0.6 * rng.standard_normal((n, DIM))  # a pair's text is near its image
    originals = np.arange(copies)
    images[n - copies:] = images[originals] + 0.02 * rng.standard_normal((copies, DIM))
    texts[n - copies:] = texts[originals] + 0.02 * rng.standard_normal((copies, DIM))
    texts[n - copies:n - copies + noisy_copies] = rng.standard_normal((noisy_copies, DIM)) * 2
    keys = [f"p{i:04d}" for i in range(n)]
    half = n // 2
    out = write_embeddings(tmp_path / "emb", [(images[:half].astype(np.float16), texts[:half].astype(np.float16), keys[:half]),
                                              (images[half:].astype(np.float16), texts[half:].astype(np.float16), keys[half:])])
    truth = {f"p{n - copies + i:04d}": f"p{i:04d}" for i in range(copies)}
    return out, truth


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("dedup")
    emb, truth = planted(root)
    scores = root / "scores.parquet"
    code = subprocess.run([sys.executable, "-m", "pairclean", "score", str(emb), "--from-embeddings", "--beta-mode",
                           "fixed", "--beta", "0", "--out", str(scores)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert code.returncode == 0, code.stderr
    return root, emb, truth, scores


def rows(path: Path) -> dict[str, dict]:
    return {r["key"]: r for r in pq.read_table(path).to_pylist()}


def test_dedup_finds_the_copies_and_keeps_the_cleanest(world, tmp_path):
    _, emb, truth, scores = world
    out = tmp_path / "dedup.parquet"
    result = dedup(str(emb), out, scores, DedupConfig(threads=1))
    got = rows(out)
    assert len(got) == 600 and result.summary.rows == 600 and result.summary.scores_join == "shard, index"
    for copy, original in truth.items():
        assert got[copy]["group_id"] == got[original]["group_id"] is not None
        assert got[copy]["group_size"] == 2 and got[copy]["nearest_key"] == original
        assert got[copy]["nearest_sim"] > 0.95
    sims = {r["key"]: r["sim_debiased"] for r in pq.read_table(scores).to_pylist()}
    for copy, original in truth.items():  # of each pair of copies the one with the better caption stays
        cleanest = max((copy, original), key=sims.get)
        assert got[cleanest]["kept"] and not got[({copy, original} - {cleanest}).pop()]["kept"]
    noisy = list(truth)[:20]
    assert all(not got[k]["kept"] for k in noisy)  # a copy with a shuffled caption is never the one kept
    grouped = {k for k, r in got.items() if r["group_id"] is not None}
    assert grouped == set(truth) | set(truth.values())
    assert result.summary.removed == 40 and sum(not r["kept"] for r in got.values()) == 40


def test_semdedup_and_random_orders_keep_one_per_group(world, tmp_path):
    _, emb, truth, scores = world
    kept_noisy = {}
    for keep in ("semdedup", "random"):
        out = tmp_path / f"{keep}.parquet"
        dedup(str(emb), out, None, DedupConfig(keep=keep, threads=1))
        got = rows(out)
        for copy, original in truth.items():
            assert got[copy]["kept"] != got[original]["kept"]
        kept_noisy[keep] = sum(got[k]["kept"] for k in list(truth)[:20])
    assert 0 < kept_noisy["random"] < 20  # an arbitrary order keeps some of the wrong captions


def test_the_output_joins_the_scores_in_one_predicate(world, tmp_path, capsys):
    root, emb, truth, scores = world
    out = tmp_path / "dedup.parquet"
    code, _, err = run_cli(["dedup", emb, "--scores", scores, "--out", out, "--threads", "1"], capsys)
    assert code == 0, err
    sql = ("SELECT count(*) FROM scores WHERE sim_debiased > 0 AND "
           "(shard, \"index\") IN (SELECT shard, \"index\" FROM dedup WHERE kept)")
    code, printed, err = run_cli(["query", scores, "--attach", f"dedup={out}", "--format", "csv", sql], capsys)
    assert code == 0, err
    got = rows(out)
    sims = {r["key"]: r["sim_debiased"] for r in pq.read_table(scores).to_pylist()}
    assert int(printed.split()[-1]) == sum(1 for k, r in got.items() if r["kept"] and sims[k] > 0)


def test_text_and_both_sides(world, tmp_path):
    _, emb, truth, scores = world
    dedup(str(emb), tmp_path / "text.parquet", scores, DedupConfig(side="text", threads=1))
    dedup(str(emb), tmp_path / "both.parquet", scores, DedupConfig(side="both", threads=1))
    text, both = rows(tmp_path / "text.parquet"), rows(tmp_path / "both.parquet")
    clean_copies, noisy_copies = list(truth)[20:], list(truth)[:20]
    for side in (text, both):  # a copy with another caption is no text duplicate
        assert all(side[k]["group_id"] is None for k in noisy_copies)
        assert all(side[k]["group_id"] == side[truth[k]]["group_id"] is not None for k in clean_copies)


def test_resume_after_sigkill_gives_the_uninterrupted_rows(world, tmp_path):
    _, emb, _, scores = world
    reference = tmp_path / "ref.parquet"
    argv = [sys.executable, "-m", "pairclean", "dedup", str(emb), "--scores", str(scores), "--threads", "1",
            "--group-rows", "100"]  # two assignment units (one per file pair), several groups of clusters
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(argv + ["--out", str(reference)], check=True, capture_output=True, env=env)
    # killed after the first assignment part, between two cluster parts, and while writing the output
    for fault in ("committed:1", "committed:4", "finalize-batch:1"):
        out = tmp_path / f"{fault.replace(':', '-')}.parquet"
        killed = subprocess.run(argv + ["--out", str(out)], capture_output=True, env={**env, "PAIRCLEAN_FAULT": fault})
        assert killed.returncode == -9 and not out.exists()
        resumed = subprocess.run(argv + ["--out", str(out)], capture_output=True, text=True, env=env)
        assert resumed.returncode == 0, resumed.stderr
        assert pq.read_table(out).to_pylist() == pq.read_table(reference).to_pylist()
        assert not Path(str(out) + ".parts").exists()


@pytest.mark.parametrize("kwargs, message", [
    (dict(keep="best"), "keep order"), (dict(side="caption"), "side"), (dict(threshold=1.0), "threshold"),
    (dict(clusters=0), "clusters"), (dict(backend="annoy"), "backend"),
])
def test_bad_settings_name_their_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DedupConfig(**kwargs)


def test_inputs_it_cannot_use_are_one_line_errors(world, tmp_path, capsys):
    root, emb, _, scores = world
    code, _, err = run_cli(["dedup", emb, "--out", tmp_path / "x.parquet"], capsys)
    assert code == 2 and "--scores" in err and "--keep" in err
    code, _, err = run_cli(["dedup", emb, "--out", tmp_path / "x.parquet", "--scores", emb / "metadata" / "metadata_0.parquet"],
                           capsys)
    assert code == 2 and "not a pairclean scores file" in err
    other = write_embeddings(tmp_path / "other", [(np.eye(4, DIM, dtype=np.float16), np.eye(4, DIM, dtype=np.float16),
                                                   ["zz1", "zz2", "zz3", "zz4"])])
    with pytest.raises(UserError, match="no row of the embeddings matches"):
        dedup(str(other), tmp_path / "y.parquet", scores, DedupConfig(threads=1))
    assert not (tmp_path / "y.parquet").exists()
    code, _, err = run_cli(["dedup", emb, "--out", emb / "img_emb" / "img_emb_0.npy", "--keep", "random"], capsys)
    assert code == 2 and "input" in err


def test_two_torchrun_ranks_share_the_work_and_write_the_same_rows(world, tmp_path):
    _, emb, _, scores = world
    args = ["dedup", str(emb), "--scores", str(scores), "--threads", "1", "--group-rows", "60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "one.parquet", tmp_path / "two.parquet"
    subprocess.run([sys.executable, "-m", "pairclean", *args, "--out", str(one)], check=True, capture_output=True,
                   env=env)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "-m", "pairclean", *args, "--out", str(two)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert pq.read_table(two).to_pylist() == pq.read_table(one).to_pylist()
    provenance, summary = read_dedup_metadata(two)
    assert provenance.world_size == 2
    for stage in ("assign", "clusters"):  # every part committed once, by one of the two ranks
        by_rank = provenance.work_by_rank[stage]
        assert set(by_rank) <= {"0", "1"} and sum(by_rank.values()) == (2 if stage == "assign" else
                                                                         summary.groups_of_clusters)


def test_faiss_backend_finds_the_same_copies(world, tmp_path):
    pytest.importorskip("faiss")
    _, emb, truth, scores = world
    dedup(str(emb), tmp_path / "faiss.parquet", scores, DedupConfig(backend="faiss", threads=1))
    got = rows(tmp_path / "faiss.parquet")
    assert read_dedup_metadata(tmp_path / "faiss.parquet")[0].backend == "faiss"
    for copy, original in truth.items():
        assert got[copy]["group_id"] == got[original]["group_id"] is not None


def test_faiss_backend_without_faiss_is_refused(world, tmp_path):
    try:
        import faiss  # noqa: F401
        pytest.skip("faiss is installed here")
    except ImportError:
        pass
    _, emb, _, scores = world
    with pytest.raises(ConfigError, match="faiss-cpu"):
        dedup(str(emb), tmp_path / "x.parquet", scores, DedupConfig(backend="faiss"))
    assert not (tmp_path / "x.parquet").exists()


def test_datacomp_npz_gives_the_rows_of_the_same_vectors_and_parquet_is_refused(world, tmp_path, capsys):
    """eco's readers: DataComp's metadata/ (.npz members read by row in place) dedups like the same
    vectors in clip-retrieval's layout; Parquet embedding columns cannot be read by row and are refused."""
    from pairclean.data.embeddings import open_embeddings

    _, emb, _, _ = world
    spec = open_embeddings(str(emb))
    images = np.concatenate([np.load(p.left) for p in spec.npy])
    texts = np.concatenate([np.load(p.right) for p in spec.npy])
    keys = [k for p in spec.npy for k in pq.read_table(p.keys).column("key").to_pylist()]
    (tmp_path / "pool" / "metadata").mkdir(parents=True)
    np.savez(tmp_path / "pool" / "metadata" / "0123.npz", b32_img=images, b32_txt=texts)
    pq.write_table(pa.table({"uid": keys}), tmp_path / "pool" / "metadata" / "0123.parquet")
    cfg = dict(keep="semdedup", threads=1, unit_rows=1 << 10)
    reference = dedup(str(emb), tmp_path / "ref.parquet", config=DedupConfig(**cfg))
    npz = dedup(str(tmp_path / "pool"), tmp_path / "npz.parquet", config=DedupConfig(**cfg))
    assert reference.summary.removed > 0
    def by_key(path):
        return {r["key"]: (r["kept"], r["group_size"]) for r in pq.read_table(path).to_pylist()}

    assert by_key(npz.out) == by_key(reference.out)
    assert read_dedup_metadata(npz.out)[0].embeddings.format == "datacomp-npz"

    pq.write_table(pa.table({"key": keys, "left_emb": list(images.astype(np.float32)),
                             "right_emb": list(texts.astype(np.float32))}), tmp_path / "emb.parquet")
    code, _, err = run_cli(["dedup", tmp_path / "emb.parquet", "--keep", "random", "--out", tmp_path / "p.parquet"],
                           capsys)
    assert code == 2 and "parquet-embeddings" in err and "by position" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p.parquet").exists()


def test_a_scores_file_given_for_the_embeddings_points_at_save_embeddings(coco_scores, tmp_path, capsys):
    """Before: "has no column 'left_emb' (...); name the columns with --left-emb-field ..."."""
    code, _, err = run_cli(["dedup", coco_scores, "--out", tmp_path / "d.parquet"], capsys)
    assert code == 2 and err.strip() == (
        f"error: {coco_scores} is a scores file: dedup reads the embeddings a scoring run saved. Score with "
        f"`pairclean score ... --save-embeddings emb/`, then `pairclean dedup emb/ --scores {coco_scores} "
        "--out dedup.parquet`")


@pytest.mark.parametrize("kill, damage", [("committed:2", "truncated"), ("committed:2", "swapped"),
                                          ("committed:4", "truncated"), ("committed:4", "swapped")])
def test_dedup_parts_damaged_after_a_kill_are_redone(world, tmp_path, kill, damage):
    """dedup's parts go through the same engine: a damaged part - an assignment part (killed after
    both were in) or a group of clusters (killed between them) - is redone on resume, the rows exact."""
    _, emb, _, scores = world
    cfg = DedupConfig(threads=1, group_rows=100)
    dedup(str(emb), tmp_path / "ref.parquet", scores, cfg)
    out = tmp_path / "out.parquet"
    assert forked(lambda: dedup(str(emb), out, scores, cfg), kill) == -9
    records = sorted(Path(str(out) + ".parts").glob("part-*.done.json"), key=lambda p: p.stat().st_mtime_ns)
    assert len(records) == int(kill.split(":")[1])
    last = records[-1].with_name(records[-1].name.replace(".done.json", ".parquet"))  # the last committed
    other = next(p for p in Path(str(out) + ".parts").glob("part-*.parquet") if p != last)
    if damage == "truncated":
        last.write_bytes(last.read_bytes()[:-64])
    else:
        shutil.copyfile(other, last)
    dedup(str(emb), out, scores, cfg)
    assert pq.read_table(out).to_pylist() == pq.read_table(tmp_path / "ref.parquet").to_pylist()


def test_dedup_refuses_a_linked_parts_directory(world, tmp_path):
    _, emb, _, scores = world
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "a.txt").write_text("mine")
    out = tmp_path / "d.parquet"
    Path(str(out) + ".parts").symlink_to(keep, target_is_directory=True)
    with pytest.raises(ConfigError, match="symbolic link"):
        dedup(str(emb), out, scores, DedupConfig(threads=1))
    assert (keep / "a.txt").read_text() == "mine"
