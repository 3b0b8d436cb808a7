"""Every number a user gives is declared once (type and bounds) and checked by one checker
(`config.check_value`), with exit 2 naming the option (issue 25, class 4); parsed input files are
typed strictly with size caps.

The declarations are found by walking: every config dataclass, every training method's Options,
every decision rule's options, every numeric option of every command. A new setting without a
declaration, or a new command whose numbers are not refused at the edge, fails here.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pkgutil
import shutil
from pathlib import Path

import numpy as np
import pytest
import typer

import pairclean
from helpers import refused, run_cli
from pairclean.config import Declared, declarations, parse_value
from pairclean.data.embeddings import write_embeddings
from pairclean.errors import ConfigError
from test_outputs import annotation

HUGE = str(2**70)


def config_classes() -> list[type]:
    """Every dataclass of the package that holds settings: *Config, *Options, *Recipe."""
    found = {}
    for module in pkgutil.walk_packages(pairclean.__path__, "pairclean."):
        if module.name.startswith("pairclean.cli") or module.name.endswith("__main__"):
            continue
        for value in vars(importlib.import_module(module.name)).values():
            if dataclasses.is_dataclass(value) and isinstance(value, type) and value.__module__ == module.name \
                    and value.__name__.endswith(("Config", "Options", "Recipe")):
                found[value.__qualname__] = value
    return list(found.values())


def test_every_numeric_setting_is_declared():
    from pairclean.config import _resolved, _unwrap
    from pairclean.scorefile.rules import REGISTRY
    from pairclean.training import METHODS

    def numeric(f, cls) -> bool:
        try:
            return _unwrap(_resolved(f.type, cls))[0] in (int, float)
        except NameError:  # a type imported for type checking only: not a number
            return False

    classes = config_classes()
    assert {"RunConfig", "ScoreConfig", "EmbeddingScoreConfig", "DedupConfig", "TrainConfig", "DemoConfig", "EstimatorRecipe",
            "GscOptions", "SpsOptions", "DiffnclOptions", "SddOptions", "OsaOnlineOptions"} <= {c.__name__ for c in classes}
    assert {m.Options for m in METHODS.values()} <= set(classes)
    undeclared = [f"{cls.__name__}.{f.name}" for cls in classes for f in dataclasses.fields(cls)
                  if numeric(f, cls) and f.name not in declarations(cls)]
    assert not undeclared
    assert all(isinstance(d, Declared) for rule in REGISTRY.values() for d in rule.OPTIONS.values())


def hostile(declared: Declared) -> list[str]:
    """Values each declared number must refuse: non-finite or fractional, too large, below its bounds."""
    values = ["nan", "inf", "-inf"] if declared.kind is float else ["1.9", "1e3", HUGE, "true"]
    low = declared.bounds.low
    if low is not None:
        values.append(str(low if declared.bounds.low_open else low - 1))
    return values


def test_every_method_option_refuses_what_its_declaration_excludes():
    from pairclean.training import METHODS
    from pairclean.training.methods import build_method

    checked = 0
    for name, cls in METHODS.items():
        for option, declared in declarations(cls.Options).items():
            for value in hostile(declared):
                with pytest.raises(ConfigError) as refusal:
                    build_method(name, {option: value})
                assert refusal.value.fields == (option,) and option in str(refusal.value), (name, option, value)
                checked += 1
    assert checked > 100


@pytest.mark.parametrize("text, declared, message", [
    ("0.1", Declared(float, pairclean.config.within(0, 1)), None),
    ("7", Declared(int, pairclean.config.at_least(1)), None),
    ("none", Declared(float, pairclean.config.above(0), optional=True), None),
    ("1.9", Declared(int), "must be an integer"),
    ("2", Declared(float, pairclean.config.within(0, 1)), "within [0, 1]"),
    ("nan", Declared(float), "finite"),
    (HUGE, Declared(int), "within [-9223372036854775807"),
])
def test_parse_value(text, declared, message):
    if message is None:
        assert parse_value(text, declared, "x") == (None if text == "none" else declared.kind(text))
    else:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
            parse_value(text, declared, "x")


# -- every numeric option of every command ------------------------------------------------------------

@pytest.fixture
def data(tmp_path, coco_shards, coco_scores, coco_src):
    root = tmp_path / "in"
    root.mkdir()
    shards = Path(shutil.copytree(coco_shards, root / "shards"))
    scores = Path(shutil.copy(coco_scores, root / "scores.parquet"))
    captions = root / "captions.json"
    captions.write_text(json.dumps({"annotations": [{"image_id": 1, "caption": "a"}, {"image_id": 1, "caption": "b"}]}))
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    embeddings = write_embeddings(root / "emb", [(x, x, [f"k{i}" for i in range(8)])])
    return {"shards": shards, "scores": scores, "coco": coco_src, "captions": captions, "embeddings": embeddings,
            "out": tmp_path / "out"}


TINY = ["--model", "pairclean-tiny", "--pretrained", "none", "--workers", "0"]
BASE = {  # a command that would run, given valid numbers
    "score": lambda d: ["score", d["shards"], *TINY, "--out", d["out"]],
    "score --from-embeddings": lambda d: ["score", "--from-embeddings", d["embeddings"], "--beta-mode", "fixed",
                                          "--beta", "0.2", "--out", d["out"]],
    "train": lambda d: ["train", d["shards"], *TINY, "--out", d["out"]],
    "bench score": lambda d: ["bench", "score", d["shards"], *TINY],
    "evaluate retrieval": lambda d: ["evaluate", "retrieval", d["shards"], "--model", d["out"]],
    "filter": lambda d: ["filter", d["shards"], "--scores", d["scores"], "--where", "true", "--out", d["out"]],
    "corrupt": lambda d: ["corrupt", d["shards"], "--ratio", "0.5", "--out", d["out"]],
    "report": lambda d: ["report", d["scores"], "--out", d["out"]],
    "query": lambda d: ["query", d["scores"], "SELECT 1"],
    "audit": lambda d: ["audit", d["scores"], "--shards", d["shards"], "--out", d["out"]],
    "demo": lambda d: ["demo", "--out", d["out"]],
    "synth toy-world": lambda d: ["synth", "toy-world", "--out", d["out"]],
    "synth coco-mini": lambda d: ["synth", "coco-mini", "--src", d["coco"], "--out", d["out"]],
    "synth web-shards": lambda d: ["synth", "web-shards", "--src", d["coco"], "--out", d["out"]],
    "synth train-estimator": lambda d: ["synth", "train-estimator", "--out", d["out"]],
    "synth coco-text": lambda d: ["synth", "coco-text", "--src", d["captions"], "--out", d["out"]],
    "synth toy-pairs": lambda d: ["synth", "toy-pairs", "image-label", "--out", d["out"]],
    "dedup": lambda d: ["dedup", d["embeddings"], "--keep", "random", "--out", d["out"]],
    "evaluate detection": None, "evaluate dedup": None, "audit-import": None,  # no numeric option
}


def numeric_options() -> dict[str, list[tuple[str, type]]]:
    """command path -> (flag, int or float) of each numeric option."""
    from pairclean.cli import _register_commands, app

    _register_commands()
    found: dict[str, list] = {}

    def walk(command, path):
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
            return
        for mode in command.modes() if hasattr(command, "modes") else ():
            walk(mode.command, [*path, mode.flag])  # `score --from-embeddings`: a mode with its own options
        options = found.setdefault(" ".join(path), [])
        for param in command.get_params(command.context_class(command)):
            kind = annotation(param)
            if param.param_type_name == "option" and kind in (int, float):
                options.append((max(param.opts, key=len), kind))

    walk(typer.main.get_command(app), [])
    return found


def test_every_command_has_a_base_invocation():
    assert set(numeric_options()) == set(BASE)


@pytest.mark.parametrize("command", sorted(c for c, base in BASE.items() if base))
def test_every_numeric_option_is_refused_out_of_range_naming_it(data, capsys, command):
    options = numeric_options()[command]
    assert options
    for flag, kind in options:
        for value in (["nan", "inf"] if kind is float else ["-1", HUGE]):
            argv = [*BASE[command](data), flag, value]
            refused(argv, capsys, data["shards"], data["scores"], message=flag)
        assert not data["out"].exists(), (command, flag)


# -- the issue's examples -------------------------------------------------------------------------------

@pytest.mark.parametrize("args, flag", [
    (["score", "{shards}", *TINY, "--out", "{out}", "--seed", HUGE], "--seed"),
    (["report", "{scores}", "--out", "{out}", "--thumb", "0"], "--thumb"),
    (["synth", "toy-world", "--out", "{out}", "--seed", "-1"], "--seed"),
    (["synth", "coco-mini", "--src", "{coco}", "--out", "{out}", "--limit", "0"], "--limit"),
    (["synth", "coco-mini", "--src", "{coco}", "--out", "{out}", "--limit", "-1"], "--limit"),
    (["synth", "coco-mini", "--src", "{coco}", "--out", "{out}", "--shard-size", "0"], "--shard-size"),
    (["bench", "score", "{shards}", *TINY, "--min-seconds", "nan"], "--min-seconds"),
    (["bench", "score", "{shards}", *TINY, "--naive-pairs", "-1"], "--naive-pairs"),
    (["train", "{shards}", *TINY, "--out", "{out}", "--method", "gsc", "--method-option", "tau2=inf"],
     "--method-option tau2"),
    (["train", "{shards}", *TINY, "--out", "{out}", "--method", "sps", "--method-option", "proxy_threshold=nan"],
     "--method-option proxy_threshold"),
    (["train", "{shards}", *TINY, "--out", "{out}", "--method", "gsc", "--method-option", "gmm_max_iter=0"],
     "--method-option gmm_max_iter"),
    (["train", "{shards}", *TINY, "--out", "{out}", "--method", "sps", "--method-option", "gmm_reg_covar=-1"],
     "--method-option gmm_reg_covar"),
    (["train", "{shards}", *TINY, "--out", "{out}", "--method", "diffncl", "--method-option", "gmm_max_iter=-1"],
     "--method-option gmm_max_iter"),
    (["score", "{shards}", *TINY, "--out", "{out}", "--rule", "fdr:alpha=0.1,alpha=0.2"], "--rule"),
])
def test_the_issues_numbers_are_refused_naming_the_option(data, capsys, args, flag):
    argv = [a.format(**data) if isinstance(a, str) else a for a in args]
    refused(argv, capsys, data["shards"], data["scores"], message=flag)
    assert not data["out"].exists()


# -- audit-import: the marks file typed strictly ----------------------------------------------------------

GOOD = {"key": "k", "shard": "s.tar", "index": 3, "mark": "drop"}


@pytest.mark.parametrize("text, message", [
    (json.dumps([{**GOOD, "index": 1.9}]), "entry 0: index must be an integer"),
    (json.dumps([GOOD, {**GOOD, "index": True}]), "entry 1: index must be an integer"),
    (json.dumps([{**GOOD, "index": -1}]), "entry 0: index must be an integer from 0"),
    (json.dumps([{**GOOD, "key": {"a": 1}}]), "entry 0: key must be a string"),
    (json.dumps([{**GOOD, "shard": 7}]), "entry 0: shard must be a string"),
    (json.dumps([{**GOOD, "mark": "maybe"}]), "entry 0: mark must be keep or drop"),
    ('[{"key": "k", "shard": "s", "index": Infinity, "mark": "drop"}]', "Infinity is not a JSON number"),
    ('[{"key": "k", "shard": "s", "index": NaN, "mark": "drop"}]', "NaN is not a JSON number"),
    ('[{"key": "k", "shard": "s", "index": 1e23, "mark": "drop"}]', "entry 0: index must be an integer"),
    (json.dumps([{**GOOD, "index": 2**70}]), "entry 0: index must be an integer from 0"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (json.dumps({"marks": [GOOD]}), "not a list of marks"),
    (json.dumps([[1, 2]]), "entry 0: a JSON list, not an object"),
    ("\xff\xfe not json", "not an audit export"),
])
def test_audit_import_types_every_entry_strictly(tmp_path, capsys, text, message):
    marks = tmp_path / "marks.json"
    marks.write_bytes(text.encode("latin-1") if text.startswith("\xff") else text.encode())
    out = tmp_path / "truth.parquet"
    refused(["audit-import", marks, "--out", out], capsys, marks, message=message)
    assert not out.exists()


def test_audit_import_reads_at_most_its_cap(tmp_path, capsys):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    out = tmp_path / "truth.parquet"
    refused(["audit-import", "/dev/zero", "--out", out], capsys, message="bytes: not an audit export")
    assert not out.exists()


def test_audit_import_keeps_a_good_export(tmp_path, capsys):
    import pyarrow.parquet as pq

    marks = tmp_path / "marks.json"
    marks.write_text(json.dumps([GOOD, {**GOOD, "index": 4, "mark": "keep"}]))
    assert run_cli(["audit-import", marks, "--out", tmp_path / "t.parquet"], capsys)[0] == 0
    assert pq.read_table(tmp_path / "t.parquet").to_pylist() == [
        {"key": "k", "shard": "s.tar", "index": 3, "noisy": True}, {"key": "k", "shard": "s.tar", "index": 4, "noisy": False}]


def test_query_reads_at_most_its_cap_from_a_sql_file(data, capsys):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    refused(["query", data["scores"], "--file", "/dev/zero"], capsys, data["scores"], message="bytes: not one SQL")
