"""Every output of every command goes through the output guard (`ops.guard.open_output`).

The command line is walked (typer's own command tree): every option that names an output must
have a case below in which that output would equal, contain or lie inside one of the command's
inputs (or replace an existing file without `--overwrite`), and each case must be refused with
one line (exit 2) with every input byte-identical afterwards. A new command with an output option
and no case fails `test_every_output_option_has_a_case`: it cannot forget the guard.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import typer

from helpers import refused, run_cli, snapshot
from pairclean.errors import ConfigError
from pairclean.ops.guard import open_output
from pairclean.ops.urls import local_path

TINY = ["--model", "pairclean-tiny", "--pretrained", "none", "--beta-k", "64", "--workers", "0"]
OUTPUT_FLAGS = {"--out", "--json", "--output"}
WRITES = re.compile(r"\bto write\b|^(also )?write\b|^directory for|^run directory", re.IGNORECASE)


def annotation(param):
    """The Python type an option declares (typer >= 0.22 keeps it on the parameter; older typer
    leaves a click type), Optional[...] unwrapped."""
    import typing

    declared = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if declared is None:
        name = getattr(getattr(param, "type", None), "name", "")
        return {"path": Path, "integer": int, "float": float, "boolean": bool, "text": str}.get(name)
    args = [a for a in typing.get_args(declared) if a is not type(None)]
    return args[0] if typing.get_origin(declared) in (typing.Union, getattr(__import__("types"), "UnionType", None))\
        and len(args) == 1 else declared


def output_options() -> set[tuple[str, str]]:
    """(command path, flag) of every option that names an output: flagged --out / --json, or a
    path option whose help says it is written."""
    from pairclean.cli import _register_commands, app

    _register_commands()
    found = set()

    def walk(command, path):
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
            return
        for mode in command.modes() if hasattr(command, "modes") else ():
            walk(mode.command, [*path, mode.flag])  # `score --from-embeddings`: a mode with its own options
        for param in command.get_params(command.context_class(command)):
            if param.param_type_name != "option":
                continue
            long = max(param.opts, key=len)
            is_path = annotation(param) is Path or param.metavar in ("PATH", "DIR")  # a str option: a URL too
            if OUTPUT_FLAGS & set(param.opts) or (is_path and WRITES.search(param.help or "")):
                found.add((" ".join(path), long))

    walk(typer.main.get_command(app), [])
    return found


@dataclass
class World:
    """Private copies of every kind of input, so that a command that wrongly replaces one harms only these."""

    root: Path
    shards: Path  # WebDataset shards + manifest.yaml
    scores: Path
    truth: Path
    pairs: Path  # a Parquet dataset
    coco: Path  # a COCO-mini source directory (pairs.jsonl + images)
    captions: Path  # a COCO captions JSON
    marks: Path  # an audit export
    run: Path  # a training run directory

    @property
    def scored(self) -> Path:
        """A directory holding only a copy of the scores."""
        directory = self.root / "scored"
        if not directory.exists():
            directory.mkdir()
            shutil.copy(self.scores, directory / "scores.parquet")
        return directory

    @property
    def scored_here(self) -> Path:
        """Scores of this world's own shards: the dataset they record is `shards`."""
        scores = self.root / "scored-here.parquet"
        if not scores.exists():
            from helpers import tiny_scores

            tiny_scores(self.shards, scores)
        return scores

    @property
    def shard(self) -> Path:
        return sorted(self.shards.glob("*.tar"))[0]

    @property
    def embeddings(self) -> Path:
        """A clip-retrieval embeddings directory (what `pairclean dedup` reads)."""
        directory = self.root / "emb"
        if not directory.exists():
            import numpy as np

            from pairclean.data.embeddings import write_embeddings

            x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
            write_embeddings(directory, [(x, x, [f"k{i}" for i in range(8)])])
        return directory


