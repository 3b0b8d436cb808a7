"""A scores file from Python: `pairclean.open_scores(path)`, what the commands do with one, as calls.

One `scores.db.ScoresDB` (the sandboxed DuckDB session every command opens over the file) answers
`query` and `table`; `filter` and `report` are the functions `pairclean filter` and `pairclean
report` call (`curate.filter.filter_dataset`, `curate.report.build_report`), on the dataset the
file recorded. Results come back as Arrow tables (`.to_pandas()` where pandas is installed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import pyarrow as pa

from pairclean.curate.filter import FilterResult, attachments, filter_dataset
from pairclean.data.dataset import reopen_dataset
from pairclean.scorefile.contract import Provenance, Summary, scored_pairs
from pairclean.scorefile.db import ScoresDB, compile_predicate
from pairclean.scorefile.sql import sql_identifier


class ScoresFile:
    """A scores file opened once (close it, or use `with`): its provenance and summary, SQL over
    its `scores` view (and `labeled` with a truth file, and the tables attached), and the filter
    and report commands on it."""

    def __init__(self, path: str | Path, truth: str | Path | None = None,
                 attach: Mapping[str, str | Sequence[str]] | None = None):
        self.path, self.truth = Path(path), truth
        self.attach = {name: [str(files)] if isinstance(files, (str, Path)) else [str(f) for f in files]
                       for name, files in (attach or {}).items()}
        self.db = ScoresDB(self.path, truth=truth, attach=self.attach)

    def __repr__(self) -> str:
        summary = self.summary
        return f"<scores {self.path}: {summary.pairs:,} pairs>" if summary else f"<scores {self.path}>"

    def __enter__(self) -> "ScoresFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.db.close()

    @property
    def provenance(self) -> Provenance | None:
        """How the scores were made: beta, the rules and their thresholds, the model, the dataset."""
        return self.db.provenance

    @property
    def summary(self) -> Summary | None:
        """The run's counts: pairs, errors, what each rule flagged (`flagged`, `share_flagged`)."""
        return self.db.summary

    @property
    def columns(self) -> list[str]:
        """The columns of `scores`: what `where` predicates and queries can use."""
        return list(self.db.columns("scores"))

    def query(self, sql: str, params: list | None = None) -> pa.Table:
        """One read-only SQL statement over `scores` (and `labeled`, attached tables), as a table."""
        schema, batches = self.db.stream(self.db.run(sql, params))
        return pa.Table.from_batches(list(batches), schema)

    def table(self, where: str | None = None, columns: Sequence[str] | None = None) -> pa.Table:
        """The scores' rows (those `where` keeps: a boolean SQL predicate, as `filter` takes), in
        file order, with every column or those named."""
        select = ", ".join(sql_identifier(c) for c in columns) if columns else "*"
        keep = f" WHERE {compile_predicate(self.db, where, 'where')}" if where is not None else ""
        return self.query(f"SELECT {select} FROM scores{keep}")

    def to_arrow(self) -> pa.Table:
        """Every row and column."""
        return self.table()

    def filter(self, out: str | Path | None = None, *, where: str | Sequence[str] | None = None,
               top_fraction: float | None = None, by: str = "sim", keep_keys: str | None = None,
               keys_out: str | Path | None = None, dry_run: bool = False, shards: Sequence[str] | None = None,
               prefix: str = "shard", overwrite: bool = False, **options) -> FilterResult:
        """`pairclean filter`: write the pairs every rule keeps to `out` in the dataset's own shape
        (the dataset the file recorded, or `shards`), or count them (`dry_run`). `options`:
        filter_dataset's other settings (`shard_size`, `shard_bytes`, `allow_other_dataset`)."""
        recorded = scored_pairs(self.provenance)
        dataset = reopen_dataset(recorded, list(shards) if shards else None) if recorded or shards else None
        where = [where] if isinstance(where, str) else list(where or [])
        # A session of its own: filter narrows its `scores` view to the dataset's shards.
        with ScoresDB(self.path, attach=attachments(dataset, self.attach)) as db:
            return filter_dataset(dataset, db, out, where=where, top_fraction=top_fraction, by=by, dry_run=dry_run,
                                  prefix=prefix, overwrite=overwrite, keep_keys=keep_keys, keys_out=keys_out,
                                  attach=self.attach, **options)

    def report(self, out: str | Path, **options):
        """`pairclean report`: the self-contained HTML page (`options`: build_report's, such as
        `gallery`, `shards`, `overwrite`); with the truth file this was opened with."""
        from pairclean.curate.report import build_report

        return build_report(self.path, out, truth=self.truth, **options)


def open_scores(path: str | Path, truth: str | Path | None = None,
                attach: Mapping[str, str | Sequence[str]] | None = None) -> ScoresFile:
    """Open a scores file `pairclean score` wrote: `truth` (a truth Parquet or a manifest naming
    one) adds the `labeled` view; `attach` maps table names to Parquet files or a key list."""
    return ScoresFile(path, truth, attach)
