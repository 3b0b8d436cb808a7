"""Dedup quality against planted truth (`pairclean evaluate dedup`): precision and recall per kind.

The truth is what `corrupt --mode duplicate` writes (`calibrate.duplicates`): each planted copy with its
original (`dup_group`, `dup_kind`) and hashes of every pair's two sides. Two rows are true
duplicates when they are a planted original and its copy (any kind: a re-encoded, resized or
cropped image or another caption of the same item is a semantic duplicate on either side), or
when the source already held them twice: identical content on the side deduplicated (`image`:
the same image bytes; `text`: the same caption; `both`: both), the kind `identical`; or when the
truth has a `content` column and both rows hold the same value in it (a lab world that knows which
of its items show the same thing says so there: the toy world's objects), the kind `same content`.

What dedup claims is one pair per removed row: the row (`kept` false) and the kept row of its
group, of which it is called a duplicate. Precision is the share of those pairs that are true
(every removal justified by a true duplicate that stays); precision of a kind the same over the
pairs holding one of its copies. Recall of a kind is the share of its true pairs whose two rows
dedup put in one group (a copy and its original, or both removed in favour of the same kept row).
With a noise truth (`corrupt`'s `noisy` column over the same pairs), the share of noisy captions
among the rows each planted group kept, against their share among all the rows of those groups:
what `keep cleanest` is for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from pairclean.dedup.vectors import SIDES
from pairclean.errors import UserError
from pairclean.config import check_choice
from pairclean.ops.records import JsonObject, Keyed
from pairclean.scorefile.sql import duckdb_message, sandboxed_connection, sql_string

if TYPE_CHECKING:
    from pairclean.dedup.run import DedupProvenance

KINDS = ("exact", "reencode", "resize", "crop", "caption", "identical", "same content")
TRUTH_COLUMNS = ("dup_group", "dup_kind", "left_sha1", "right_sha1")
_JOINS = [("shard, index", 'd.shard = t.shard AND d."index" = t."index"', 'shard, "index"'),
          ("shard file name, index", 'parse_filename(d.shard) = parse_filename(t.shard) AND d."index" = t."index"',
           'parse_filename(shard), "index"'),
          ("key", "d.key = t.key", "key")]


@dataclass(frozen=True)
class KindEvaluation:
    """One kind of duplicate: its true pairs, those dedup put in one group, that share (recall %)
    and the share of the removals holding one of its copies that are true (precision %; None for
    the kinds no copy was planted of: `identical`, `same content`)."""

    true_pairs: int
    found: int
    recall: float | None
    precision: float | None


@dataclass(frozen=True)
class DedupEvaluation:
    """`evaluate dedup`: which files were joined and how, the side, threshold and keep rule of the
    dedup; its claimed pairs (one per removed row) and the true ones among them, the true pairs and
    those found, precision and recall % over all pairs and per kind (by name); the removed rows;
    the planted groups, those found and those that kept one copy. With a noise truth (`noise_truth`
    not None): its join, and how often the copy a planted group kept is the noisy one (count and %)
    against the noisy share of all the copies of those groups."""

    dedup: str
    truth: str
    join: str
    side: str
    threshold: float | None
    keep: str | None
    rows: int
    predicted_pairs: int
    correct_pairs: int
    true_pairs: int
    found_pairs: int
    precision: float | None
    recall: float | None
    kinds: Keyed[str, KindEvaluation]
    removed: int
    planted_groups: int
    planted_groups_found: int
    planted_groups_one_kept: int
    noise_truth: str | None = None
    noise_join: str | None = None
    kept_noisy: int | None = None
    kept_noisy_share: float | None = None
    noisy_share_in_groups: float | None = None

    def to_json(self) -> JsonObject:
        """The JSON `evaluate dedup` writes: the noise truth's figures only when there is one."""
        written = asdict(self)
        if self.noise_truth is None:
            for name in ("noise_truth", "noise_join", "kept_noisy", "kept_noisy_share", "noisy_share_in_groups"):
                del written[name]
        return written


