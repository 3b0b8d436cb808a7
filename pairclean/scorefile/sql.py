"""SQL for DuckDB as pairclean writes it: quoting, one-line errors, and the sandboxed connection.

Every DuckDB connection pairclean opens over user data goes through `sandboxed_connection`: only
the files pairclean opened itself are readable, and user SQL cannot leave them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import duckdb


def sql_string(value: str) -> str:
    """A SQL string literal (paths go into view definitions, which take no parameters)."""
    return "'" + str(value).replace("'", "''") + "'"


def sql_identifier(name: str) -> str:
    """A quoted SQL identifier (column names recorded in a file's metadata go into queries)."""
    return '"' + str(name).replace('"', '""') + '"'


def sandboxed_connection(temp_dir: str | Path, files: Iterable[str | Path] = (),
                         directories: Iterable[str | Path] = (), database: str = ":memory:",
                         memory_limit: str | None = None, threads: int | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection that can read only `files` and `directories` (the ones pairclean opened
    itself): user SQL cannot read host files, write files, attach databases, install or autoload
    extensions, or change these settings back. Arrow tables registered from Python still work.
    `memory_limit` (e.g. "1GB"): sorts and joins above it spill to `temp_dir`; `threads`: DuckDB's own."""
    con = duckdb.connect(database, config={"autoinstall_known_extensions": False,
                                           "autoload_known_extensions": False})
    con.execute(f"SET temp_directory = {sql_string(temp_dir)}")
    if memory_limit is not None:
        con.execute(f"SET memory_limit = {sql_string(memory_limit)}")
    if threads is not None:
        con.execute(f"SET threads = {int(threads)}")
    con.execute("SET allowed_paths = ?", [[os.path.realpath(f) for f in files] + [str(f) for f in files]])
    con.execute("SET allowed_directories = ?", [[os.path.join(os.path.realpath(d), "") for d in directories]])
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def duckdb_message(exc: BaseException) -> str:
    """DuckDB's error as one line: its first line plus the candidate-bindings hint, no caret art."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    keep = [ln for ln in lines if not ln.startswith("LINE ") and set(ln) != {"^"}]
    if not keep:
        return type(exc).__name__
    return keep[0] + "".join(f" ({ln})" for ln in keep[1:] if ln.startswith("Candidate"))
