"""`pairclean report`: one self-contained HTML page to look at scores before choosing a threshold.

Everything is computed by DuckDB over the scores file (histogram counts, per-shard statistics,
the lowest and highest pairs), so the report costs one scan per section, not the dataset in
memory. Figures are matplotlib SVGs and thumbnails JPEGs, both embedded as data URIs: the file
can be mailed or archived and still shows everything. Thumbnails come from the shards themselves,
read through the same source readers as scoring, only the shards that hold gallery pairs.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from pairclean import __version__
from pairclean.ops.guard import check_output
from pairclean.ops.atomic import atomic_path
from pairclean.data.decode import DecodeError, decode_image
from pairclean.errors import ConfigError, UserError
from pairclean.scores.evaluation import truth_metrics
from pairclean.curate.sweep import Sweep, threshold_sweep
from pairclean.scores.rules import RuleRecord, recorded_rules
from pairclean.core.mixture import FittedMixture
from pairclean.data.manifest import DatasetSpec, open_dataset
from pairclean.scores.db import ScoresDB, match_shards
from pairclean.scores.sql import sql_identifier
from pairclean.data.reader import RawPair, read_unit
from pairclean.data.units import Unit

CLEAN, NOISY, NEUTRAL, INK, MUTED = "#1b9e77", "#d95f02", "#5b6c8f", "#1f2430", "#6b7280"
BETA_COLOUR, GMM_COLOUR = "#7570b3", "#e7298a"
RULE_COLOURS = (BETA_COLOUR, GMM_COLOUR, "#66a61e", "#e6ab02", "#a6761d")  # per rule, in the file's rule order

MAX_BINS = 1000  # a histogram bar per bin: more is unreadable and grows the page without bound


@dataclass
class Media:
    """What the gallery shows of one pair: images (thumbnail data URIs) and texts."""

    images: list[str | None] = field(default_factory=list)  # None: present but undecodable
    texts: list[str] = field(default_factory=list)
    note: str | None = None  # why something is missing


@dataclass
class ReportResult:
    out: Path
    pairs: int
    gallery_pairs: int
    thumbnails: int
    media_note: str | None


# ---------------------------------------------------------------- data (DuckDB)

def _rows(db: ScoresDB, sql: str, params: list | None = None) -> list[dict]:
    rel = db.con.execute(sql, params or [])
    names = [d[0] for d in rel.description]
    return [dict(zip(names, r)) for r in rel.fetchall()]


def _summary(db: ScoresDB, view: str, rules: list[RuleRecord]) -> dict:
    """Counts and similarity statistics; `flagged` maps each rule's name to its flagged pairs."""
    flagged = "".join(f", count(*) FILTER (WHERE {sql_identifier(r.decision)} AND sim IS NOT NULL)" for r in rules)
    row = db.con.execute(f"""
        SELECT count(*) AS pairs, count(sim) AS scored, count(error) AS errors,
               count(*) FILTER (WHERE weight = 0 AND sim IS NOT NULL) AS zero_weight,
               avg(sim) AS mean_sim, min(sim) AS min_sim, max(sim) AS max_sim,
               avg(weight) FILTER (WHERE sim IS NOT NULL) AS mean_weight{flagged}
        FROM {view}""").fetchone()
    names = ("pairs", "scored", "errors", "zero_weight", "mean_sim", "min_sim", "max_sim", "mean_weight")
    return {**dict(zip(names, row)), "flagged": {r.name: n for r, n in zip(rules, row[len(names):])}}


def _truth_metrics(db: ScoresDB, rules: list[RuleRecord]) -> dict:
    """The scored pairs with a label, the truly noisy among them, and `truth_metrics` of each rule
    (by name) against the labels, counted by DuckDB."""
    labelled, noisy = db.con.execute("SELECT count(noisy), count(*) FILTER (WHERE noisy) FROM labeled "
                                     "WHERE sim IS NOT NULL").fetchone()
    out = {"labelled": labelled, "noisy": noisy, "rules": {}}
    for rule in rules:
        flagged = sql_identifier(rule.decision)
        counts = db.con.execute(f"""
            SELECT count(*) FILTER (WHERE {flagged} AND noisy), count(*) FILTER (WHERE NOT {flagged} AND noisy),
                   count(*) FILTER (WHERE {flagged} AND NOT noisy), count(*) FILTER (WHERE NOT {flagged} AND NOT noisy)
            FROM labeled WHERE sim IS NOT NULL""").fetchone()
        out["rules"][rule.name] = truth_metrics(*counts)
    return out