def _join(con, table: str) -> tuple[str, str]:
    """(label, condition) of the first join of `d` with `table` that matches and is unique on its side."""
    for label, condition, ident in _JOINS:
        if con.execute(f"SELECT count(*) - count(DISTINCT ({ident})) FROM {table}").fetchall()[0][0]:
            continue
        condition = condition.replace("t.", f"{table}.")
        if con.execute(f"SELECT count(*) FROM d JOIN {table} ON {condition}").fetchall()[0][0]:
            return label, condition
    raise UserError(f"the {table} file matches no row of the dedup output (joined on shard and index, "
                    "shard file name and index, or key)")


def evaluate_dedup(dedup_file: str | Path, truth: str | Path, noise_truth: str | Path | None = None,
                   side: str | None = None) -> DedupEvaluation:
    """Precision and recall of a dedup output against a duplicates truth (a Parquet or a manifest
    whose `truth:` names it); `side` defaults to the one the output was made with."""
    from pairclean.scorefile.db import resolve_truth

    dedup_file, truth = Path(dedup_file), resolve_truth(truth)
    noise_truth = resolve_truth(noise_truth) if noise_truth is not None else None
    for path in (dedup_file, truth, noise_truth):
        if path is not None and not path.is_file():
            raise UserError(f"file not found: {path}")
    from pairclean.dedup.run import DedupProvenance, read_dedup_metadata

    provenance = read_dedup_metadata(dedup_file)[0] or DedupProvenance(kind=DedupProvenance.kind_written)
    side = side or provenance.side or "image"
    check_choice(side, SIDES, "side")
    with _Session(dedup_file, truth, noise_truth) as con:
        try:
            return _measure(con, side, provenance, dedup_file, truth, noise_truth)
        except duckdb.Error as exc:
            raise UserError(f"cannot evaluate {dedup_file}: {duckdb_message(exc)}") from None


class _Session:
    def __init__(self, *files: Path | None):
        import tempfile

        self.tmp = tempfile.TemporaryDirectory(prefix="pairclean-dedup-eval-")
        self.files = [f for f in files if f is not None]

    def __enter__(self):
        self.con = sandboxed_connection(self.tmp.name, self.files)
        return self.con

    def __exit__(self, *exc):
        self.con.close()
        self.tmp.cleanup()


