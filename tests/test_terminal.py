"""What pairclean prints on a terminal (issue 25 class 3, issue 27): everything not written by
pairclean is printed literally (`cli.terminal.LiteralConsole`), tables stay readable at 80 columns
and are plain text when the output is not a terminal (`cli.terminal.print_table`), and the help is
written for a person. Each example of the issues is a test, run through the command line."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import run_cli

from conventions import sources

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colour codes and cursor controls: nothing a person sees


@pytest.fixture
def terminal_80(monkeypatch):
    """stdout as a terminal 80 columns wide (rich reads both from the environment when it prints)."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("NO_COLOR", raising=False)


def shown(text: str) -> str:
    """What a person sees: the text without colour codes."""
    return ANSI.sub("", text)


# ------------------------------------------------------------------ data printed literally

def test_query_prints_a_closing_tag_cell_instead_of_crashing(coco_scores, capsys):
    code, out, err = run_cli(["query", coco_scores, "SELECT '[/bold]' AS x"], capsys)
    assert code == 0 and "[/bold]" in out, err


def test_query_prints_a_link_tag_as_text_not_as_a_hidden_link(coco_scores, capsys, terminal_80):
    code, out, err = run_cli(["query", coco_scores, "SELECT '[link=https://evil.example]click[/link]' AS x"], capsys)
    assert code == 0 and "[link=https://evil.example]click[/link]" in shown(out), err
    assert "\x1b]8;" not in out  # no terminal hyperlink


def test_filter_where_with_a_closing_tag_runs(coco_shards, coco_scores, capsys):
    code, out, err = run_cli(["filter", coco_shards, "--scores", coco_scores, "--where", "key != '[/bold]'",
                              "--dry-run"], capsys)
    assert code == 0 and "key != '[/bold]'" in out, err


def test_method_option_help_keeps_text_in_square_brackets(capsys):
    code, out, err = run_cli(["train", "--method-option", "help"], capsys)
    assert code == 0 and "[loss, zeta * Psi]" in out, err


def test_escape_sequences_and_rtl_overrides_in_data_are_shown_as_code_points(coco_scores, capsys, terminal_80):
    code, out, err = run_cli(["query", coco_scores, "SELECT chr(27) || '[2J' || 'rtl' || chr(8238) || 'gpj.exe' AS k"],
                             capsys)
    assert code == 0 and "<U+001B>[2Jrtl<U+202E>gpj.exe" in shown(out), err
    assert "\u202e" not in out and "\x1b[2J" not in out


def test_an_error_line_prints_markup_in_the_users_text_literally(coco_shards, coco_scores, capsys):
    code, _, err = run_cli(["filter", coco_shards, "--scores", coco_scores, "--where", "[/bold] > 1", "--dry-run"],
                           capsys)
    assert code == 2 and "'[/bold] > 1'" in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------ tables

def _detection_inputs(directory) -> tuple:
    """Embeddings whose GMM abstains (one noisy pair: nothing to separate), scored, with a truth file."""
    from pairclean.cli import main
    from pairclean.data.embeddings import write_embeddings

    rng = np.random.default_rng(0)
    left = rng.standard_normal((600, 16))
    right = left + 0.6 * rng.standard_normal((600, 16))
    keys = [f"k{i}" for i in range(600)]
    write_embeddings(directory / "emb", [(left.astype(np.float32), right.astype(np.float32), keys)])
    pq.write_table(pa.table({"key": keys, "noisy": [i % 5 == 0 for i in range(600)]}), directory / "truth.parquet")
    main(["score", str(directory / "emb"), "--from-embeddings", "--out", str(directory / "s.parquet"), "--beta-mode",
          "fixed", "--beta", "0.1"])
    return directory / "s.parquet", directory / "truth.parquet"


def test_query_at_80_columns_keeps_every_cell_whole(coco_scores, capsys, terminal_80):
    code, out, err = run_cli(["query", coco_scores, "SELECT * FROM scores ORDER BY sim LIMIT 3"], capsys)
    assert code == 0, err
    lines = shown(out).splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    rows = pq.read_table(coco_scores).to_pylist()
    lowest = sorted(rows, key=lambda r: (r["sim"], r["shard"], r["index"]))[:3]
    for row in lowest:  # each value on one line, not folded into columns of a few characters
        for value in (row["key"], row["shard"], f"{row['sim']:.4f}", f"{row['sim_debiased']:.4f}"):
            assert any(value in line for line in lines), value


def test_evaluate_detection_at_80_columns_keeps_every_number_whole(tmp_path, capsys, terminal_80):
    scores, truth = _detection_inputs(tmp_path)
    capsys.readouterr()
    code, out, err = run_cli(["evaluate", "detection", scores, "--truth", truth], capsys)
    text = shown(out)
    assert code == 0 and "abstains" in text, err
    assert "…" not in text and "..." not in text
    assert max(len(line.rstrip()) for line in text.splitlines() if re.search("[\u2500-\u257f]", line)) <= 80
    result = json.loads((tmp_path / "s.detection.truth.json").read_text())
    for m in result["rules"].values():  # each rule's row holds its four shares, whole
        (row,) = [line for line in text.splitlines() if line.startswith(f"│ {m['label']} ")]
        values = [f"{m[k]:.2f}" if m[k] is not None else "n/a"
                  for k in ("clean_kept", "noise_caught", "balanced_accuracy", "precision")]
        assert [cell.strip() for cell in row.split("│")[3:7]] == values, row