def _histogram(db: ScoresDB, view: str, lo: float, hi: float, bins: int, split: bool) -> tuple[np.ndarray, dict]:
    """Bin edges and counts per label (all | clean | noisy | unlabelled), counted by DuckDB."""
    width = (hi - lo) / bins
    label = "CASE WHEN noisy IS NULL THEN 'unlabelled' WHEN noisy THEN 'noisy' ELSE 'clean' END" if split else "'all'"
    rows = db.con.execute(f"""
        SELECT least(greatest(CAST(floor((sim - ?) / ?) AS BIGINT), 0), ?) AS b, {label} AS label, count(*) AS n
        FROM {view} WHERE sim IS NOT NULL AND NOT isnan(sim) GROUP BY ALL""", [lo, width, bins - 1]).fetchall()
    counts: dict[str, np.ndarray] = {}
    for b, name, n in rows:
        counts.setdefault(name, np.zeros(bins, np.int64))[int(b)] += n
    return np.linspace(lo, hi, bins + 1), counts


def _per_shard(db: ScoresDB, view: str, truth: bool, rules: list[RuleRecord]) -> list[dict]:
    """Per shard: counts, mean similarity and weight, and `share` flagged by each rule (by name)."""
    extra = ", avg(noisy::INT) FILTER (WHERE sim IS NOT NULL) AS share_true" if truth else ""
    shares = "".join(f", avg({sql_identifier(r.decision)}::INT) FILTER (WHERE sim IS NOT NULL) AS share_{i}"
                     for i, r in enumerate(rules))
    rows = _rows(db, f"""
        SELECT shard, count(*) AS pairs, count(error) AS errors, avg(sim) AS mean_sim,
               avg(weight) FILTER (WHERE sim IS NOT NULL) AS mean_weight{extra}{shares}
        FROM {view} GROUP BY shard ORDER BY shard""")
    return [{**row, "share": {r.name: row.pop(f"share_{i}") for i, r in enumerate(rules)}} for row in rows]


def _gallery_rows(db: ScoresDB, view: str, n: int, lowest: bool, truth: bool, rules: list[RuleRecord]) -> list[dict]:
    if n <= 0:
        return []
    order = "ASC" if lowest else "DESC"
    extra = "".join(f", {sql_identifier(column)}" for r in rules for column in r.columns) + (", noisy" if truth else "")
    return _rows(db, f"""
        SELECT key, shard, "index", sim, sim_debiased, weight{extra}
        FROM {view} WHERE sim IS NOT NULL AND NOT isnan(sim)
        ORDER BY sim {order}, shard, "index" LIMIT ?""", [n])


def _error_reasons(db: ScoresDB) -> list[dict]:
    return _rows(db, """SELECT error, count(*) AS n, min(key) AS example FROM scores
                        WHERE error IS NOT NULL GROUP BY error ORDER BY n DESC, error LIMIT 12""")


# ---------------------------------------------------------------- media from the shards

def thumbnail_uri(data: bytes, size: int) -> str:
    """A JPEG data URI no larger than size x size (raises DecodeError for a bad image)."""
    img = decode_image(data, draft_size=size)
    img.thumbnail((size, size))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85, optimize=True)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def _media_spec(shards: list[str] | None, provenance: dict) -> tuple[DatasetSpec | None, str | None]:
    """The dataset to take thumbnails from: `shards`, else the shards named in the provenance."""
    pair = provenance.get("pair")
    if shards:
        return open_dataset(shards, pair=pair), None
    recorded = provenance.get("input_shards") or []
    present = [s for s in recorded if os.path.exists(s)]
    if not recorded or len(present) < len(recorded):
        return None, "pass `shards` to see the pairs: the scored shards are not where the scores say"
    try:
        return open_dataset(present, pair=pair), None
    except UserError as exc:  # e.g. scored from precomputed embeddings: the inputs hold no pairs to show
        return None, f"pass `shards` to see the pairs: the scored inputs are not a dataset of pairs ({exc})"


def _units_for(spec: DatasetSpec, path: str, indices: set[int]) -> dict[str, set[int]]:
    """The units (a tar shard, or the Parquet row groups) holding these row indices."""
    if spec.format == "webdataset":
        return {path: indices}
    meta = pq.ParquetFile(path).metadata
    starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    units: dict[str, set[int]] = {}
    for i in indices:
        g = int(np.searchsorted(starts, i, side="right") - 1)
        units.setdefault(str(Unit.row_group(path, g)), set()).add(i)
    return units


