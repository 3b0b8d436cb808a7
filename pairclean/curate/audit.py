"""The human audit: a self-contained HTML page of a stratified sample of scored pairs, where a
person marks keep / drop with the keyboard, and the import of those marks as a truth Parquet that
`evaluate detection --truth` accepts: measured precision on the user's own data, no noise injected.

Two samples. The decile page (`build_audit`): `per_decile` pairs from each similarity decile
(DuckDB `ntile(10)`), lowest first, each with its similarity and decile: a look at what the
model calls noise. The blind page (`build_audit(..., blind=True)`): `pairs` pairs drawn at random
within `strata` ranges of `sim` that hold about equally many scored pairs (cut at DuckDB's
`quantile_disc`), shown in random order with no similarity, decile or rule verdict, so the person
marking judges the pair and not the model; a `repeat` share of its pairs is shown a second time
at another random place, unannounced (nothing on a card tells it from another pair), and the two
marks measure the judge; the design (each stratum's sim range, its pairs N_h, the pairs drawn from
it, the pairs shown twice) is recorded in the page, exported with the marks and kept by the
import, and `evaluate detection` weights the marks back to the whole dataset, corrected for the
judge's measured error rate (`scores/stratified.py`).
Pairs are chosen (and the blind page ordered) by md5 of (seed, key, shard, index), so the same
command draws the same pairs. Thumbnails and texts come from the shards through the report's reader
path (`fetch_media`). The page holds everything it shows (no network), written through
`curate.pages` (the pairs as the page's own markup, the data its script needs as script-safe JSON);
its marks live in the page (and the browser's localStorage) until exported as JSON, which
`import_marks` turns into Parquet (key, shard, index, noisy, and for a blind audit stratum and
noisy_again, the second look's mark, with the design in the file's metadata). The export's schema:
docs/lab.md, "marks.json", and `pairclean audit-import --help`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.scorefile.contract import Provenance, from_embeddings, recorded_inputs, scored_pairs
from pairclean.scorefile.db import ScoresDB
from pairclean.scorefile.stratified import DESIGN_KEY, DESIGN_VERSION, AuditDesign, JudgeError, Stratum, whole_number
from pairclean.scorefile.sql import sql_string
from pairclean.curate.pages import Html, ScriptJson, join, render, template
from pairclean.curate.report.media import fetch_media, media_dataset
from pairclean.data.spec import Fields
from pairclean.config import COUNT, INT64_MAX, SEED, SHARE, declare, within
from pairclean.errors import ConfigError, UserError
from pairclean.ops.guard import open_output

DECILES = 10
MARKS_SCHEMA = pa.schema([("key", pa.string()), ("shard", pa.string()), ("index", pa.int64()), ("noisy", pa.bool_())])
# a blind audit's: the pair's stratum, and its mark on the second look when the page showed it twice (else null)
BLIND_SCHEMA = MARKS_SCHEMA.append(pa.field("stratum", pa.int32())).append(pa.field("noisy_again", pa.bool_()))


def stratified_sample(db: ScoresDB, per_decile: int, seed: int) -> list[dict]:
    """`per_decile` scored pairs from each similarity decile, lowest decile first."""
    return [dict(zip(("key", "shard", "index", "sim", "decile"), row)) for row in db.con.execute(
        f"""SELECT key, shard, "index", sim, decile FROM (
              SELECT *, row_number() OVER (PARTITION BY decile ORDER BY md5(concat(?, ':', key, ':', shard, ':', "index"))) AS r
              FROM (SELECT key, shard, "index", sim, ntile({DECILES}) OVER (ORDER BY sim) AS decile
                    FROM scores WHERE sim IS NOT NULL AND NOT isnan(sim)))
            WHERE r <= ? ORDER BY decile, sim""", [str(seed), per_decile]).fetchall()]


def _sample_order(seed: int, what: str) -> str:
    """A pseudo-random order of the scored rows: md5 of (seed, what, key, shard, index)."""
    return f"""md5(concat({sql_string(str(seed))}, ':{what}:', key, ':', shard, ':', "index"))"""


def blind_sample(db: ScoresDB, pairs: int, strata: int, seed: int,
                 repeat: float = 0.0) -> tuple[AuditDesign | None, list[dict]]:
    """(the design, the drawn rows in the order the page shows them): `pairs` scored pairs spread
    evenly over `strata` ranges of sim (cut at sim quantiles, so each holds about as many pairs;
    empty ranges, from ties, are dropped), drawn at random within each, then shuffled with a
    second look at a `repeat` share of them, chosen at random, among them (each row's `look`: 1
    for the pair's first appearance, 2 for its second)."""
    scored = "FROM scores WHERE sim IS NOT NULL AND NOT isnan(sim)"
    total = db.scalar(f"SELECT count(*) {scored}")
    if not total:
        return None, []
    quantiles = [i / strata for i in range(1, strata)]
    cuts = db.scalar(f"SELECT quantile_disc(sim, {quantiles}) {scored}") if quantiles else []
    cuts = sorted(set(float(c) for c in cuts))
    stratum = ("CASE " + " ".join(f"WHEN sim <= {c!r} THEN {i + 1}" for i, c in enumerate(cuts))
               + f" ELSE {len(cuts) + 1} END") if cuts else "1"
    sizes = dict(db.con.execute(f"SELECT {stratum} AS h, count(*) {scored} GROUP BY h ORDER BY h").fetchall())
    numbers = sorted(sizes)
    drawn = {h: min(sizes[h], pairs // len(numbers) + (i < pairs % len(numbers))) for i, h in enumerate(numbers)}
    bounds = [None, *cuts, None]
    repeated = round(repeat * sum(drawn.values()))
    design = AuditDesign(DESIGN_VERSION, seed, db.path.name, int(total),
                         [Stratum(h, bounds[h - 1], bounds[h], int(sizes[h]), int(drawn[h])) for h in numbers],
                         repeated=repeated)
    db.register("audit_drawn", pa.table({"h": pa.array(numbers, pa.int32()),
                                         "n": pa.array([drawn[h] for h in numbers], pa.int64())}))
    shown = f"""md5(concat({sql_string(str(seed))}, ':show:', showing, ':', key, ':', shard, ':', "index"))"""
    rows = db.con.execute(f"""WITH drawn AS (SELECT key, shard, "index", h FROM (
          SELECT key, shard, "index", h, row_number() OVER (PARTITION BY h ORDER BY {_sample_order(seed, 'draw')}) AS r
          FROM (SELECT key, shard, "index", {stratum} AS h {scored}))
        JOIN audit_drawn USING (h) WHERE r <= n),
        again AS (SELECT * FROM drawn ORDER BY {_sample_order(seed, 'repeat')} LIMIT {repeated}),
        shown AS (SELECT *, 1 AS showing FROM drawn UNION ALL SELECT *, 2 AS showing FROM again)
        SELECT key, shard, "index", h, row_number() OVER (PARTITION BY shard, "index" ORDER BY {shown}) AS look
        FROM shown ORDER BY {shown}""").fetchall()
    return design, [{"key": k, "shard": shard, "index": index, "stratum": h, "look": look}
                    for k, shard, index, h, look in rows]


_CARD = """<article class="pair{{layout}}" hidden>
{{pictures}}<div class="texts">{{texts}}{{scores}}{{where}}</div>
</article>
"""
_WHERE = '<p class="where">key {{key}}</p><p class="where" title="{{shard}}">{{shard_name}} #{{index}}</p>'


def _card(row: dict, media) -> Html:
    """One pair as the page shows it: its pictures as large as the page allows, its texts beside
    them, and on the decile page its similarity, decile and where it is stored (never on the blind
    page: nothing there tells a pair shown twice from two pairs)."""
    images = [render('<img src="{{src}}" alt="">', src=src) if src else Html('<div class="noimg">image cannot be '
                                                                              'decoded</div>') for src in media.images]
    texts = [render("<p>{{text}}</p>", text=t) for t in media.texts]
    if media.note:
        texts.append(render('<p class="where">{{note}}</p>', note=media.note))
    scores = render('<p class="where">similarity decile {{decile}} · sim {{sim}}</p>', decile=row["decile"],
                    sim=f"{row['sim']:.4f}") if "sim" in row else Html("")
    where = render(_WHERE, key=row["key"], shard=row["shard"], shard_name=Path(row["shard"]).name,
                   index=int(row["index"])) if "stratum" not in row else Html("")
    return render(_CARD, layout="" if images else " texts-only",
                  pictures=render('<div class="pics">{{images}}</div>', images=join(images)) if images else Html(""),
                  texts=join(texts), scores=scores, where=where)


BLIND_HELP = ("pairs in random order, no similarity shown: judge each pair by itself. Mark every pair you can; "
              "one you cannot judge, leave unmarked")
DECILE_HELP = "lowest similarity decile first"


REPEAT = 0.2  # the share of a blind page's pairs shown a second time: 40 of 200 measure the judge (docs/lab.md)


@declare(per_decile=COUNT, seed=SEED, thumb=within(1, 4096), pairs=COUNT, strata=within(1, 1000), repeat=SHARE)
def build_audit(scores: str | Path, shards: list[str] | None, out: str | Path, per_decile: int = 10, seed: int = 0,
                thumb: int = 1024, fields: Fields | None = None, overwrite: bool = False,
                allow_other_dataset: bool = False, blind: bool = False, pairs: int = 200, strata: int = 10,
                repeat: float = REPEAT, **dataset_options) -> int:
    """Write the audit page; returns the number of pairs on it. The decile page holds `per_decile`
    pairs of each similarity decile; the blind page (`blind`) `pairs` pairs drawn within `strata`
    sim ranges, in random order, without scores, a `repeat` share of them shown a second time at
    another random place, unannounced (the two marks measure the judge: `scores/stratified.py`);
    it returns the pairs drawn, not counting the second looks. The pairs come from `shards`, else the
    scores recorded (`fields`, `dataset_options` override how it is read; the pair kind defaults to
    the one the scores compared). Images are kept up to `thumb` pixels on their longer side: the
    page draws them as large as the browser window allows."""
    with ScoresDB(scores) as db:
        prov = db.provenance or Provenance()
        dataset, note = media_dataset(prov, shards, fields, **dataset_options)
        if dataset is None:
            raise ConfigError(note, "shards")
        if from_embeddings(prov):
            db.check_unique_keys()
        design, rows = blind_sample(db, pairs, strata, seed, repeat) if blind \
            else (None, stratified_sample(db, per_decile, seed))
    if not rows:
        raise UserError(f"{scores} holds no scored pair to audit")
    target = open_output(out, [*recorded_inputs(scores), *(shards or []), *dataset.input_paths()], overwrite=overwrite)
    media = fetch_media(dataset, rows, thumb, from_embeddings(prov), scored_pairs(prov), allow_other_dataset)
    shown = ("key", "shard", "index", "stratum", "look") if blind else ("key", "shard", "index", "sim", "decile")
    items = [{name: (round(float(r[name]), 4) if name == "sim" else int(r[name]) if name in ("index", "decile",
                                                                                            "stratum", "look") else r[name])
              for name in shown} for r in rows]
    page = render(template("pairclean.curate", "audit.html"),
                  title=f"pairclean {'blind ' if blind else ''}audit · {Path(scores).name}",
                  cards=join(_card(r, media[(r["shard"], int(r["index"]))]) for r in rows),
                  order=BLIND_HELP if blind else DECILE_HELP, items=ScriptJson(items), design=ScriptJson(design.to_json() if design else None),
                  store=ScriptJson(f"pairclean-blind-audit:{Path(scores).name}:{seed}:{pairs}" if blind
                                   else f"pairclean-audit:{Path(scores).name}"))  # a page's marks are its own
    with target.write() as tmp:
        tmp.write_text(page, encoding="utf-8")
    return sum(item.get("look", 1) == 1 for item in items)


MAX_MARKS_BYTES = 64 * 2**20  # an export of 100,000 marks is about 15 MB
MARKS = {"keep": False, "drop": True}  # mark -> noisy


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def read_marks(marks: str | Path) -> tuple[list[dict], dict | None]:
    """The audit page's export (its schema: docs/lab.md, "marks.json"), typed strictly: a JSON list (at most MAX_MARKS_BYTES)
    of objects with a string key and shard, an integer index >= 0 and a mark keep / drop (the
    decile page), or a blind audit's object {audit: blind, design, marks} whose marks also name
    their stratum and look; anything else is a UserError naming the entry (a mark on index 1.9 or
    true would land on another pair). Returns (the rows, the design or None)."""
    try:
        with open(marks, "rb") as fh:
            data = fh.read(MAX_MARKS_BYTES + 1)
    except FileNotFoundError:
        raise UserError(f"marks file not found: {marks}") from None
    except OSError as exc:
        raise UserError(f"cannot read marks file {marks}: {exc.strerror}") from None
    if len(data) > MAX_MARKS_BYTES:
        raise UserError(f"{marks} is over {MAX_MARKS_BYTES:,} bytes: not an audit export")
    try:
        entries = json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise UserError(f"{marks} is not an audit export: its JSON is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN / Infinity
        raise UserError(f"{marks} is not an audit export (a JSON list of key, shard, index, mark keep/drop): "
                        f"{str(exc)[:200]}") from None
    design = None
    if isinstance(entries, dict) and entries.get("audit") == "blind":
        design = AuditDesign.from_json(entries.get("design"), f"the design in {marks}")
        entries = entries.get("marks")
    if not isinstance(entries, list):
        raise UserError(f"{marks} is not an audit export: a JSON {type(entries).__name__}, not a list of marks")
    strata = {s.stratum for s in design.strata} if design else set()
    rows = []
    for n, entry in enumerate(entries):
        where = f"{marks} is not an audit export: entry {n}"
        if not isinstance(entry, dict):
            raise UserError(f"{where}: a JSON {type(entry).__name__}, not an object with key, shard, index, mark")
        for name in ("key", "shard"):
            if not isinstance(entry.get(name), str):
                raise UserError(f"{where}: {name} must be a string, got {json.dumps(entry.get(name))[:80]}")
        index = entry.get("index")
        if not whole_number(index):
            raise UserError(f"{where}: index must be an integer from 0 to {INT64_MAX}, got {json.dumps(index)[:80]}")
        if entry.get("mark") not in MARKS:
            raise UserError(f"{where}: mark must be keep or drop, got {json.dumps(entry.get('mark'))[:80]}")
        row = {"key": entry["key"], "shard": entry["shard"], "index": index, "noisy": MARKS[entry["mark"]]}
        if design is not None:
            if entry.get("stratum") not in strata or isinstance(entry.get("stratum"), bool):
                raise UserError(f"{where}: stratum must be one of the design's 1..{len(strata)}, got "
                                f"{json.dumps(entry.get('stratum'))[:80]}")
            look = entry.get("look", 1)
            if look not in (1, 2) or isinstance(look, bool):
                raise UserError(f"{where}: look must be 1 or 2 (the second look at a pair shown twice), got "
                                f"{json.dumps(look)[:80]}")
            row.update(stratum=entry["stratum"], look=look)
        rows.append(row)
    return rows, design


def _looks_merged(marks: str | Path, rows: list[dict]) -> list[dict]:
    """A blind audit's marks, one row per pair: the first look's mark is `noisy` (the second's when
    only it was marked) and the second look's `noisy_again` (None unless both were marked)."""
    pairs: dict[tuple, dict] = {}
    for row in rows:
        found = pairs.setdefault((row["shard"], row["index"]), {})
        if row["look"] in found:
            raise UserError(f"{marks} marks {row['shard']} #{row['index']} twice on look {row['look']}")
        found[row["look"]] = row
    merged = []
    for looks in pairs.values():
        first, second = looks.get(1), looks.get(2)
        if first is not None and second is not None and (first["key"], first["stratum"]) != (second["key"], second["stratum"]):
            raise UserError(f"{marks}: the two looks at {first['shard']} #{first['index']} name other keys or strata")
        shown = first or second
        merged.append({"key": shown["key"], "shard": shown["shard"], "index": shown["index"], "noisy": shown["noisy"],
                       "stratum": shown["stratum"], "noisy_again": second["noisy"] if first and second else None})
    return merged


@dataclass(frozen=True)
class Imported:
    """What `import_marks` wrote: the pairs marked, the blind audit's design (None: the decile
    page), and the judge as the pairs shown twice measure it."""

    marked: int
    design: AuditDesign | None
    judge: JudgeError


def import_marks(marks: str | Path, out: str | Path, overwrite: bool = False) -> Imported:
    """The exported marks JSON -> a truth Parquet (key, shard, index, noisy = marked drop, and for a
    blind audit stratum and noisy_again, the second look's mark, with the design in the file's
    metadata)."""
    target = open_output(out, [marks], overwrite=overwrite)
    rows, design = read_marks(marks)
    if not rows:
        raise UserError(f"{marks} holds no marks")
    if design is not None:
        rows = _looks_merged(marks, rows)
        schema = BLIND_SCHEMA.with_metadata({DESIGN_KEY: design.dumps().encode()})
        marked = {}
        for row in rows:
            marked[row["stratum"]] = marked.get(row["stratum"], 0) + 1
        over = [s.stratum for s in design.strata if marked.get(s.stratum, 0) > s.drawn]
        if over:
            raise UserError(f"{marks} holds more marks in stratum {over[0]} than pairs were drawn from it")
    else:
        schema = MARKS_SCHEMA
    with target.write() as tmp:
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp)
    twice = [row for row in rows if row.get("noisy_again") is not None]
    return Imported(len(rows), design, JudgeError(len(twice), sum(row["noisy"] != row["noisy_again"] for row in twice)))
