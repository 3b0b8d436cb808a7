"""The report's HTML: the page template (`page.html`) and style sheet (`report.css`) beside this
module, filled with the statistics, figures and media of one scores file."""

from __future__ import annotations

import html
import json
import math
import os
import time
from importlib.resources import files
from pathlib import Path
from string import Template

from pairclean import __version__
from pairclean.core.mixture import FittedMixture
from pairclean.curate.report.figures import gmm_boundaries, shard_figure, similarity_figure
from pairclean.curate.report.stats import ReportStats
from pairclean.curate.sweep import Sweep
from pairclean.scores.rules import RuleRecord

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
        badges = [_badge(f"{rule.label}: abstains", "abstains") if rule.abstains else
                  _badge(f"{rule.label}: noisy", "bad") if r[rule.decision] else _badge(f"{rule.label}: clean", "good")
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


def _sweep_html(sweep: Sweep | None) -> str:
    """The threshold sweep section (`curate.sweep`), or nothing for a run without a null sample."""
    if sweep is None:
        return ""
    rows = "".join(f"<tr><td>sim &gt; {r.threshold:.4f}</td><td>{_pct(r.null_above)}</td><td>{_pct(r.kept)}</td>"
                   f"<td>{_pct(r.precision)}</td><td>{_pct(r.clean_kept)}</td><td>{_pct(r.noise_caught)}</td></tr>"
                   for r in sweep.rows)
    return ('<section id="sweep"><h2>Choosing a threshold</h2><p class="lead">What each threshold would keep, '
            "estimated from the run's random pairings (in-data pairs that do not belong together) without labels: "
            f"pairs like random pairings (est.) {_pct(sweep.random_pairing_share)}. The estimates count noise as "
            "dissimilar as a random pairing; a caption of a similar item counts as clean here.</p><table class=\"data\"><thead><tr>"
            "<th>keep if</th><th>random pairings above</th><th>kept</th><th>est. precision</th>"
            f"<th>est. clean kept</th><th>est. noise caught</th></tr></thead><tbody>{rows}</tbody></table></section>")


def _truth_table(stats: ReportStats) -> str:
    if stats.truth is None:
        return ""

    def percent(value: float | None) -> str:  # truth_metrics' shares are in %
        return _pct(None if value is None else value / 100)

    rows = "".join(f"<tr><td>{_e(rule.label)}</td><td>{_e(rule.noisy_if)}</td><td>{m['flagged']:,}</td>"
                   f"<td>{percent(m['clean_kept'])}</td><td>{percent(m['noise_caught'])}</td>"
                   f"<td>{percent(m['balanced_accuracy'])}</td><td>{percent(m['precision'])}</td></tr>"
                   for rule in stats.rules for m in [stats.truth["rules"][rule.name]])
    return ("<h3>Against the truth labels</h3><table class=\"data\"><thead><tr><th>rule</th><th>noisy if</th>"
            "<th>flagged</th><th>clean kept</th><th>noise caught</th><th>balanced accuracy</th>"
            f"<th>precision</th></tr></thead><tbody>{rows}</tbody></table>")


def _cards(stats: ReportStats, prov: dict) -> list[str]:
    s, rules, n = stats.summary, stats.rules, stats.summary["scored"]
    cards = [
        _card("pairs", f"{s['pairs']:,}", f"{s['scored']:,} scored"),
        _card("errors", f"{s['errors']:,}", _pct(s["errors"] / s["pairs"]) + " of pairs",
              "warn" if s["errors"] else ""),
        _card("β (cone bias)", _num(prov.get("beta"), 4),
              f"± {_num(prov.get('beta_std'), 4)} · {_e(prov.get('beta_mode'))}", "beta"),
        *(_card(f"flagged by {rule.label} rule", _pct(s["flagged"][rule.name] / n if n else None),
                f"{s['flagged'][rule.name]:,} pairs with {_e(rule.noisy_if)}", f"rule {rule.name}") for rule in rules),
        _card("mean OSA weight", _num(s["mean_weight"], 4), f"{_pct(s['zero_weight'] / n if n else None)} weigh 0"),
    ]
    if stats.truth is not None:
        labelled, noisy = stats.truth["labelled"], stats.truth["noisy"]
        cards.append(_card("truly noisy", _pct(noisy / labelled if labelled else None),
                           f"{noisy:,} of {labelled:,} labelled (joined on {_e(stats.truth_join)})", "warn"))
    return cards


def _histogram_lead(mixture: FittedMixture | None, stats: ReportStats) -> str:
    edges = stats.edges
    boundaries = gmm_boundaries(mixture, float(edges[0]), float(edges[-1])) if mixture else []
    abstains = {r.name: r.abstains for r in stats.rules if r.abstains}
    gmm = (f"; the GMM rule abstains on these scores ({abstains['gmm']}): it flags nothing and no GMM boundary "
           "is drawn" if "gmm" in abstains else " and by the GMM when the posterior of the clean component is "
           "below 0.5" + (f" (left of the dotted line at s = {boundaries[0]:.3f})" if len(boundaries) == 1 else ""))
    lead = ("Cosine similarity of every scored pair. A pair is flagged by the OSA rule when its debiased "
            "similarity s − β is ≤ 0 (left of the dashed β line)" + gmm + ".")
    if stats.truth is not None:
        lead += " Colours are the ground truth: how well each boundary separates them is what to look at."
    return lead


def _errors(stats: ReportStats) -> str:
    if not stats.errors:
        return ""
    rows = "".join(f"<tr><td>{_e(e['error'])}</td><td>{e['n']:,}</td><td>{_e(e['example'])}</td></tr>"
                   for e in stats.errors)
    return (f'<section id="errors"><h2>Pairs that could not be scored</h2>'
            f'<p class="lead">{stats.summary["errors"]:,} pairs carry an error (weight 0, never kept by a '
            f'predicate on the scores).</p><table class="data"><thead><tr><th>reason</th><th>pairs</th>'
            f'<th>example key</th></tr></thead><tbody>{rows}</tbody></table></section>')


def render_page(scores: Path, prov: dict, stats: ReportStats, media: dict, media_note: str | None,
                heading: str, max_shard_rows: int) -> str:
    """The self-contained HTML page."""
    here = files("pairclean.curate.report")
    gmm_decides = not any(r.name == "gmm" and r.abstains for r in stats.rules)  # an abstaining GMM has no boundary
    mixture = FittedMixture(**prov["gmm"]) if prov.get("gmm") and gmm_decides else None
    truth = stats.truth is not None
    return Template((here / "page.html").read_text(encoding="utf-8")).substitute(
        heading=_e(heading), css=(here / "report.css").read_text(encoding="utf-8"),
        pairs=f"{stats.summary['pairs']:,}", pair=_e(prov.get("pair", "?")),
        estimator=_e(_estimator_line(prov.get("estimator") or {})),
        generated=_e(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())),
        cards="".join(_cards(stats, prov)), histogram_lead=_e(_histogram_lead(mixture, stats)),
        histogram=similarity_figure(stats.edges, stats.counts, prov.get("beta"), mixture, stats.summary["scored"]),
        truth_table=_truth_table(stats), sweep=_sweep_html(stats.sweep),
        shard_figure=shard_figure(stats.shards, truth, stats.rules),
        shard_table=_shard_table(stats.shards, truth, max_shard_rows, stats.rules),
        lowest_count=len(stats.lowest), media_note=f'<p class="muted">{_e(media_note)}</p>' if media_note else "",
        lowest=_gallery(stats.lowest, media, truth, stats.rules, "no scored pairs"),
        highest_count=len(stats.highest),
        highest=_gallery(stats.highest, media, truth, stats.rules, "every scored pair is shown above, or none was asked for"),
        errors=_errors(stats), provenance=_provenance_html(prov, scores), version=_e(__version__))
