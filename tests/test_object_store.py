"""Shards in an object store, read natively through fsspec: a real S3-compatible server (moto's
server mode) on 127.0.0.1, started here. Score, filter and train give the same rows from
`s3://` as from the same shards on disk; an object that disappears after the run listed it, and a
truncated object, become failed units with every readable row kept."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import webdataset as wds

from pairclean.cli import main
from pairclean.data.dataset import open_dataset
from pairclean.errors import UserError
from pairclean.scoring.model import ScoreConfig, score

BUCKET = "pairclean-shards"
TINY = ["--model", "pairclean-tiny", "--pretrained", "none", "--beta-k", "64", "--workers", "0",
        "--batch-size", "4", "--seed", "0"]


@pytest.fixture(scope="module")
def s3(coco_shards):
    """A moto S3 server on 127.0.0.1 holding the COCO test shards under s3://BUCKET/coco/; the
    credentials and endpoint reach s3fs the usual way, through the AWS_* environment."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"}.items():
            env.setenv(name, value)
        import boto3

        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        for shard in sorted(coco_shards.glob("*.tar")):
            client.upload_file(str(shard), BUCKET, f"coco/{shard.name}")
        yield client
    server.stop()


def _rows(path: Path) -> list[dict]:
    """Rows with the shard named by its file name (a path on disk, an s3:// URL in the store)."""
    return [{**r, "shard": r["shard"].rsplit("/", 1)[-1]} for r in pq.read_table(path).to_pylist()]


def test_patterns_and_listings_expand_in_the_store(s3, coco_shards):
    names = [f"s3://{BUCKET}/coco/{p.name}" for p in sorted(coco_shards.glob("*.tar"))]
    assert open_dataset(f"s3://{BUCKET}/coco/*.tar").spec.shards == names
    assert open_dataset(f"s3://{BUCKET}/coco/").spec.shards == names
    assert open_dataset(f"s3://{BUCKET}/coco/coco-mini-{{000000..000002}}.tar").spec.shards == names
    with pytest.raises(UserError, match="cannot read nosuchfs:// shards"):
        score("nosuchfs://x/a.tar", "/tmp/never.parquet", ScoreConfig(model="pairclean-tiny", pretrained="none"))


def test_score_filter_and_train_read_the_store_like_the_disk(s3, coco_shards, tmp_path):
    url = f"s3://{BUCKET}/coco/*.tar"
    main(["score", str(coco_shards), "--out", str(tmp_path / "disk.parquet"), *TINY])
    main(["score", url, "--out", str(tmp_path / "s3.parquet"), *TINY])
    disk, store = _rows(tmp_path / "disk.parquet"), _rows(tmp_path / "s3.parquet")
    assert len(disk) == 16 and store == disk  # keys, positions, sims, weights, p_clean, errors: all equal

    for name, source in (("disk", str(coco_shards)), ("s3", url)):
        main(["filter", source, "--scores", str(tmp_path / f"{name}.parquet"), "--top-fraction", "0.5",
              "--out", str(tmp_path / f"kept-{name}"), "--shard-size", "100"])
    kept = {name: [(s["__key__"], s["jpg"], s["txt"]) for s in
                   wds.WebDataset([str(p) for p in sorted((tmp_path / f"kept-{name}").glob("*.tar"))],
                                  shardshuffle=False)]
            for name in ("disk", "s3")}
    assert len(kept["disk"]) == 8 and kept["s3"] == kept["disk"]  # the same samples, byte for byte

    train = ["--model", "pairclean-tiny", "--pretrained", "none", "--epochs", "1", "--batch-size", "8", "--lr", "1e-3",
             "--warmup-steps", "1", "--workers", "0", "--shuffle-buffer", "0", "--log-every", "1", "--seed", "0"]
    for name, source in (("disk", str(coco_shards)), ("s3", url)):
        main(["train", source, "--out", str(tmp_path / f"train-{name}"), *train])

    def losses(name):
        lines = [json.loads(x) for x in (tmp_path / f"train-{name}" / "metrics.jsonl").read_text().splitlines()]
        return [x["loss"] for x in lines if x.get("event") == "step"]

    assert len(losses("disk")) == 2 and losses("s3") == losses("disk")


