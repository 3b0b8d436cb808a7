"""The human audit: a self-contained HTML page of a stratified sample of scored pairs, where a
person marks keep / drop with the keyboard, and the import of those marks as a truth Parquet that
`evaluate detection --truth` accepts: measured precision on the user's own data, no noise injected.

The sample is stratified by similarity decile (DuckDB `ntile(10)`), `per_decile` pairs from each,
chosen by md5 of (seed, key), so the same command draws the same pairs. Thumbnails and texts come
from the shards through the report's reader path (`fetch_media`). The page holds everything it
shows (no network), written through `curate.pages` (the pairs as the page's own markup, the data
its script needs as script-safe JSON); its marks live in the page (and the browser's localStorage)
until exported as JSON, which `import_marks` turns into Parquet (key, shard, index, noisy).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.scores.contract import Provenance, from_embeddings, scored_pairs
from pairclean.scores.db import ScoresDB
from pairclean.curate.pages import Html, ScriptJson, join, render, template
from pairclean.curate.report.media import fetch_media, media_dataset
from pairclean.data.spec import Fields
from pairclean.config import COUNT, INT64_MAX, SEED, declare, within
from pairclean.errors import ConfigError, UserError
from pairclean.ops.guard import open_output

DECILES = 10
MARKS_SCHEMA = pa.schema([("key", pa.string()), ("shard", pa.string()), ("index", pa.int64()), ("noisy", pa.bool_())])


def stratified_sample(db: ScoresDB, per_decile: int, seed: int) -> list[dict]:
    """`per_decile` scored pairs from each similarity decile, lowest decile first."""
    return [dict(zip(("key", "shard", "index", "sim", "decile"), row)) for row in db.con.execute(
        f"""SELECT key, shard, "index", sim, decile FROM (
              SELECT *, row_number() OVER (PARTITION BY decile ORDER BY md5(concat(?, ':', key, ':', shard, ':', "index"))) AS r
              FROM (SELECT key, shard, "index", sim, ntile({DECILES}) OVER (ORDER BY sim) AS decile
                    FROM scores WHERE sim IS NOT NULL AND NOT isnan(sim)))
            WHERE r <= ? ORDER BY decile, sim""", [str(seed), per_decile]).fetchall()]


_CARD = """<article class="pair{{layout}}" hidden>
{{pictures}}<div class="texts">{{texts}}<p class="where">similarity decile {{decile}} · sim {{sim}}</p>
<p class="where">key {{key}}</p><p class="where" title="{{shard}}">{{shard_name}} #{{index}}</p></div>
</article>
"""


def _card(row: dict, media) -> Html:
    """One pair as the page shows it: its pictures as large as the page allows, its texts beside them."""
    images = [render('<img src="{{src}}" alt="">', src=src) if src else Html('<div class="noimg">image cannot be '
                                                                              'decoded</div>') for src in media.images]
    texts = [render("<p>{{text}}</p>", text=t) for t in media.texts]
    if media.note:
        texts.append(render('<p class="where">{{note}}</p>', note=media.note))
    return render(_CARD, layout="" if images else " texts-only",
                  pictures=render('<div class="pics">{{images}}</div>', images=join(images)) if images else Html(""),
                  texts=join(texts), decile=row["decile"], sim=f"{row['sim']:.4f}", key=row["key"],
                  shard=row["shard"], shard_name=Path(row["shard"]).name, index=int(row["index"]))


@declare(per_decile=COUNT, seed=SEED, thumb=within(1, 4096))
def build_audit(scores: str | Path, shards: list[str] | None, out: str | Path, per_decile: int = 10, seed: int = 0,
                thumb: int = 1024, fields: Fields | None = None, overwrite: bool = False,
                allow_other_dataset: bool = False, **dataset_options) -> int:
    """Write the audit page; returns the number of pairs on it. The pairs come from `shards`, else
    the dataset the scores recorded (`fields`, `dataset_options` override how it is read; the pair
    kind defaults to the one the scores compared). Images are kept up to `thumb` pixels on their
    longer side: the page draws them as large as the browser window allows."""
    with ScoresDB(scores) as db:
        prov = db.provenance or Provenance()
        dataset, note = media_dataset(prov, shards, fields, **dataset_options)
        if dataset is None:
            raise ConfigError(note, "shards")
        if from_embeddings(prov):
            db.check_unique_keys()
        rows = stratified_sample(db, per_decile, seed)
    if not rows:
        raise UserError(f"{scores} holds no scored pair to audit")
    target = open_output(out, [scores, *(shards or []), *dataset.input_paths()], overwrite=overwrite)
    media = fetch_media(dataset, rows, thumb, from_embeddings(prov), scored_pairs(prov), allow_other_dataset)
    items = [{"key": r["key"], "shard": r["shard"], "index": int(r["index"]), "sim": round(float(r["sim"]), 4),
              "decile": int(r["decile"])} for r in rows]
    page = render(template("pairclean.curate", "audit.html"), title=f"pairclean audit · {Path(scores).name}",
                  cards=join(_card(r, media[(r["shard"], int(r["index"]))]) for r in rows),
                  items=ScriptJson(items), store=ScriptJson(f"pairclean-audit:{Path(scores).name}"))
    with target.write() as tmp:
        tmp.write_text(page, encoding="utf-8")
    return len(items)


MAX_MARKS_BYTES = 64 * 2**20  # an export of 100,000 marks is about 15 MB
MARKS = {"keep": False, "drop": True}  # mark -> noisy


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def read_marks(marks: str | Path) -> list[dict]:
    """The audit page's export, typed strictly: a JSON list (at most MAX_MARKS_BYTES) of objects
    with a string key and shard, an integer index >= 0 and a mark keep / drop; anything else is a
    UserError naming the entry (a mark on index 1.9 or true would land on another pair)."""
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
    if not isinstance(entries, list):
        raise UserError(f"{marks} is not an audit export: a JSON {type(entries).__name__}, not a list of marks")
    rows = []
    for n, entry in enumerate(entries):
        where = f"{marks} is not an audit export: entry {n}"
        if not isinstance(entry, dict):
            raise UserError(f"{where}: a JSON {type(entry).__name__}, not an object with key, shard, index, mark")
        for name in ("key", "shard"):
            if not isinstance(entry.get(name), str):
                raise UserError(f"{where}: {name} must be a string, got {json.dumps(entry.get(name))[:80]}")
        index = entry.get("index")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= INT64_MAX:
            raise UserError(f"{where}: index must be an integer from 0 to {INT64_MAX}, got {json.dumps(index)[:80]}")
        if entry.get("mark") not in MARKS:
            raise UserError(f"{where}: mark must be keep or drop, got {json.dumps(entry.get('mark'))[:80]}")
        rows.append({"key": entry["key"], "shard": entry["shard"], "index": index, "noisy": MARKS[entry["mark"]]})
    return rows


def import_marks(marks: str | Path, out: str | Path, overwrite: bool = False) -> int:
    """The exported marks JSON -> a truth Parquet (key, shard, index, noisy = marked drop); returns rows."""
    target = open_output(out, [marks], overwrite=overwrite)
    rows = read_marks(marks)
    if not rows:
        raise UserError(f"{marks} holds no marks")
    with target.write() as tmp:
        pq.write_table(pa.Table.from_pylist(rows, schema=MARKS_SCHEMA), tmp)
    return len(rows)