def _read_pairs(spec: DatasetSpec, wanted: dict[str, set[int]]) -> dict[tuple[str, int], RawPair]:
    """RawPairs at the wanted (shard path -> indices); stops reading a unit once all are found."""
    found: dict[tuple[str, int], RawPair] = {}
    for path, indices in wanted.items():
        for unit, needed in _units_for(spec, path, indices).items():
            left = set(needed)
            for item in read_unit(spec, unit):
                if isinstance(item, RawPair) and item.index in left:
                    found[(path, item.index)] = item
                    left.discard(item.index)
                    if not left:
                        break
    return found


def _thumb(data, size: int) -> str | None:
    try:
        return thumbnail_uri(data, size)
    except DecodeError:
        return None


def fetch_media(spec: DatasetSpec, rows: list[dict], thumb: int) -> dict[tuple[str, int], Media]:
    """Thumbnails and texts for gallery rows (keyed by the scored (shard, index))."""
    mapping = {scored: given for given, scored in match_shards(spec.shards, sorted({r["shard"] for r in rows})).items()
               if scored is not None}
    wanted: dict[str, set[int]] = {}
    for r in rows:
        if r["shard"] in mapping:
            wanted.setdefault(mapping[r["shard"]], set()).add(int(r["index"]))
    pairs = _read_pairs(spec, wanted)
    # Text-text pairs often come from image datasets: show the sample's image as context.
    context = {}
    if spec.pair == "text-text":
        context = _read_pairs(DatasetSpec(format=spec.format, shards=spec.shards, pair="image-text",
                                          fields=spec.fields), wanted)
    media = {}
    for r in rows:
        key = (r["shard"], int(r["index"]))
        path = mapping.get(r["shard"])
        pair = pairs.get((path, key[1])) if path else None
        if pair is None:
            media[key] = Media(note="not found in the given shards")
            continue
        m = Media()
        for side in (pair.left, pair.right):
            if isinstance(side, bytes):
                m.images.append(_thumb(side, thumb))
            elif isinstance(side, str):
                m.texts.append(side)
        ctx = context.get((path, key[1]))
        if ctx is not None and isinstance(ctx.left, bytes):
            m.images.insert(0, _thumb(ctx.left, thumb))
        media[key] = m
    return media


# ---------------------------------------------------------------- figures