@pytest.fixture
def world(tmp_path, coco_shards, coco_scores, truth, coco_parquet, coco_src) -> World:
    root = tmp_path / "in"
    root.mkdir()
    captions = root / "captions" / "captions_val2017.json"
    captions.parent.mkdir()
    captions.write_text(json.dumps({"annotations": [{"image_id": 1, "caption": "a cat"},
                                                    {"image_id": 1, "caption": "a small cat"}]}))
    marks = root / "marks.json"
    rows = pq.read_table(coco_scores, columns=["key", "shard", "index"]).to_pylist()[:4]
    marks.write_text(json.dumps([{**r, "mark": "drop" if i % 2 else "keep"} for i, r in enumerate(rows)]))
    run = root / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"settings": {}, "target": {"backend": "open_clip"}}))
    return World(root, Path(shutil.copytree(coco_shards, root / "shards")),
                 Path(shutil.copy(coco_scores, root / "scores.parquet")),
                 Path(shutil.copy(truth, root / "truth.parquet")), Path(shutil.copy(coco_parquet, root / "pairs.parquet")),
                 Path(shutil.copytree(coco_src, root / "coco-mini")), captions, marks, run)


# (command, flag) -> the cases: (argv, message). Every input of `world` must survive each.
CASES = {
    ("score", "--save-embeddings"): lambda w: [
        (["score", w.shards, *TINY, "--out", w.root.parent / "s.parquet", "--save-embeddings", w.shard],
         "is an input"),
        (["score", w.shards, *TINY, "--out", w.root.parent / "s.parquet", "--save-embeddings", w.root],
         "contains the input"),
        (["score", w.shards, *TINY, "--out", w.root.parent / "s.parquet", "--save-embeddings", w.shards],
         "is an input"),
        (["score", w.shards, *TINY, "--out", w.root.parent / "s.parquet", "--save-embeddings", w.shards / "emb"],
         "inside the input directory"),
    ],
    ("score --from-embeddings", "--out"): lambda w: [
        (["score", "--from-embeddings", w.embeddings, "--beta-mode", "fixed", "--beta", "0.2", "--out",
          w.embeddings / "img_emb" / "img_emb_0.npy", "--overwrite"], "is an input"),
        (["score", "--from-embeddings", w.embeddings, "--beta-mode", "fixed", "--beta", "0.2", "--out",
          w.embeddings / "s.parquet"], "inside the input directory"),
    ],
    ("dedup", "--out"): lambda w: [
        (["dedup", w.embeddings / "img_emb" / "img_emb_0.npy", w.embeddings / "text_emb" / "text_emb_0.npy",
          "--keep", "random", "--out", w.embeddings / "text_emb" / "text_emb_0.npy"], "is an input"),
        (["dedup", w.embeddings, "--keep", "random", "--out", w.embeddings / "dedup.parquet"],
         "inside the input directory"),
        (["dedup", w.embeddings, "--scores", w.scores, "--out", w.scores], "is an input"),
    ],
    ("evaluate dedup", "--json"): lambda w: [
        (["evaluate", "dedup", w.scores, "--truth", w.truth, "--json", w.truth], "is an input"),
        (["evaluate", "dedup", w.scores, "--truth", w.truth, "--json", w.scores], "is an input"),
        (["evaluate", "dedup", w.scores, "--truth", w.truth, "--json", w.marks], "exists; pass --overwrite"),
    ],
    ("score", "--out"): lambda w: [
        # the case: a file:// spelling of the dataset it reads
        (["score", f"file://{w.pairs}", *TINY, "--out", w.pairs, "--overwrite"], "is an input"),
        (["score", w.shards, *TINY, "--out", w.shard, "--overwrite"], "is an input"),
        (["score", w.shard, *TINY, "--out", w.root, "--overwrite"], "contains the input"),
    ],
    ("filter", "--out"): lambda w: [
        (["filter", w.shards, "--scores", w.scores, "--where", "true", "--out", w.shards, "--overwrite"], "is an input"),
        (["filter", w.shards, "--scores", w.scores, "--where", "true", "--out", w.scores, "--overwrite"], "is an input"),
    ],
    ("filter", "--keys-out"): lambda w: [
        (["filter", w.scores, "--where", "true", "--keys-out", w.scores, "--overwrite"], "is an input"),
        (["filter", w.scores, "--where", "true", "--keys-out", w.marks], "exists; pass --overwrite"),
    ],
    ("corrupt", "--out"): lambda w: [
        (["corrupt", w.shards, "--ratio", "0.5", "--out", w.root, "--overwrite"], "contains the input"),
        (["corrupt", w.shards, "--mode", "duplicate", "--ratio", "0.5", "--out", w.shards, "--overwrite"],
         "is an input"),
    ],
    ("train", "--out"): lambda w: [
        (["train", w.shards, *TINY[:4], "--workers", "0", "--out", w.shards, "--overwrite"], "is an input"),
        (["train", w.shards, *TINY[:4], "--workers", "0", "--weights", w.scored / "scores.parquet", "--out", w.scored,
          "--overwrite"], "contains the input"),
    ],
    ("report", "--out"): lambda w: [
        (["report", w.scores, "--out", w.scores], "is an input"),
        (["report", w.scores, "--truth", w.truth, "--out", w.truth], "is an input"),
        (["report", w.scored_here, "--out", w.shards / "r.html"], "inside the input directory"),  # its manifest's
    ],
    ("query", "--out"): lambda w: [
        (["query", w.scores, "SELECT 1", "--format", "csv", "--out", w.scores], "is an input"),
        (["query", w.scores, "--file", w.marks, "--format", "csv", "--out", f"file://{w.marks}"], "is an input"),
        # issue 55: the dataset the scores recorded is an input too (before: a shard replaced, or a
        # Parquet written among the shards that the next `score` read as one)
        (["query", w.scored_here, "SELECT 1", "--format", "parquet", "--out", w.shard, "--overwrite"], "is an input"),
        (["query", w.scored_here, "SELECT 1", "--format", "parquet", "--out", w.shards / "x.parquet"],
         "inside the input directory"),
    ],
    ("audit", "--out"): lambda w: [
        (["audit", w.scores, "--shards", w.shards, "--out", w.scores], "is an input"),
        (["audit", w.scores, "--shards", w.shards, "--out", w.shard], "is an input"),
        (["audit", w.scores, "--shards", w.shards, "--out", w.shards / "audit.html"], "inside the input directory"),
        (["audit", w.scores, "--shards", w.shards, "--out", w.run], "is a directory"),  # was IsADirectoryError
        (["audit", w.scored_here, "--out", w.shards / "audit.html"], "inside the input directory"),
    ],
    ("audit-import", "--out"): lambda w: [
        (["audit-import", w.marks, "--out", w.scores], "exists; pass --overwrite"),  # the scores it replaced
        (["audit-import", w.marks, "--out", w.marks], "is an input"),
    ],
    ("evaluate detection", "--json"): lambda w: [
        (["evaluate", "detection", w.scores, "--truth", w.truth, "--json", w.scores], "is an input"),
        (["evaluate", "detection", w.scores, "--truth", w.truth, "--json", w.truth], "is an input"),
        (["evaluate", "detection", w.scores, "--truth", w.truth, "--json", w.marks], "exists; pass --overwrite"),
        (["evaluate", "detection", w.scored_here, "--truth", w.truth, "--json", w.shard, "--overwrite"], "is an input"),
        (["evaluate", "detection", w.scored_here, "--truth", w.truth, "--json", w.shards / "d.json"],
         "inside the input directory"),
    ],
    ("evaluate retrieval", "--json"): lambda w: [
        (["evaluate", "retrieval", w.shards, "--model", w.run, "--json", w.run / "metrics.json"],
         "inside the input directory"),
    ],
    ("bench score", "--json"): lambda w: [
        (["bench", "score", w.shards, *TINY[:4], "--json", w.shard], "is an input"),
    ],
    ("demo", "--out"): lambda w: [
        (["demo", "--out", os.environ["PAIRCLEAN_CACHE_DIR"]], "is an input"),  # the estimator cache it reads
        (["demo", "--out", w.shards], "not a demo output"),
    ],
    ("synth toy-world", "--out"): lambda w: [
        (["synth", "toy-world", "--out", w.shards, "--pairs", "4"], "exists and is not empty; pass --overwrite"),
    ],
    ("synth coco-mini", "--out"): lambda w: [
        # the case: the source images replaced by shards
        (["synth", "coco-mini", "--src", w.coco, "--out", w.coco, "--overwrite"], "is an input"),
        (["synth", "coco-mini", "--src", w.coco, "--out", w.coco / "x.parquet", "--parquet"],
         "inside the input directory"),
    ],
    ("synth web-shards", "--out"): lambda w: [
        (["synth", "web-shards", "--src", w.coco, "--out", w.root, "--overwrite"], "contains the input"),
    ],
    ("synth train-estimator", "--out"): lambda w: [
        (["synth", "train-estimator", "--world", w.shards, "--out", w.shards, "--overwrite"], "is an input"),
    ],
    ("synth coco-text", "--out"): lambda w: [
        (["synth", "coco-text", "--src", w.captions, "--out", w.captions.parent, "--overwrite"], "contains the input"),
    ],
    ("synth toy-pairs", "--out"): lambda w: [
        (["synth", "toy-pairs", "image-label", "--out", w.shards, "--pairs", "4"],
         "exists and is not empty; pass --overwrite"),
    ],
}