def _measure(con, side: str, provenance: "DedupProvenance", dedup_file: Path, truth: Path,
             noise_truth: Path | None) -> DedupEvaluation:
    con.execute(f"CREATE VIEW d AS SELECT * FROM read_parquet({sql_string(dedup_file)})")
    con.execute(f"CREATE VIEW truth AS SELECT * FROM read_parquet({sql_string(truth)})")
    missing = [c for c in ("group_id", "kept") if c not in con.sql("SELECT * FROM d").columns]
    if missing:
        raise UserError(f"{dedup_file} is not a `pairclean dedup` output (no column {', '.join(missing)})")
    missing = [c for c in TRUTH_COLUMNS if c not in con.sql("SELECT * FROM truth").columns]
    if missing:
        raise UserError(f"{truth} is not a duplicates truth (no column {', '.join(missing)}): "
                        "`pairclean corrupt --mode duplicate` writes one")
    join, condition = _join(con, "truth")
    noise_join, noisy = None, "NULL::BOOLEAN"
    if noise_truth is not None:
        con.execute(f"CREATE VIEW noise AS SELECT * FROM read_parquet({sql_string(noise_truth)})")
        noise_join, noise_condition = _join(con, "noise")
        noisy = "noise.noisy::BOOLEAN"
    content = "truth.content" if "content" in con.sql("SELECT * FROM truth").columns else "NULL::VARCHAR"
    con.execute(f"""CREATE TABLE j AS SELECT row_number() OVER (ORDER BY d.shard, d."index") AS id, d.group_id, d.kept,
                        truth.dup_group, truth.dup_kind, truth.left_sha1, truth.right_sha1, {content} AS content,
                        {noisy} AS noisy
                    FROM d JOIN truth ON {condition}
                    {f'LEFT JOIN noise ON {noise_condition}' if noise_truth is not None else ''}""")
    identical = {"image": "a.left_sha1 = b.left_sha1", "text": "a.right_sha1 = b.right_sha1",
                 "both": "a.left_sha1 = b.left_sha1 AND a.right_sha1 = b.right_sha1"}[side]
    con.execute(f"""CREATE TABLE true_pairs AS
        SELECT a.id AS a, b.id AS b,
               CASE WHEN a.dup_group = b.dup_group THEN coalesce(nullif(b.dup_kind, 'original'), a.dup_kind)
                    WHEN {identical} THEN 'identical' ELSE 'same content' END AS kind
        FROM j a JOIN j b ON a.id < b.id AND (a.dup_group = b.dup_group OR ({identical}) OR a.content = b.content)""")
    con.execute("""CREATE TABLE predicted AS
        SELECT least(r.id, k.id) AS a, greatest(r.id, k.id) AS b,
               CASE WHEN r.dup_kind <> 'original' THEN r.dup_kind WHEN k.dup_kind <> 'original' THEN k.dup_kind END
                   AS copy_kind
        FROM j r JOIN j k ON r.group_id = k.group_id AND NOT r.kept AND k.kept""")
    con.execute("""CREATE TABLE judged AS
        SELECT p.*, t.kind AS true_kind FROM predicted p LEFT JOIN true_pairs t USING (a, b)""")
    kinds = {}
    for kind in KINDS:
        total, found = con.execute("SELECT count(*), count(*) FILTER (WHERE x.group_id = y.group_id) FROM true_pairs t "
                                   "JOIN j x ON x.id = t.a JOIN j y ON y.id = t.b WHERE t.kind = ?", [kind]).fetchall()[0]
        touching, right = con.execute("SELECT count(*), count(true_kind) FROM judged WHERE copy_kind = ?",
                                      [kind]).fetchall()[0]
        if total or touching:
            kinds[kind] = KindEvaluation(true_pairs=int(total), found=int(found), recall=_share(found, total),
                                         precision=_share(right, touching)
                                         if kind not in ("identical", "same content") else None)
    predicted, correct = con.execute("SELECT count(*), count(true_kind) FROM judged").fetchall()[0]
    true_total, grouped = con.execute("SELECT count(*), count(*) FILTER (WHERE x.group_id = y.group_id) FROM true_pairs t "
                                      "JOIN j x ON x.id = t.a JOIN j y ON y.id = t.b").fetchall()[0]
    rows, removed = con.execute("SELECT count(*), count(*) FILTER (WHERE NOT kept) FROM j").fetchall()[0]
    planted = con.execute("""
        SELECT count(*), count(*) FILTER (WHERE found), count(*) FILTER (WHERE found AND kept_members = 1),
               count(*) FILTER (WHERE found AND kept_members = 1 AND kept_noisy),
               sum(noisy_members) FILTER (WHERE found AND kept_members = 1),
               sum(members) FILTER (WHERE found AND kept_members = 1)
        FROM (SELECT dup_group, count(*) AS members, count(DISTINCT group_id) = 1 AND count(group_id) = count(*) AS found,
                     count(*) FILTER (WHERE kept) AS kept_members, bool_or(kept AND noisy) AS kept_noisy,
                     count(*) FILTER (WHERE noisy) AS noisy_members
              FROM j WHERE dup_group IS NOT NULL GROUP BY dup_group HAVING count(*) > 1)""").fetchall()[0]
    groups, found_groups, collapsed, kept_noisy, noisy_members, members = planted
    noise = {} if noise_truth is None else {
        "noise_truth": str(noise_truth), "noise_join": noise_join, "kept_noisy": int(kept_noisy or 0),
        "kept_noisy_share": _share(kept_noisy or 0, collapsed),
        "noisy_share_in_groups": _share(noisy_members or 0, members or 0)}
    return DedupEvaluation(
        dedup=str(dedup_file), truth=str(truth), join=join, side=side, threshold=provenance.threshold,
        keep=provenance.keep, rows=int(rows), predicted_pairs=int(predicted), correct_pairs=int(correct),
        true_pairs=int(true_total), found_pairs=int(grouped), precision=_share(correct, predicted),
        recall=_share(grouped, true_total), kinds=kinds, removed=int(removed), planted_groups=int(groups),
        planted_groups_found=int(found_groups), planted_groups_one_kept=int(collapsed), **noise)


def _share(part, whole) -> float | None:
    return 100.0 * part / whole if whole else None