def test_a_table_is_plain_text_when_the_output_is_not_a_terminal(coco_scores, capsys):
    code, out, err = run_cli(["query", coco_scores, "SELECT key, shard, sim FROM scores ORDER BY sim LIMIT 2"], capsys)
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["key", "shard", "sim"], err
    assert not re.search("[\u2500-\u257f]", out) and "\x1b" not in out  # no box drawing, no colour
    rows = sorted(pq.read_table(coco_scores).to_pylist(), key=lambda r: (r["sim"], r["shard"], r["index"]))[:2]
    assert [line.split() for line in lines[1:3]] == [[r["key"], r["shard"], f"{r['sim']:.4f}"] for r in rows]


# ------------------------------------------------------------------ help

def _commands() -> list[str]:
    """Every command and command group of the app (a new one is checked without being listed here)."""
    import typer

    from pairclean.cli import _register_commands
    from pairclean.cli.app import app

    _register_commands()

    def walk(command, prefix=""):
        yield prefix.strip()
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, f"{prefix} {name}")
        for mode in command.modes() if hasattr(command, "modes") else ():
            yield from walk(mode.command, f"{prefix} {mode.flag}")  # `score --from-embeddings`: a mode with its own help
    return sorted(walk(typer.main.get_command(app)))


COMMANDS = _commands()


def test_the_walk_finds_the_commands_and_their_groups():
    assert {"", "score", "filter", "query", "evaluate", "evaluate detection", "synth toy-world"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_reads_as_words_at_80_columns(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_cli([*command.split(), "--help"], capsys)
    assert code == 0, err
    assert not re.search(r"<(str|int|float|bool|path|list\[\w+\]|[a-z]+)>", out), out  # no Python types
    usage = out.splitlines()[0]
    assert usage.startswith(f"Usage: pairclean {command}".rstrip()) and "{" not in usage
    assert max(len(line) for line in out.splitlines()) <= 80


@pytest.mark.parametrize("command, usage, metavars, flag", [
    ("score", "pairclean score [OPTIONS] SHARDS...", ["--out PATH", "--batch-size N", "--beta NUMBER", "--rule NAME"],
     "--compile"),
    ("filter", "pairclean filter [OPTIONS] SOURCE...", ["--where SQL", "--top-fraction NUMBER"],
     "--dry-run / --no-dry-run"),
    ("query", "pairclean query [OPTIONS] SCORES [SQL]", ["--format TEXT", "--limit N"], "--columns"),
    ("train", "pairclean train [OPTIONS] SHARDS...", ["--method-option KEY=VALUE", "--epochs N"], "--online"),
])
def test_usage_and_metavars_say_what_a_value_is(command, usage, metavars, flag, capsys):
    code, out, _ = run_cli([command, "--help"], capsys)
    assert out.splitlines()[0] == f"Usage: {usage}"
    for metavar in metavars:
        assert re.search(rf"{re.escape(metavar)}\b", out), metavar
    assert re.search(rf"^\s+{re.escape(flag)}\s{{2,}}[A-Z(a-z]", out, re.MULTILINE), flag  # a flag has no metavar


@pytest.mark.parametrize("command, option", [("filter", "--where"), ("train", "--filter")])
def test_predicate_help_names_the_scores_columns(command, option, capsys):
    code, out, _ = run_cli([command, "--help"], capsys)
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith((f"{option} ", f"-w, {option} ")))
    end = next(i for i in range(start + 1, len(lines)) if re.match(r"^  -", lines[i]))  # the next option
    help_text = " ".join(" ".join(lines[start:end]).split())
    for column in ("sim", "weight_norm", "osa_noisy", "p_clean", "gmm_noisy", "fdr_noisy"):
        assert column in help_text, column
    assert "pairclean query SCORES --columns" in help_text


def test_query_columns_lists_each_column_with_its_type_and_meaning(coco_scores, capsys):
    code, out, err = run_cli(["query", coco_scores, "--columns"], capsys)
    assert code == 0, err
    rows = {line.split()[1]: line for line in out.splitlines()[2:]}
    assert list(rows) == pq.read_schema(coco_scores).names
    assert "FLOAT" in rows["sim"] and "cosine" in rows["sim"]
    assert "GMM rule's probability that the pair is clean" in rows["p_clean"]
    # the file's own noisy_if: on this random model's scores the GMM abstains (issue 55)
    assert "true = flagged noisy (abstains: " in rows["gmm_noisy"]


# ------------------------------------------------------------------ held for the next command

def _code_strings(source: str) -> list[str]:
    """The string literals of a module, docstrings aside."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_the_terminal_module_is_the_one_console_path():
    """No console but `LiteralConsole`, no rich markup in a string, no progress column that parses
    markup: what a new command prints goes through cli/terminal.py."""
    files = sources(Path(__file__).parent.parent)
    consoles = [path for path, source in files.items()
                if re.search(r"\bConsole\(", source) and path != "pairclean/cli/terminal.py"]
    markup = [(path, text) for path, source in files.items() for text in _code_strings(source)
              if re.search(r"\[/?(bold|dim|italic|underline|red|green|yellow|blue|cyan|magenta|link)\b[^\]]*\]", text)]
    columns = [(path, node.lineno) for path, source in files.items() for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "TextColumn"
               and not any(k.arg == "markup" and getattr(k.value, "value", True) is False for k in node.keywords)]
    assert consoles == [] and markup == [] and columns == []
