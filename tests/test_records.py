"""The records later commands read back (issue 33, class "a record is an input"): a scores file's
provenance and summary, the dataset it recorded, a saved-embeddings directory's provenance.json
and a run's resume state are frozen dataclasses with a strict JSON round trip, and the files the
code before them wrote (tests/data/records-a6e2769: written by a6e2769, see its PROVENANCE.md)
still open."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import exit_code, run_cli

from pairclean.data.embeddings import SavedEmbeddings, read_saved_provenance
from pairclean.data.record import DatasetRecord, FileFingerprint
from pairclean.ops.records import RecordError
from pairclean.scorefile.contract import METADATA_KEY, SUMMARY_KEY, Provenance, Summary, read_metadata

OLD = Path(__file__).parent / "data" / "records-a6e2769"
PACKAGE = Path(__file__).parents[1] / "pairclean"


def without_nulls(value):
    """JSON with the null-valued keys dropped (a record leaves out what is None by default)."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def raw_metadata(path: Path) -> tuple[dict, dict]:
    meta = pq.read_metadata(path)
    return json.loads(meta.schema.to_arrow_schema().metadata[METADATA_KEY]), json.loads(meta.metadata[SUMMARY_KEY])


@pytest.mark.parametrize("name", ["scores.parquet", "emb-scores.parquet"])
def test_scores_files_written_before_read_back_whole(name):
    provenance, summary = read_metadata(OLD / name)
    raw_provenance, raw_summary = raw_metadata(OLD / name)
    assert without_nulls(provenance.to_json()) == without_nulls(raw_provenance)
    assert without_nulls(summary.to_json()) == without_nulls(raw_summary)  # flagged_NAME keys and the rules' notes
    assert Provenance.from_json(provenance.to_json(), "again") == provenance
    assert Summary.from_json(summary.to_json(), "again") == summary
    assert summary.flagged["gmm"] == 12 and summary.rules[1].notes["separates"] is True
    assert provenance.dataset.files is None  # written before fingerprints: nothing to compare, nothing refused


def test_commands_open_files_written_before(tmp_path, capsys):
    code, out, err = run_cli(["query", OLD / "scores.parquet", "SELECT count(*) AS n FROM scores"], capsys)
    assert code == 0 and "16" in out, err
    code, out, err = run_cli(["report", OLD / "scores.parquet", "--out", tmp_path / "r.html"], capsys)
    assert code == 0 and "16 pairs" in out, err  # (its dataset was in a temp directory: no thumbnails)
    saved = Path(shutil.copytree(OLD / "saved-embeddings", tmp_path / "emb"))
    assert read_saved_provenance(saved).rows == 16
    code, out, err = run_cli(["score", saved, "--from-embeddings", "--out", tmp_path / "s.parquet"], capsys)
    assert code == 0 and "recorded with the embeddings" in out, err


def test_a_fresh_run_records_fingerprints_and_round_trips(coco_scores, coco_shards):
    provenance, summary = read_metadata(coco_scores)
    files = provenance.dataset.files
    assert sorted(f.name for f in files) == sorted(p.name for p in coco_shards.glob("*.tar"))
    assert all(f == FileFingerprint.of(f.path) for f in files)
    for record in (provenance, summary, provenance.dataset):
        assert type(record).from_json(json.loads(record.dumps()), "again") == record


def _scores_with(tmp_path: Path, coco_scores: Path, edit) -> Path:
    """coco_scores with its provenance JSON edited by `edit`."""
    raw, _ = raw_metadata(coco_scores)
    edit(raw)
    table = pq.read_table(coco_scores)
    out = tmp_path / "edited.parquet"
    metadata = {**table.schema.metadata, METADATA_KEY: json.dumps(raw).encode()}
    pq.write_table(table.replace_schema_metadata(metadata), out)
    return out


@pytest.mark.parametrize("edit,field", [
    (lambda p: p.update(beta=float("nan")), "beta"),
    (lambda p: p.update(beta="0.2"), "beta"),
    (lambda p: p.update(surprise=1), "surprise"),
    (lambda p: p["dataset"].update(sources="/data"), "dataset.sources"),
    (lambda p: p["dataset"].update(pair="text-image"), "dataset.pair"),
    (lambda p: p["rules"][0].update(threshold=float("inf")), "rules[0].threshold"),
    (lambda p: p["gmm"].update(n_fit=1.5), "gmm.n_fit"),
    (lambda p: p["estimator"].update(image_size=float("nan")), "estimator.image_size"),
    (lambda p: p["dataset"]["files"][0].update(size=-1), "dataset.files[0].size"),
    (lambda p: p.update(beta=1.5), "beta"),  # issue 55: in range, not only of their type
    (lambda p: p.update(beta_k=0), "beta_k"),
    (lambda p: p.update(beta_std=-0.1), "beta_std"),
], ids=["nan", "string", "unknown", "sources", "pair", "threshold-inf", "n_fit", "estimator-nan", "size", "beta-1.5",
        "beta_k-0", "beta_std-negative"])
