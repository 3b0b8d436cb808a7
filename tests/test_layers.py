"""The layers hold: no import in pairclean runs up `conventions.LAYERS` (tests/conventions.py), counting every
import statement (deferred ones inside functions and `TYPE_CHECKING` ones too), no module is part of
an import cycle (counted the same way), and the order the docs print is that list."""

from __future__ import annotations

from pathlib import Path

import pytest

from conventions import LAYERS, import_cycles, imports_of, layer_of, layers_line, runs_up, sources, upward_imports

ROOT = Path(__file__).parent.parent


def test_no_import_runs_up_the_layers():
    found = upward_imports(sources(ROOT))
    assert not found, "imports that run up the layers:\n" + "\n".join(map(str, found))


def test_no_import_cycle_even_through_deferred_imports():
    found = import_cycles(sources(ROOT))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(cycle) for cycle in found)


@pytest.mark.parametrize("files, cycle", [
    ({"pairclean/data/a.py": "from pairclean.data import b\n", "pairclean/data/b.py": "def f():\n    from . import a\n"},
     ["pairclean.data.a", "pairclean.data.b"]),
    ({"pairclean/x/__init__.py": "def f():\n    from pairclean.x import run\n",
      "pairclean/x/run.py": "from pairclean.x import LIMIT\n"}, ["pairclean.x", "pairclean.x.run"]),
    ({"pairclean/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pairclean.b\n",
      "pairclean/b.py": "import pairclean.a\n"}, ["pairclean.a", "pairclean.b"]),
])
def test_a_cycle_is_found_however_its_imports_are_written(files, cycle):
    assert import_cycles(files) == [cycle]


def test_a_package_importing_its_modules_is_no_cycle():
    files = {"pairclean/p/__init__.py": "from pairclean.p import a\n", "pairclean/p/a.py": "from pairclean.p.b import X\n",
             "pairclean/p/b.py": "X = 1\n"}
    assert import_cycles(files) == []


def test_every_part_of_the_package_is_in_a_layer():
    parts = {path.stem if path.suffix == ".py" else path.name for path in (ROOT / "pairclean").iterdir()
             if (path.suffix == ".py" or (path / "__init__.py").is_file()) and path.name != "__init__.py"}
    declared = {name for layer in LAYERS for name in layer}
    assert parts <= declared, f"declare {sorted(parts - declared)} in tests/conventions.py LAYERS"


def test_docs_print_the_declared_order():
    assert layers_line() in (ROOT / "docs" / "architecture.md").read_text()


@pytest.mark.parametrize("path, source, offending", [
    ("pairclean/ops/x.py", "def f():\n    from pairclean.cli import main\n", "pairclean.cli"),
    ("pairclean/core/x.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pairclean.scorefile.db\n",
     "pairclean.scorefile.db"),
    ("pairclean/scorefile/x.py", "from pairclean.curate import query\n", "pairclean.curate"),
    ("pairclean/scoring/x.py", "from pairclean.curate.sweep import Sweep\n", "pairclean.curate.sweep"),
    ("pairclean/data/x.py", "from .. import backends\n", "pairclean.backends"),
])
def test_an_import_up_the_layers_is_found_and_named(path, source, offending):
    (found,) = upward_imports({path: source})
    assert found.target == offending and str(found).startswith(f"{path}:")
    assert f"may not import {layer_name(offending)}" in str(found)


def layer_name(module: str) -> str:
    return module.split(".")[1]


@pytest.mark.parametrize("path, source", [
    ("pairclean/scoring/x.py", "from pairclean.scorefile.db import ScoresDB\nfrom pairclean import __version__\n"),
    ("pairclean/config.py", "from pairclean.errors import ConfigError\n"),  # the ground's modules lean on each other
    ("pairclean/cli/x.py", "def f():\n    from pairclean.training import train\n"),
    ("pairclean/curate/report/x.py", "from .stats import gather\n"),
])
def test_imports_down_or_within_a_part_are_allowed(path, source):
    assert [str(i) for i in imports_of(path, source) if runs_up(i)] == []


def test_a_module_outside_every_layer_is_named():
    with pytest.raises(KeyError, match="declare 'plugins'"):
        layer_of("pairclean.plugins.x")


def test_few_functions_return_a_bare_dict():
    """A dict returned across a boundary is a record, or one of the kinds `ops.records` names
    (`Keyed`, `JsonObject`, `StateDict`); the bare ones left are counted (issue 54: 161 -> 5; at most 10)."""
    from conventions import dict_returns

    found = dict_returns(sources(ROOT))
    assert len(found) <= 10, "functions returning a bare dict:\n" + "\n".join(map(str, found))
