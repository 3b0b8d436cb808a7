"""The library never names a command-line flag: outside `pairclean/cli/` no string (docstrings
aside) says `--overwrite`, `--beta-mode` ...; errors name config fields (`errors.ConfigError`),
warnings list theirs (`ops.notices.notice`), and the CLI words both as flags."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conventions import flag_messages, flag_strings, library, sources
from pairclean.errors import ConfigError, word_fields

ROOT = Path(__file__).parent.parent

def test_no_library_string_names_a_flag():
    found = flag_strings(library(sources(ROOT)))
    assert not found, "library strings naming a command-line flag:\n" + "\n".join(map(str, found))


@pytest.mark.parametrize("source, flags", [
    ('raise UserError("x exists; pass --overwrite to replace it")\n', ["--overwrite"]),
    ('notice_once("k", f"--decode gpu needs {device}")\n', ["--decode"]),
    ('def check(out, option="--out"):\n    raise UserError(f"{option} {out} is an input")\n', ["--out"]),
])
def test_a_flag_in_the_library_is_found_and_named(source, flags):
    (found,) = flag_strings({"pairclean/x.py": source})
    assert list(found.flags) == flags and str(found).startswith("pairclean/x.py:")


def test_docstrings_shown_command_lines_and_the_cli_are_not_counted():
    files = {"pairclean/x.py": '"""Called by `filter --where`."""\n'
                               'PAGE = "<code>pairclean audit-import marks.json --out truth.parquet</code>"\n'
                               'RECORD = f"pairclean score DATA --model {name}"\n',
             "pairclean/cli/x.py": 'raise UserError("give --out DIR")\n'}
    assert flag_strings(library(files)) == []
    assert [str(m) for m in flag_messages(files)] == ["pairclean/cli/x.py:1 names --out"]


def test_marked_fields_are_worded_and_paths_and_values_are_not():
    flag = "--{}".format
    assert word_fields("/data/out/x is an input; pass `out` elsewhere (out/y, 'out')", ("out",), flag) == \
        "/data/out/x is an input; pass --out elsewhere (out/y, 'out')"
    assert word_fields("out out.parquet exists", ("out",), flag) == "--out out.parquet exists"
    assert ConfigError("unknown noise mode 'x' for `mode`", "mode").worded(flag) == "unknown noise mode 'x' for --mode"


def test_a_warning_names_its_fields_and_the_cli_words_them(caplog, capsys):
    from pairclean.cli import _notices_as_lines
    from pairclean.ops.notices import notice

    with caplog.at_level(logging.WARNING, logger="pairclean"):
        notice("`decode` gpu needs a CUDA device", "decode")
    (record,) = caplog.records
    assert record.getMessage() == "`decode` gpu needs a CUDA device" and record.fields == ("decode",)
    with _notices_as_lines():
        notice("`decode` gpu needs a CUDA device", "decode")
    assert capsys.readouterr().err.strip() == "warning: --decode gpu needs a CUDA device"


def test_a_methods_shortcut_declaration_is_not_counted_but_its_messages_are():
    source = ('S = Shortcut("--weights", "scores", "Scores Parquet (method osa-weights, or with --filter).")\n'
              'def check(o):\n    raise UserError("pass --weights")\n')
    (found,) = flag_strings({"pairclean/training/methods/x.py": source})
    assert found.flags == ("--weights",) and str(found).startswith("pairclean/training/methods/x.py:3")