def test_a_provenance_is_read_as_strictly_as_a_flag(tmp_path, coco_scores, capsys, edit, field):
    edited = _scores_with(tmp_path, coco_scores, edit)
    with pytest.raises(RecordError) as error:
        read_metadata(edited)
    assert error.value.field == field and str(edited) in str(error.value) and len(str(error.value).splitlines()) == 1
    code, _, err = run_cli(["report", edited, "--out", tmp_path / "r.html"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and field in err and str(edited) in err
    assert not (tmp_path / "r.html").exists()


def test_other_outputs_of_pairclean_are_not_taken_for_scores(tmp_path, coco_scores):
    """A dedup output (its provenance names its `kind`) is no scores file, and no scores file a dedup output."""
    from pairclean.dedup.run import read_dedup_metadata
    from pairclean.scorefile.contract import is_scores_file

    dedup_like = _scores_with(tmp_path, coco_scores, lambda p: p.update(kind="dedup"))
    assert read_metadata(dedup_like) == (None, None) and not is_scores_file(dedup_like)
    assert read_dedup_metadata(coco_scores) == (None, None)


def test_dataset_records_compare_by_file_name_size_and_first_bytes(tmp_path):
    for name, data in (("a.tar", b"x" * 10), ("b.tar", b"y" * 10), ("c.tar", b"z" * 12)):
        (tmp_path / name).write_bytes(data)
    files = [FileFingerprint.of(str(tmp_path / n)) for n in ("a.tar", "b.tar")]
    record = DatasetRecord(format="webdataset", sources=[str(tmp_path)], files=files)
    moved = replace(record, files=[replace(f, path=f"/elsewhere/{f.name}") for f in files])
    assert record.conflict(moved) is None and record.conflict(replace(record, files=files[:1])) is None
    other = replace(record, files=[files[0], replace(files[1], head_sha1="0" * 40)])
    assert record.conflict(other) == "b.tar: the same size, other bytes"
    assert record.conflict(replace(record, files=None)) is None  # an older record: nothing to compare


def test_no_typed_dict_is_left_for_a_record():
    assert not [p for p in PACKAGE.rglob("*.py") if "TypedDict" in p.read_text()]


def test_saved_embeddings_provenance_written_now_reads_back(tmp_path, coco_shards, capsys):
    emb = tmp_path / "emb"
    assert exit_code(["score", coco_shards, "--out", tmp_path / "s.parquet", "--save-embeddings", emb, "--model",
                      "pairclean-tiny", "--pretrained", "none", "--beta-k", "16", "--workers", "0"]) == 0
    saved = read_saved_provenance(emb)
    assert SavedEmbeddings.from_json(json.loads((emb / "provenance.json").read_text()), "again") == saved
    assert saved.dataset.files and sum(b.rows for b in saved.blocks.values()) == saved.rows == 16
    assert not (emb / "unfinished.json").exists()


@pytest.mark.parametrize("edit, field", [({"k": 0}, "beta.k"), ({"std": -1.0}, "beta.std"), ({"beta": -7.0}, "beta.beta")])
def test_a_saved_beta_out_of_range_is_refused(tmp_path, capsys, edit, field):
    """Issue 55: provenance.json's beta, its K and std are held to their ranges where it is read
    (before: `k` 0 and `std` -1 were taken, and the beta reused by --from-embeddings)."""
    saved = Path(shutil.copytree(OLD / "saved-embeddings", tmp_path / "emb"))
    provenance = json.loads((saved / "provenance.json").read_text())
    provenance["beta"].update(edit)
    (saved / "provenance.json").write_text(json.dumps(provenance))
    code, _, err = run_cli(["score", saved, "--from-embeddings", "--out", tmp_path / "s.parquet"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"{saved / 'provenance.json'} is not a valid saved-embeddings provenance ({field}: must be" in err
    assert not (tmp_path / "s.parquet").exists()


def test_a_saved_directory_without_its_provenance_is_read_with_a_warning(tmp_path, capsys):
    """A --save-embeddings run of an older pairclean, killed: no unfinished.json to refuse it by,
    but its metadata says pairclean wrote it, so the warning names the directory."""
    saved = Path(shutil.copytree(OLD / "saved-embeddings", tmp_path / "emb"))
    (saved / "provenance.json").unlink()
    code, _, err = run_cli(["score", saved, "--from-embeddings", "--beta-mode", "fixed", "--beta", "0", "--out",
                            tmp_path / "s.parquet"], capsys)
    assert code == 0 and f"warning: {saved} has no provenance.json" in err and "did not finish" in err, err
