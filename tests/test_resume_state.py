"""A killed run's state is validated against itself before a resume trusts it (issue 25, class 5).

`<out>.parts/` holds what a resumed run continues from (units.json, groups.json, beta.json,
settings.json, run.json, claims/, the commit records). Each case below damages one file of a real
SIGKILLed `pairclean score` run and re-runs the same command: one line naming --overwrite, exit 2,
nothing in the parts directory touched, no output; `--overwrite` then starts over and finishes.
A damaged commit record is not an error: its unit is redone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from helpers import killed_after_first_unit, refused, run_cli, snapshot
from pairclean.cli import main
from pairclean.runs import parts_dir_for

TINY = ["--model", "pairclean-tiny", "--pretrained", "none", "--beta-k", "64", "--workers", "0", "--batch-size", "8"]


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, coco_shards):
    """A `pairclean score` run SIGKILLed after its second part: (its argv, a pristine copy of its parts)."""
    root = tmp_path_factory.mktemp("killed")
    argv = ["score", str(coco_shards), *TINY, "--out", str(root / "scores.parquet")]
    killed_after_first_unit(lambda: main(argv))
    pristine = root / "pristine"
    shutil.copytree(parts_dir_for(root / "scores.parquet"), pristine)
    return argv, pristine


@pytest.fixture
def damaged(killed_run, tmp_path):
    """The killed run again, in this test's own directory: (argv, parts directory)."""
    argv, pristine = killed_run
    out = tmp_path / "scores.parquet"
    parts = parts_dir_for(out)
    shutil.copytree(pristine, parts)
    return [*argv[:-1], str(out)], parts


def _groups(parts: Path) -> list:
    return json.loads((parts / "groups.json").read_text())


CASES = {
    "groups: empty list": ("groups.json", lambda p: []),
    "groups: a subset": ("groups.json", lambda p: [g[:-1] for g in _groups(p)]),
    "groups: a dict": ("groups.json", lambda p: {str(i): g for i, g in enumerate(_groups(p))}),
    "groups: numbers": ("groups.json", lambda p: [[1, 2]]),
    "groups: a unit twice": ("groups.json", lambda p: [*_groups(p), _groups(p)[0][:1]]),
    "groups: a foreign unit": ("groups.json", lambda p: [[*_groups(p)[0], "/elsewhere/x.tar"], *_groups(p)[1:]]),
    "units: a dict": ("units.json", lambda p: {"a": 1}),
    "units: numbers": ("units.json", lambda p: [1, 2]),
    "beta: a string": ("beta.json", lambda p: {"mode": "random-inputs", "beta": "0.2"}),
    "beta: infinite": ("beta.json", lambda p: {"mode": "random-inputs", "beta": float("inf")}),
    # issue 55: in range, not only of their type (before: accepted, the scores written with them)
    "beta: above 1": ("beta.json", lambda p: {"mode": "random-inputs", "beta": 3.0, "std": 0.1, "k": 64}),
    "beta: k 0": ("beta.json", lambda p: {"mode": "random-inputs", "beta": 0.2, "std": 0.1, "k": 0}),
    "beta: std negative": ("beta.json", lambda p: {"mode": "random-inputs", "beta": 0.2, "std": -0.5, "k": 64}),
    "settings: a list": ("settings.json", lambda p: []),
    "run: a list": ("run.json", lambda p: [1]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_resume_state_is_refused_naming_overwrite(damaged, capsys, case):
    argv, parts = damaged
    name, value = CASES[case]
    (parts / name).write_text(json.dumps(value(parts), allow_nan=True))
    err = refused(argv, capsys, parts, message="--overwrite")
    assert "is not a valid record of the unfinished run" in err and name in err, err
    assert not Path(argv[-1]).exists()
    assert run_cli([*argv, "--overwrite"], capsys)[0] == 0
    assert pq.read_metadata(argv[-1]).num_rows == 16


def test_a_claims_file_in_place_of_the_claims_directory_is_refused(damaged, capsys):
    argv, parts = damaged
    shutil.rmtree(parts / "claims", ignore_errors=True)
    (parts / "claims").write_text("not a directory")
    refused(argv, capsys, parts, message="--overwrite")


def test_a_damaged_commit_record_only_redoes_its_unit(damaged, capsys):
    argv, parts = damaged
    records = sorted(parts.glob("part-*.done.json"))
    assert records
    before = snapshot(parts)
    for record, value in zip(records, [{"unit": 3}, ["x"], {"unit": "elsewhere", "rows": 1, "errors": 0}]):
        record.write_text(json.dumps(value))
    assert snapshot(parts) != before
    assert run_cli(argv, capsys)[0] == 0
    assert pq.read_metadata(argv[-1]).num_rows == 16


def _parts_by_unit(parts: Path) -> dict[str, Path]:
    """Each committed unit's part file, by unit (from its commit record)."""
    return {json.loads(r.read_text())["unit"]: r.with_name(r.name.replace(".done.json", ".parquet"))
            for r in sorted(parts.glob("part-*.done.json"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, coco_shards):
    out = tmp_path_factory.mktemp("uninterrupted") / "scores.parquet"
    main(["score", str(coco_shards), *TINY, "--out", str(out)])
    return pq.read_table(out).to_pylist()


@pytest.mark.parametrize("damage", ["truncated", "miscounted", "swapped"])
def test_parts_that_do_not_hold_what_their_records_say_are_scored_again(damaged, reference, capsys, damage):
    """A committed part cut short, a commit record whose row count is off, a part replaced by another
    unit's: each unit is scored again (a warning says so), never trusted, never a crash."""
    argv, parts = damaged
    by_unit = _parts_by_unit(parts)  # the killed run committed one unit and wrote another's part
    assert len(by_unit) == 1
    (first, first_part), = by_unit.items()
    second_part, = [p for p in parts.glob("part-*.parquet") if p != first_part]
    if damage == "truncated":
        first_part.write_bytes(first_part.read_bytes()[:-100])
    elif damage == "miscounted":
        record = first_part.with_name(first_part.name.replace(".parquet", ".done.json"))
        value = json.loads(record.read_text())
        record.write_text(json.dumps({**value, "rows": value["rows"] - 1}))
    else:
        shutil.copyfile(second_part, first_part)  # a part of the right shape, of another unit
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "1 committed part(s)" in err and "scored again" in err, err
    assert pq.read_table(argv[-1]).to_pylist() == reference  # no row lost, none twice


def test_a_parts_directory_that_is_a_link_is_refused_and_its_target_left_alone(coco_shards, tmp_path, capsys):
    keep = tmp_path / "my-folder"
    (keep / "sub").mkdir(parents=True)
    (keep / "notes.txt").write_text("mine")
    (keep / "sub" / "data.bin").write_bytes(b"\x00" * 10)
    out = tmp_path / "scores.parquet"
    parts_dir_for(out).symlink_to(keep, target_is_directory=True)
    err = refused(["score", str(coco_shards), *TINY, "--out", str(out)], capsys, keep, message="symbolic link")
    assert "--out" in err and not out.exists()
    err = refused(["score", str(coco_shards), *TINY, "--out", str(out), "--overwrite"], capsys, keep,
                  message="symbolic link")
    assert (keep / "notes.txt").read_text() == "mine"
