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
