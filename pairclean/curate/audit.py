"""The human audit: a self-contained HTML page of a stratified sample of scored pairs, where a
person marks keep / drop with the keyboard, and the import of those marks as a truth Parquet that
`evaluate detection --truth` accepts: measured precision on the user's own data, no noise injected.

The sample is stratified by similarity decile (DuckDB `ntile(10)`), `per_decile` pairs from each,
chosen by md5 of (seed, key), so the same command draws the same pairs. Thumbnails and texts come
from the shards through the report's reader path (`fetch_media`). The page holds everything it
shows (no network); its marks live in the page (and the browser's localStorage) until exported
as JSON, which `import_marks` turns into Parquet (key, shard, index, noisy).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.scores.db import ScoresDB
from pairclean.curate.report.media import fetch_media
from pairclean.data.manifest import open_dataset
from pairclean.config import COUNT, INT64_MAX, SEED, declare, within
from pairclean.errors import UserError
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


@declare(per_decile=COUNT, seed=SEED, thumb=within(1, 4096))
def build_audit(scores: str | Path, shards: list[str], out: str | Path, per_decile: int = 10, seed: int = 0,
                thumb: int = 256, pair: str | None = None, overwrite: bool = False) -> int:
    """Write the audit page; returns the number of pairs on it."""
    spec = open_dataset(shards, pair=pair)
    target = open_output(out, [scores, *shards, *spec.shards], overwrite=overwrite)
    with ScoresDB(scores) as db:
        rows = stratified_sample(db, per_decile, seed)
    if not rows:
        raise UserError(f"{scores} holds no scored pair to audit")
    media = fetch_media(spec, rows, thumb)
    items = []
    for r in rows:
        m = media[(r["shard"], int(r["index"]))]
        items.append({"key": r["key"], "shard": r["shard"], "index": int(r["index"]), "sim": round(float(r["sim"]), 4),
                      "decile": int(r["decile"]), "images": [src for src in m.images if src], "texts": m.texts,
                      "note": m.note})
    page = PAGE.replace("__TITLE__", html.escape(f"pairclean audit · {Path(scores).name}")).replace(
        "__ITEMS__", json.dumps(items).replace("</", "<\\/")).replace("__STORE__", json.dumps(f"pairclean-audit:{Path(scores).name}"))
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


PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:15px/1.4 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
header{background:#1d2330;color:#fff;padding:10px 20px;display:flex;gap:20px;align-items:center}
header h1{font-size:17px;margin:0;flex:1}
main{max-width:980px;margin:18px auto;padding:0 16px}
.card{background:#fff;border-radius:10px;box-shadow:0 1px 4px #0002;padding:18px;display:flex;gap:18px;align-items:flex-start}
.card img{max-width:320px;max-height:320px;border-radius:6px}
.texts p{margin:0 0 10px;font-size:17px}
.meta{color:#667;font-size:13px;margin-bottom:8px}
.mark{font-weight:700;padding:2px 10px;border-radius:12px}
.keep{background:#d8f3e0;color:#17693a}.drop{background:#fadcdc;color:#9b1c1c}.none{background:#e6e8ee;color:#556}
.help{color:#556;font-size:13px;margin:12px 0}
button{font:inherit;padding:6px 14px;border-radius:6px;border:1px solid #889;background:#fff;cursor:pointer}
#strip{display:flex;flex-wrap:wrap;gap:3px;margin-top:14px}
#strip span{width:14px;height:14px;border-radius:3px;background:#dde}
#strip span.keep{background:#3aa55d}#strip span.drop{background:#d64545}#strip span.cur{outline:2px solid #1d2330}
</style></head>
<body>
<header><h1>__TITLE__</h1><span id="progress"></span><button id="export">export marks (JSON)</button></header>
<main>
<div class="meta" id="meta"></div>
<div class="card"><div id="images"></div><div class="texts" id="texts"></div></div>
<p class="help"><b>k</b> keep (the pair belongs together) · <b>d</b> drop (mismatched) · <b>u</b> unmark ·
<b>&larr; &rarr;</b> previous / next · a mark moves to the next pair · export, then
<code>pairclean audit-import marks.json --out truth.parquet</code> and <code>pairclean evaluate detection SCORES --truth truth.parquet</code></p>
<div id="strip"></div>
</main>
<script>
const ITEMS = __ITEMS__;
const STORE = __STORE__;
let marks = {};
try { marks = JSON.parse(localStorage.getItem(STORE) || "{}"); } catch (e) { marks = {}; }
let cur = 0;
const id = it => it.shard + "#" + it.index;
function esc(s) { const d = document.createElement("div"); d.textContent = s; return d.innerHTML; }
function render() {
  const it = ITEMS[cur], m = marks[id(it)];
  document.getElementById("meta").innerHTML = `pair ${cur + 1} of ${ITEMS.length} · similarity decile ${it.decile} · sim ${it.sim} · key ${esc(it.key)} · <span class="mark ${m || "none"}">${m || "unmarked"}</span>`;
  document.getElementById("images").innerHTML = it.images.map(src => `<img src="${src}" alt="">`).join("");
  document.getElementById("texts").innerHTML = it.texts.map(t => `<p>${esc(t)}</p>`).join("") + (it.note ? `<p class="meta">${esc(it.note)}</p>` : "");
  const done = ITEMS.filter(x => marks[id(x)]).length;
  document.getElementById("progress").textContent = `${done} / ${ITEMS.length} marked`;
  document.getElementById("strip").innerHTML = ITEMS.map((x, i) => `<span class="${marks[id(x)] || ""}${i === cur ? " cur" : ""}" title="${i + 1}"></span>`).join("");
}
function mark(value) {
  const it = ITEMS[cur];
  if (value) marks[id(it)] = value; else delete marks[id(it)];
  try { localStorage.setItem(STORE, JSON.stringify(marks)); } catch (e) {}
  if (value && cur < ITEMS.length - 1) cur++;
  render();
}
function exportMarks() {
  return JSON.stringify(ITEMS.filter(it => marks[id(it)]).map(it => ({key: it.key, shard: it.shard, index: it.index, sim: it.sim, decile: it.decile, mark: marks[id(it)]})));
}
document.addEventListener("keydown", e => {
  if (e.key === "k") mark("keep");
  else if (e.key === "d") mark("drop");
  else if (e.key === "u") mark(null);
  else if (e.key === "ArrowRight" && cur < ITEMS.length - 1) { cur++; render(); }
  else if (e.key === "ArrowLeft" && cur > 0) { cur--; render(); }
});
document.getElementById("export").addEventListener("click", () => {
  const a = document.createElement("a");
  a.href = URL.createObjectURL(new Blob([exportMarks()], {type: "application/json"}));
  a.download = "marks.json";
  a.click();
});
render();
</script>
</body></html>
"""