def test_every_output_option_has_a_case():
    assert output_options() == set(CASES)


@pytest.mark.parametrize("command, flag", sorted(CASES), ids=lambda v: str(v))
def test_every_output_is_guarded(world, capsys, command, flag):
    for argv, message in CASES[(command, flag)](world):
        assert command.split() == [str(a) for a in argv[:len(command.split())]] and flag in argv
        refused(argv, capsys, world.root, Path(os.environ["PAIRCLEAN_CACHE_DIR"]), message=message)


def test_train_overwrite_deletes_only_a_training_run(world, capsys):
    """`train --out X --overwrite` used to delete any directory holding a run.json: a scoring run's parts."""
    parts = world.root / "s.parquet.parts"
    parts.mkdir()
    (parts / "run.json").write_text(json.dumps({"run_id": "abc", "replaces_output": False}))
    (parts / "units.json").write_text("[]")
    refused(["train", world.shards, *TINY[:4], "--workers", "0", "--out", parts, "--overwrite"], capsys, parts,
            message="holds no pairclean training run")


def test_local_url_spellings_name_the_local_file(tmp_path):
    path = tmp_path / "d.parquet"
    assert local_path(f"file://{path}") == str(path)
    assert local_path(f"simplecache::file://{path}") == str(path)
    assert local_path(str(path)) == str(path)
    assert local_path("s3://bucket/d.parquet") is None and local_path("pipe:cat x") is None
    path.write_text("x")
    with pytest.raises(ConfigError, match="is an input"):
        open_output(path, [f"file://{path}"], overwrite=True)


def test_a_failed_write_leaves_the_existing_output_as_it_was(tmp_path):
    out = tmp_path / "report.html"
    out.write_text("the earlier report")
    target = open_output(out, [], overwrite=True)
    with pytest.raises(RuntimeError), target.write() as tmp:
        tmp.write_text("half a page")
        raise RuntimeError("killed")
    assert out.read_text() == "the earlier report" and [p.name for p in tmp_path.iterdir()] == ["report.html"]
    with target.write() as tmp:
        tmp.write_text("the new report")
    assert out.read_text() == "the new report"


def test_an_existing_output_is_replaced_only_with_overwrite(world, tmp_path, capsys):
    out = tmp_path / "truth.parquet"
    assert run_cli(["audit-import", world.marks, "--out", out], capsys)[0] == 0
    before = snapshot(out)
    refused(["audit-import", world.marks, "--out", out], capsys, out, message="pass --overwrite")
    assert snapshot(out) == before
    assert run_cli(["audit-import", world.marks, "--out", out, "--overwrite"], capsys)[0] == 0