def test_a_vanished_and_a_truncated_object_are_failed_units_with_nothing_lost(s3, coco_shards, tmp_path):
    for shard in sorted(coco_shards.glob("*.tar")):
        s3.upload_file(str(shard), BUCKET, f"broken/{shard.name}")
    whole = (coco_shards / "coco-mini-000002.tar").read_bytes()
    s3.put_object(Bucket=BUCKET, Key="broken/coco-mini-000002.tar", Body=whole[: len(whole) // 2])  # cut inside member data
    spec = open_dataset(f"s3://{BUCKET}/broken/*.tar")  # listed while all three are there
    s3.delete_object(Bucket=BUCKET, Key="broken/coco-mini-000001.tar")  # then one disappears
    out = tmp_path / "broken.parquet"
    result = score(spec, out, ScoreConfig(model="pairclean-tiny", pretrained="none", beta_k=64, workers=0,
                                          batch_size=4, seed=0))
    failures = {f.unit.rsplit("/", 1)[-1]: f.reason for f in result.summary.unit_failures}
    assert set(failures) == {"coco-mini-000001.tar", "coco-mini-000002.tar"}
    assert "not exist" in failures["coco-mini-000001.tar"] or "NoSuchKey" in failures["coco-mini-000001.tar"], failures
    assert "truncated" in failures["coco-mini-000002.tar"], failures
    rows = _rows(out)
    shards = [r["shard"] for r in rows]
    assert shards.count("coco-mini-000000.tar") == 6 and shards.count("coco-mini-000001.tar") == 0
    assert 0 < shards.count("coco-mini-000002.tar") < 4  # the rows before the cut are kept, and scored


# -- outputs on the object store ------------------------------------------------------------------

def _store():
    import s3fs

    return s3fs.S3FileSystem(use_listings_cache=False)


def _local_rows(coco_shards, tmp_path) -> list[dict]:
    out = tmp_path / "local.parquet"
    score(str(coco_shards), out, _tiny())
    return pq.read_table(out).to_pylist()


def _tiny(**extra) -> ScoreConfig:
    return ScoreConfig(model="pairclean-tiny", pretrained="none", beta_k=64, workers=0, batch_size=4, seed=0,
                       group_units=1, **extra)


def _remote_rows(url: str) -> list[dict]:
    with _store().open(url.removeprefix("s3://")) as fh:
        return pq.read_table(fh).to_pylist()


def test_scores_written_to_the_store_resume_after_a_kill_and_match_the_disk(s3, coco_shards, tmp_path):
    from tests.helpers import forked

    fs, out = _store(), f"s3://{BUCKET}/runs/killed/scores.parquet"
    local = _local_rows(coco_shards, tmp_path)
    assert forked(lambda: score(str(coco_shards), out, _tiny()), "committed:2") == -9  # SIGKILL after 2 commits
    parts = fs.ls(f"{BUCKET}/runs/killed/scores.parquet.parts", detail=False)
    assert sum(p.endswith(".done.json") for p in parts) == 2 and not fs.exists(out)
    assert forked(lambda: score(str(coco_shards), out, _tiny()), "finalize-batch:1") == -9  # killed while finalizing
    assert not fs.exists(out)  # an object appears whole or not at all: nothing half-written looks complete
    result = score(str(coco_shards), out, _tiny())  # the same command: resumes
    assert result.resumed and _remote_rows(out) == local
    assert not fs.exists(f"{BUCKET}/runs/killed/scores.parquet.parts") and fs.exists(f"{BUCKET}/runs/killed/scores.run.json")
    assert score(str(coco_shards), out, _tiny()).already_complete  # and re-running it does nothing


def test_embeddings_filter_and_dedup_on_the_store(s3, coco_shards, tmp_path):
    from pairclean.dedup.run import DedupConfig, dedup
    from tests.helpers import forked

    fs, root = _store(), f"s3://{BUCKET}/flow"
    score(str(coco_shards), f"{root}/scores.parquet", _tiny(save_embeddings=f"{root}/emb"))
    score(str(coco_shards), tmp_path / "scores.parquet", _tiny(save_embeddings=str(tmp_path / "emb")))
    for sub in ("img_emb/img_emb_0.npy", "text_emb/text_emb_2.npy", "metadata/metadata_1.parquet"):
        assert fs.cat_file(f"{BUCKET}/flow/emb/{sub}") == (tmp_path / "emb" / sub).read_bytes()
    assert fs.exists(f"{BUCKET}/flow/emb/provenance.json") and not fs.exists(f"{BUCKET}/flow/emb/unfinished.json")

    # filter: the kept shards land whole; a killed upload leaves the folder marked unfinished, and refused
    where = ["--where", "sim > 0"]
    assert forked(lambda: main(["filter", f"{root}/scores.parquet", *where, "--out", f"{root}/kept"]),
                  "uploaded:1") == -9  # killed after the first object
    with pytest.raises(UserError, match="still being written"):
        open_dataset(f"{root}/kept")
    main(["filter", f"{root}/scores.parquet", *where, "--out", f"{root}/kept", "--overwrite"])
    main(["filter", str(tmp_path / "scores.parquet"), *where, "--out", str(tmp_path / "kept")])
    local_kept = sorted(str(p) for p in (tmp_path / "kept").glob("*.tar"))
    remote_kept = open_dataset(f"{root}/kept").spec.shards  # listed: the marker is gone

    def members(data: bytes) -> list[tuple[str, bytes]]:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]

    assert len(remote_kept) == len(local_kept) and [members(fs.cat_file(u.removeprefix("s3://"))) for u in remote_kept] \
        == [members(Path(p).read_bytes()) for p in local_kept]  # the same members, byte for byte
    assert not fs.exists(f"{BUCKET}/flow/kept/unfinished.json")

    # dedup: embeddings and scores read from the store, its output written there
    cfg = DedupConfig(keep="cleanest", seed=0)
    dedup(f"{root}/emb", f"{root}/dedup.parquet", f"{root}/scores.parquet", cfg)
    dedup(str(tmp_path / "emb"), tmp_path / "dedup.parquet", tmp_path / "scores.parquet", cfg)
    remote, disk = _remote_rows(f"{root}/dedup.parquet"), pq.read_table(tmp_path / "dedup.parquet").to_pylist()
    strip = lambda rows: [{**r, "shard": r["shard"].rsplit("/", 1)[-1],  # noqa: E731
                           "nearest_shard": (r["nearest_shard"] or "").rsplit("/", 1)[-1]} for r in rows]
    assert len(disk) == 16 and strip(remote) == strip(disk)


def test_a_store_that_cannot_be_written_is_refused_before_any_work(s3, coco_shards, tmp_path, monkeypatch, capsys):
    from tests.helpers import run_cli

    argv = ["score", str(coco_shards), *TINY]
    code, _, err = run_cli([*argv, "--out", "s3://no-such-bucket-here/s.parquet"], capsys)
    assert code == 2 and "the bucket 'no-such-bucket-here' does not exist" in err and "--out" in err
    assert len(err.strip().splitlines()) == 1
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    import fsspec

    fsspec.filesystem("s3").clear_instance_cache()
    code, _, err = run_cli([*argv, "--out", f"s3://{BUCKET}/nocreds/s.parquet"], capsys)
    assert code == 2 and "cannot reach the object store" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli([*argv, "--out", str(tmp_path / "s.parquet"), "--save-embeddings", f"s3://{BUCKET}/e"], capsys)
    assert code == 2 and "--save-embeddings" in err and "cannot reach the object store" in err, err
    assert not list(tmp_path.glob("*.parquet*"))