def _svg_uri(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode()


def _style(ax) -> None:
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_color("#c8ccd4")
    ax.tick_params(colors=MUTED, labelsize=9)
    ax.grid(axis="y", color="#eceef2", linewidth=0.8)
    ax.set_axisbelow(True)


def gmm_boundaries(mixture: FittedMixture, lo: float, hi: float) -> list[float]:
    """Similarities where p_clean crosses 0.5 inside [lo, hi] (two when the variances differ a lot)."""
    grid = np.linspace(lo, hi, 4001)
    d = mixture.p_clean(grid) - 0.5
    idx = np.nonzero(np.sign(d[:-1]) * np.sign(d[1:]) < 0)[0]
    return [float(grid[i] - d[i] * (grid[i + 1] - grid[i]) / (d[i + 1] - d[i])) for i in idx]


def similarity_figure(edges: np.ndarray, counts: dict, beta: float | None, mixture: FittedMixture | None,
                      n_scored: int) -> str:
    """Histogram of cosine similarity with the beta and GMM boundaries (clean/noisy split with truth)."""
    fig = Figure(figsize=(11, 4.2), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    _style(ax)
    lo, hi = float(edges[0]), float(edges[-1])
    if "all" in counts:
        ax.stairs(counts["all"], edges, fill=True, color=NEUTRAL, alpha=0.55, label=f"pairs ({n_scored:,})")
        ax.stairs(counts["all"], edges, color=NEUTRAL, linewidth=1.0)
    else:
        for name, colour in (("clean", CLEAN), ("noisy", NOISY), ("unlabelled", "#9ca3af")):
            if name in counts:
                ax.stairs(counts[name], edges, fill=True, color=colour, alpha=0.45,
                          label=f"truly {name} ({int(counts[name].sum()):,})" if name != "unlabelled"
                          else f"unlabelled ({int(counts[name].sum()):,})")
                ax.stairs(counts[name], edges, color=colour, linewidth=1.2)
    if mixture is not None:
        x = np.linspace(lo, hi, 400)
        width = (hi - lo) / (len(edges) - 1)
        for k in range(len(mixture.means)):
            pdf = (mixture.weights[k] * np.exp(-0.5 * (x - mixture.means[k]) ** 2 / mixture.variances[k])
                   / math.sqrt(2 * math.pi * mixture.variances[k]))
            clean = k == mixture.clean_component
            ax.plot(x, pdf * n_scored * width, color=CLEAN if clean else NOISY, linewidth=1.4,
                    linestyle="-" if clean else "--",
                    label=f"GMM {'clean' if clean else 'noisy'} component (μ={mixture.means[k]:.3f})")
        for j, b in enumerate(gmm_boundaries(mixture, lo, hi)):
            ax.axvline(b, color=GMM_COLOUR, linestyle=":", linewidth=2,
                       label=f"GMM boundary p_clean = 0.5 (s = {b:.3f})" if j == 0 else None)
    if beta is not None and lo <= beta <= hi:
        ax.axvline(beta, color=BETA_COLOUR, linestyle="--", linewidth=2,
                   label=f"β = {beta:.3f}: OSA boundary (s − β ≤ 0 is noisy)")
    elif beta is not None:
        ax.annotate(f"β = {beta:.3f} (outside the plotted range)", xy=(0.01, 0.95), xycoords="axes fraction",
                    color=BETA_COLOUR, fontsize=9, va="top")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("cosine similarity s", color=INK)
    ax.set_ylabel("pairs", color=INK)
    fig.legend(frameon=False, fontsize=9, loc="outside right upper")
    return _svg_uri(fig)


def shard_figure(shards: list[dict], truth: bool, rules: list[RuleRecord]) -> str:
    """Share of pairs flagged per shard and rule (in shard order), to spot a bad source at a glance."""
    n = len(shards)
    fig = Figure(figsize=(11, 2.9), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    _style(ax)
    x = np.arange(n)
    width = 0.8 / max(len(rules), 1)
    for i, rule in enumerate(rules):
        share = np.array([s["share"][rule.name] if s["share"][rule.name] is not None else np.nan for s in shards],
                         float)
        colour, label = RULE_COLOURS[i % len(RULE_COLOURS)], f"flagged by {rule.label} rule"
        if n <= 80:
            ax.bar(x + (i - (len(rules) - 1) / 2) * width, share, width=width, color=colour, alpha=0.8, label=label)
        else:
            ax.plot(x, share, color=colour, linewidth=1, label=label)
    if truth:
        true = np.array([s["share_true"] if s["share_true"] is not None else np.nan for s in shards], float)
        ax.plot(x, true, color=INK, marker="o" if n <= 80 else None, markersize=4, linewidth=1.2,
                label="truly noisy")
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(lambda v, _pos: f"{v:.0%}")
    ax.set_xlabel(f"shard (in order, {n:,} shards)", color=INK)
    ax.set_ylabel("share of pairs", color=INK)
    if n <= 12:
        # Shard names are user text: `$...$` in one is a file name, not mathtext to typeset.
        ax.set_xticks(x, [os.path.basename(s["shard"]) for s in shards], fontsize=8, parse_math=False)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.legend(frameon=False, fontsize=9, loc="outside right upper")
    return _svg_uri(fig)


# ---------------------------------------------------------------- HTML

def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _num(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


def _pct(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.1%}"


def _card(label: str, value: str, sub: str = "", tone: str = "") -> str:
    return (f'<div class="stat {tone}"><div class="stat-label">{_e(label)}</div>'
            f'<div class="stat-value">{value}</div><div class="stat-sub">{sub}</div></div>')


def _badge(text: str, tone: str) -> str:
    return f'<span class="badge {tone}">{_e(text)}</span>'


def _gallery(rows: list[dict], media: dict, truth: bool, rules: list[RuleRecord], empty_note: str) -> str:
    if not rows:
        return f'<p class="muted">{_e(empty_note)}</p>'
    cards = []
    for rank, r in enumerate(rows, 1):
        m = media.get((r["shard"], int(r["index"])))
        pics = ""
        if m is not None and m.images:
            pics = "".join(f'<img src="{src}" alt="{_e(r["key"])}" loading="eager">' if src
                           else '<div class="noimg">image cannot be decoded</div>' for src in m.images)
            pics = f'<div class="pics n{len(m.images)}">{pics}</div>'
        elif m is not None and not m.texts:
            pics = f'<div class="pics"><div class="noimg">{_e(m.note or "no image")}</div></div>'
        texts = "".join(f'<p class="caption">{_e(t)}</p>' for t in (m.texts if m else []))
        badges = [_badge(f"{rule.label}: noisy", "bad") if r[rule.decision] else _badge(f"{rule.label}: clean", "good")
                  for rule in rules]
        rule_values = "".join(f'<span>{_e(column)} <b>{_num(r[column])}</b></span>'
                              for rule in rules for column in rule.columns if column != rule.decision)
        if truth and r.get("noisy") is not None:
            badges.append(_badge("truth: noisy", "truth-bad") if r["noisy"] else _badge("truth: clean", "truth-good"))
        cards.append(f"""
<figure class="pair">
  {pics}
  <figcaption>
    <div class="rank">#{rank}</div>
    {texts}
    <div class="metrics"><span title="cosine similarity">s <b>{_num(r['sim'])}</b></span>
      <span title="debiased similarity s − β">s̃ <b>{_num(r['sim_debiased'])}</b></span>
      <span title="OSA weight">w <b>{_num(r['weight'], 4)}</b></span>
      {rule_values}</div>
    <div class="badges">{''.join(badges)}</div>
    <div class="where">key {_e(r['key'])}</div>
    <div class="where" title="{_e(r['shard'])}">{_e(os.path.basename(r['shard']))} #{int(r['index'])}</div>
  </figcaption>
</figure>""")
    return f'<div class="gallery">{"".join(cards)}</div>'


def _shard_table(shards: list[dict], truth: bool, max_rows: int, rules: list[RuleRecord]) -> str:
    ranked = sorted(shards, key=lambda s: (-max((v or 0) for v in s["share"].values()) if rules else 0,
                                           s["shard"]))[:max_rows]
    head = ("<tr><th>shard</th><th>pairs</th><th>errors</th><th>mean s</th>"
            + "".join(f"<th>flagged {_e(r.label)}</th>" for r in rules)
            + "<th>mean weight</th>" + ("<th>truly noisy</th>" if truth else "") + "</tr>")
    body = "".join(
        f'<tr><td title="{_e(s["shard"])}">{_e(os.path.basename(s["shard"]))}</td><td>{s["pairs"]:,}</td>'
        f'<td>{s["errors"]:,}</td><td>{_num(s["mean_sim"])}</td>'
        + "".join(f'<td>{_pct(s["share"][r.name])}</td>' for r in rules)
        + f'<td>{_num(s["mean_weight"], 4)}</td>'
        + (f'<td>{_pct(s["share_true"])}</td>' if truth else "") + "</tr>" for s in ranked)
    note = (f'<p class="muted">The {max_rows} shards with the highest share flagged by any rule, of {len(shards):,}; '
            f'all of them: <code>pairclean query SCORES -f docs/queries/share-flagged-per-shard.sql</code>.</p>'
            if len(shards) > max_rows else "")
    return f'<table class="data"><thead>{head}</thead><tbody>{body}</tbody></table>{note}'


def _estimator_line(est: dict) -> str:
    """backend · model · pretrained tag, leaving out what the backend does not record."""
    parts = [est.get("backend"), est.get("model"),
             f"pretrained {est['pretrained']}" if est.get("pretrained") else None,
             f"checkpoint sha256 {est['checkpoint_sha256'][:12]}…" if est.get("checkpoint_sha256") else None]
    return " · ".join(str(p) for p in parts if p) or "not recorded"


def _provenance_html(prov: dict, scores: Path) -> str:
    est = prov.get("estimator") or {}
    gmm = prov.get("gmm") or {}
    items = [
        ("scores file", str(scores)),
        ("estimator", _estimator_line(est)),
        ("precision / device", f"{est.get('precision', '?')} / {est.get('device', '?')}"),
        ("pair kind", prov.get("pair", "?")),
        ("dataset", prov.get("dataset") or f"{len(prov.get('input_shards') or []):,} shards"),
        ("β", f"{_num(prov.get('beta'), 4)} ± {_num(prov.get('beta_std'), 4)} "
              f"({prov.get('beta_mode')}, K = {prov.get('beta_k')})"),
        ("weight function", str(prov.get("weight_fn"))),
        ("GMM", ", ".join(f"μ={m:.3f} σ²={v:.4f} π={w:.2f}" for m, v, w in
                          zip(gmm.get("means", []), gmm.get("variances", []), gmm.get("weights", [])))
         + (f" (fitted on {gmm.get('n_fit', 0):,} pairs)" if gmm else "not fitted")),
        ("scored with", f"pairclean {prov.get('pairclean_version', '?')}, finished {prov.get('finished_at', '?')}"),
    ]
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in items)
    full = _e(json.dumps(prov, indent=2, sort_keys=True, default=str))
    return (f'<table class="kv">{rows}</table><details><summary>full provenance (JSON)</summary>'
            f"<pre>{full}</pre></details>")


CSS = """
:root { --ink:#1f2430; --muted:#6b7280; --line:#e5e7eb; --bg:#f6f7f9; --card:#fff;
        --good:#1b9e77; --bad:#d95f02; --beta:#7570b3; --gmm:#e7298a; }
* { box-sizing: border-box; }
body { margin:0; font-family: "Liberation Sans", "Helvetica Neue", Arial, sans-serif; color:var(--ink);
       background:var(--bg); line-height:1.45; }
header { background:#1f2430; color:#fff; padding:28px 40px 24px; }
header h1 { margin:0 0 4px; font-size:26px; font-weight:600; letter-spacing:.2px; }
header .sub { color:#c9cdd6; font-size:14px; }
main { max-width:1320px; margin:0 auto; padding:24px 40px 60px; }
section { background:var(--card); border:1px solid var(--line); border-radius:10px; padding:20px 24px;
          margin:20px 0; }
h2 { font-size:18px; margin:0 0 6px; }
.lead { color:var(--muted); margin:0 0 14px; font-size:14px; }
.stats { display:grid; grid-template-columns:repeat(auto-fit, minmax(150px, 1fr)); gap:12px; margin-top:-44px; }
.stat { background:var(--card); border:1px solid var(--line); border-radius:10px; padding:12px 14px;
        box-shadow:0 1px 2px rgba(0,0,0,.04); }
.stat-label { font-size:12px; color:var(--muted); text-transform:uppercase; letter-spacing:.5px; }
.stat-value { font-size:24px; font-weight:600; margin-top:2px; }
.stat-sub { font-size:12px; color:var(--muted); }
.stat.rule { border-top:3px solid var(--muted); }
.stat.beta { border-top:3px solid var(--beta); } .stat.gmm { border-top:3px solid var(--gmm); }
.stat.warn { border-top:3px solid var(--bad); }
img.figure { width:100%; height:auto; display:block; }
table.data, table.kv { border-collapse:collapse; width:100%; font-size:13px; }
table.data th, table.data td { padding:6px 10px; border-bottom:1px solid var(--line); text-align:right; }
table.data th:first-child, table.data td:first-child { text-align:left; }
table.data th { color:var(--muted); font-weight:600; }
table.kv th { text-align:left; color:var(--muted); font-weight:600; padding:5px 16px 5px 0; width:200px;
              vertical-align:top; }
table.kv td { padding:5px 0; }
.gallery { display:grid; grid-template-columns:repeat(auto-fill, minmax(210px, 1fr)); gap:14px; }
figure.pair { margin:0; background:#fff; border:1px solid var(--line); border-radius:10px; overflow:hidden;
              display:flex; flex-direction:column; }
.pics { display:flex; background:#eef0f3; }
.pics img { width:100%; height:170px; object-fit:contain; display:block; }
.pics.n2 img { width:50%; }
.noimg { height:170px; width:100%; display:flex; align-items:center; justify-content:center;
         color:var(--muted); font-size:12px; }
figcaption { padding:10px 12px 12px; font-size:13px; position:relative; flex:1; }
.rank { position:absolute; top:-30px; left:8px; background:rgba(31,36,48,.82); color:#fff; font-size:11px;
        border-radius:5px; padding:2px 6px; }
.caption { margin:0 0 8px; font-style:italic; }
.caption + .caption { border-top:1px dashed var(--line); padding-top:6px; }
.metrics { display:flex; flex-wrap:wrap; gap:4px 10px; color:var(--muted); font-size:12px; }
.metrics b { color:var(--ink); font-weight:600; }
.badges { margin:7px 0 5px; display:flex; flex-wrap:wrap; gap:4px; }
.badge { font-size:11px; border-radius:20px; padding:1px 8px; border:1px solid; }
.badge.good { color:var(--good); border-color:#a7dccb; background:#eef9f5; }
.badge.bad { color:var(--bad); border-color:#f3c29f; background:#fdf3ec; }
.badge.truth-good { color:#fff; background:var(--good); border-color:var(--good); }
.badge.truth-bad { color:#fff; background:var(--bad); border-color:var(--bad); }
.where { margin-top:2px; font-size:11px; color:var(--muted); font-family:"DejaVu Sans Mono", monospace;
         overflow:hidden; text-overflow:ellipsis; white-space:nowrap; }
.muted { color:var(--muted); font-size:13px; }
details summary { cursor:pointer; color:var(--muted); margin-top:10px; font-size:13px; }
pre { background:#f3f4f6; padding:12px; border-radius:8px; overflow:auto; font-size:12px; }
footer { text-align:center; color:var(--muted); font-size:12px; padding-bottom:30px; }
"""

# Marks the page once every <img> has loaded (or failed): headless checks read it from the DOM.
LOAD_CHECK = """<script>
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.documentElement.setAttribute("data-images-loaded", ok + "/" + imgs.length);
});
</script>"""


def _sweep_html(sweep: Sweep | None) -> str:
    """The threshold sweep section (`curate.sweep`), or nothing for a run without a null sample."""
    if sweep is None:
        return ""
    rows = "".join(f"<tr><td>sim &gt; {r.threshold:.4f}</td><td>{_pct(r.null_above)}</td><td>{_pct(r.kept)}</td>"
                   f"<td>{_pct(r.precision)}</td><td>{_pct(r.clean_kept)}</td><td>{_pct(r.noise_caught)}</td></tr>"
                   for r in sweep.rows)
    return ('<section id="sweep"><h2>Choosing a threshold</h2><p class="lead">What each threshold would keep, '
            "estimated from the run's random pairings (in-data pairs that do not belong together) without labels: "
            f"estimated noise share {_pct(sweep.noise_share)}. The estimates count noise as dissimilar as a random "
            "pairing; a caption of a similar item counts as clean here.</p><table class=\"data\"><thead><tr>"
            "<th>keep if</th><th>random pairings above</th><th>kept</th><th>est. precision</th>"
            f"<th>est. clean kept</th><th>est. noise caught</th></tr></thead><tbody>{rows}</tbody></table></section>")


def build_report(scores: str | Path, out: str | Path, shards: list[str] | None = None,
                 truth: str | Path | None = None, gallery: int = 24, contrast: int = 8, thumb: int = 224,
                 bins: int = 60, max_shard_rows: int = 40, title: str | None = None) -> ReportResult:
    """Write the HTML report for a scores file; thumbnails come from `shards` (or the scored paths)."""
    scores, out = Path(scores), Path(out)
    check_output(out, [scores, truth, *(shards or [])])
    if gallery < 0 or contrast < 0:
        raise ConfigError("gallery and contrast must not be negative", "gallery", "contrast")
    if not 2 <= bins <= MAX_BINS:
        raise ConfigError(f"bins must be within [2, {MAX_BINS}], got {bins}", "bins")
    with ScoresDB(scores, truth=truth) as db:
        prov = db.provenance
        if prov is None:
            raise UserError(f"{scores} has no pairclean provenance (not written by pairclean score?)")
        has_truth = truth is not None
        view = "labeled" if has_truth else "scores"
        rules = recorded_rules(prov, db.columns(view))
        s = _summary(db, view, rules)
        if s["pairs"] == 0:
            raise UserError(f"{scores} holds no pairs")
        metrics = _truth_metrics(db, rules) if has_truth else None
        lo = s["min_sim"] if s["min_sim"] is not None else 0.0
        hi = s["max_sim"] if s["max_sim"] is not None else 1.0
        if prov.get("beta") is not None:
            lo, hi = min(lo, prov["beta"]), max(hi, prov["beta"])
        pad = max(hi - lo, 1e-3) * 0.03
        edges, counts = _histogram(db, view, lo - pad, hi + pad, bins, has_truth)
        per_shard = _per_shard(db, view, has_truth, rules)
        low_rows = _gallery_rows(db, view, min(gallery, s["scored"]), True, has_truth, rules)
        # Few pairs: the highest are the ones not already shown as lowest.
        high_rows = _gallery_rows(db, view, min(contrast, s["scored"] - len(low_rows)), False, has_truth, rules)
        errors = _error_reasons(db)
        truth_join = db.truth_join
        sweep = threshold_sweep(db, prov.get("null_quantiles"), view)

    mixture = FittedMixture(**prov["gmm"]) if prov.get("gmm") else None
    spec, media_note = _media_spec(shards, prov)
    media = fetch_media(spec, low_rows + high_rows, thumb) if spec is not None else {}
    thumbnails = sum(1 for m in media.values() for src in m.images if src)

    n = s["scored"]
    stats = [
        _card("pairs", f"{s['pairs']:,}", f"{s['scored']:,} scored"),
        _card("errors", f"{s['errors']:,}", _pct(s["errors"] / s["pairs"]) + " of pairs",
              "warn" if s["errors"] else ""),
        _card("β (cone bias)", _num(prov.get("beta"), 4),
              f"± {_num(prov.get('beta_std'), 4)} · {_e(prov.get('beta_mode'))}", "beta"),
        *(_card(f"flagged by {rule.label} rule", _pct(s["flagged"][rule.name] / n if n else None),
                f"{s['flagged'][rule.name]:,} pairs with {_e(rule.noisy_if)}", f"rule {rule.name}") for rule in rules),
        _card("mean OSA weight", _num(s["mean_weight"], 4), f"{_pct(s['zero_weight'] / n if n else None)} weigh 0"),
    ]
    truth_html = ""
    if metrics is not None:
        labelled, noisy = metrics["labelled"], metrics["noisy"]
        stats.append(_card("truly noisy", _pct(noisy / labelled if labelled else None),
                           f"{noisy:,} of {labelled:,} labelled (joined on {_e(truth_join)})", "warn"))

        def percent(value: float | None) -> str:  # truth_metrics' shares are in %
            return _pct(None if value is None else value / 100)

        rows = "".join(f"<tr><td>{_e(rule.label)}</td><td>{_e(rule.noisy_if)}</td><td>{m['flagged']:,}</td>"
                       f"<td>{percent(m['clean_kept'])}</td><td>{percent(m['noise_caught'])}</td>"
                       f"<td>{percent(m['balanced_accuracy'])}</td><td>{percent(m['precision'])}</td></tr>"
                       for rule in rules for m in [metrics["rules"][rule.name]])
        truth_html = ("<h3>Against the truth labels</h3><table class=\"data\"><thead><tr><th>rule</th><th>noisy if</th>"
                      "<th>flagged</th><th>clean kept</th><th>noise caught</th><th>balanced accuracy</th>"
                      f"<th>precision</th></tr></thead><tbody>{rows}</tbody></table>")

    boundaries = gmm_boundaries(mixture, float(edges[0]), float(edges[-1])) if mixture else []
    hist_lead = ("Cosine similarity of every scored pair. A pair is flagged by the OSA rule when its debiased "
                 "similarity s − β is ≤ 0 (left of the dashed β line) and by the GMM when the posterior of the "
                 "clean component is below 0.5" + (f" (left of the dotted line at s = {boundaries[0]:.3f})"
                                                   if len(boundaries) == 1 else "") + ".")
    if has_truth:
        hist_lead += " Colours are the ground truth: how well each boundary separates them is what to look at."
    errors_html = ""
    if errors:
        erows = "".join(f"<tr><td>{_e(e['error'])}</td><td>{e['n']:,}</td><td>{_e(e['example'])}</td></tr>"
                        for e in errors)
        errors_html = (f'<section id="errors"><h2>Pairs that could not be scored</h2>'
                       f'<p class="lead">{s["errors"]:,} pairs carry an error (weight 0, never kept by a '
                       f'predicate on the scores).</p><table class="data"><thead><tr><th>reason</th><th>pairs</th>'
                       f'<th>example key</th></tr></thead><tbody>{erows}</tbody></table></section>')
    media_html = f'<p class="muted">{_e(media_note)}</p>' if media_note else ""
    sweep_html = _sweep_html(sweep)
    est = prov.get("estimator") or {}
    heading = title or f"pairclean report · {scores.name}"
    page = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(heading)}</title>
<style>{CSS}</style>
{LOAD_CHECK}
</head>
<body>
<header>
  <h1>{_e(heading)}</h1>
  <div class="sub">{s['pairs']:,} pairs · {_e(prov.get('pair', '?'))} · {_e(_estimator_line(est))}
  · generated {_e(time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()))}</div>
  <div style="height:44px"></div>
</header>
<main>
<div class="stats">{''.join(stats)}</div>

<section id="similarity">
  <h2>Similarity distribution</h2>
  <p class="lead">{_e(hist_lead)}</p>
  <img class="figure" alt="similarity histogram" src="{similarity_figure(edges, counts, prov.get('beta'), mixture, n)}">
  {truth_html}
</section>

{sweep_html}

<section id="shards">
  <h2>Per shard</h2>
  <p class="lead">A shard far above the others usually means a broken source (wrong captions, a scraper bug).</p>
  <img class="figure" alt="flagged share per shard" src="{shard_figure(per_shard, has_truth, rules)}">
  {_shard_table(per_shard, has_truth, max_shard_rows, rules)}
</section>

<section id="lowest">
  <h2>The {len(low_rows)} lowest-scoring pairs</h2>
  <p class="lead">The most likely mismatches: lowest cosine similarity first.</p>
  {media_html}
  {_gallery(low_rows, media, has_truth, rules, "no scored pairs")}
</section>

<section id="highest">
  <h2>The {len(high_rows)} highest-scoring pairs</h2>
  <p class="lead">For contrast: what the estimator considers a good match.</p>
  {_gallery(high_rows, media, has_truth, rules, "every scored pair is shown above, or none was asked for")}
</section>

{errors_html}

<section id="provenance">
  <h2>Provenance</h2>
  <p class="lead">How these scores were made (stored in the Parquet metadata of the scores file).</p>
  {_provenance_html(prov, scores)}
</section>
</main>
<footer>pairclean {_e(__version__)} · self-contained report: figures and thumbnails are embedded</footer>
</body>
</html>
"""
    with atomic_path(out) as tmp:
        tmp.write_text(page, encoding="utf-8")
    return ReportResult(out=out, pairs=s["pairs"], gallery_pairs=len(low_rows) + len(high_rows),
                        thumbnails=thumbnails, media_note=media_note)
