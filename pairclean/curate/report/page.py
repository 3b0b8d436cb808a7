"""The report's HTML: the page template (`page.html`) and style sheet (`report.css`) beside this
module, filled with the statistics, figures and media of one scores file. Every piece is made by
`curate.pages.render`, the one way data enters a page."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from pairclean import __version__
from pairclean.core.mixture import FittedMixture
from pairclean.curate.pages import Html, join, render, template
from pairclean.curate.report.figures import gmm_boundaries, shard_figure, similarity_figure
from pairclean.curate.report.stats import ReportStats
from pairclean.curate.sweep import Sweep
from pairclean.scorefile.contract import Provenance
from pairclean.scorefile.rules import RuleRecord


def _num(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


def _pct(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.1%}"


def _card(label: str, value: str, sub: str = "", tone: str = "") -> Html:
    return render('<div class="stat {{tone}}"><div class="stat-label">{{label}}</div>'
                  '<div class="stat-value">{{value}}</div><div class="stat-sub">{{sub}}</div></div>',
                  tone=tone, label=label, value=value, sub=sub)


def _badge(text: str, tone: str) -> Html:
    return render('<span class="badge {{tone}}">{{text}}</span>', text=text, tone=tone)


def _pictures(m, key: str) -> Html:
    if m is not None and m.images:
        pics = join(render('<img src="{{src}}" alt="{{key}}" loading="eager">', src=src, key=key) if src
                    else Html('<div class="noimg">image cannot be decoded</div>') for src in m.images)
        return render('<div class="pics n{{n}}">{{pics}}</div>', n=len(m.images), pics=pics)
    if m is not None and not m.texts:
        return render('<div class="pics"><div class="noimg">{{note}}</div></div>', note=m.note or "no image")
    return Html("")


_PAIR = """
<figure class="pair">
  {{pictures}}
  <figcaption>
    <div class="rank">#{{rank}}</div>
    {{texts}}
    <div class="metrics"><span title="cosine similarity">s <b>{{sim}}</b></span>
      <span title="debiased similarity s − β">s̃ <b>{{sim_debiased}}</b></span>
      <span title="OSA weight">w <b>{{weight}}</b></span>
      {{rule_values}}</div>
    <div class="badges">{{badges}}</div>
    <div class="where">key {{key}}</div>
    <div class="where" title="{{shard}}">{{shard_name}} #{{index}}</div>
  </figcaption>
</figure>"""


def _gallery(rows: list[dict], media: dict, truth: bool, rules: list[RuleRecord], empty_note: str) -> Html:
    if not rows:
        return render('<p class="muted">{{note}}</p>', note=empty_note)
    cards = []
    for rank, r in enumerate(rows, 1):
        m = media.get((r["shard"], int(r["index"])))
        badges = [_badge(f"{rule.label}: abstains", "abstains") if rule.abstains else
                  _badge(f"{rule.label}: noisy", "bad") if r[rule.decision] else _badge(f"{rule.label}: clean", "good")
                  for rule in rules]
        if truth and r.get("noisy") is not None:
            badges.append(_badge("truth: noisy", "truth-bad") if r["noisy"] else _badge("truth: clean", "truth-good"))
        cards.append(render(
            _PAIR, pictures=_pictures(m, r["key"]), rank=rank,
            texts=join(render('<p class="caption">{{text}}</p>', text=t) for t in (m.texts if m else [])),
            sim=_num(r["sim"]), sim_debiased=_num(r["sim_debiased"]), weight=_num(r["weight"], 4),
            rule_values=join(render("<span>{{column}} <b>{{value}}</b></span>", column=column, value=_num(r[column]))
                             for rule in rules for column in rule.columns if column != rule.decision),
            badges=join(badges), key=r["key"], shard=r["shard"], shard_name=os.path.basename(r["shard"]),
            index=int(r["index"])))
    return render('<div class="gallery">{{cards}}</div>', cards=join(cards))


def _cells(tag: str, values) -> Html:
    """One table row's cells."""
    return join(render(f"<{tag}>{{{{value}}}}</{tag}>", value=v) for v in values)


def _table(head: list[str], rows: list[list], css: str = "data") -> Html:
    return render('<table class="{{css}}"><thead><tr>{{head}}</tr></thead><tbody>{{rows}}</tbody></table>',
                  css=css, head=_cells("th", head), rows=join(render("<tr>{{cells}}</tr>", cells=_cells("td", r))
                                                             for r in rows))


def _shard_table(shards: list[dict], truth: bool, max_rows: int, rules: list[RuleRecord]) -> Html:
    ranked = sorted(shards, key=lambda s: (-max((v or 0) for v in s["share"].values()) if rules else 0,
                                           s["shard"]))[:max_rows]
    head = ["shard", "pairs", "errors", "mean s", *(f"flagged {r.label}" for r in rules), "mean weight",
            *(["truly noisy"] if truth else [])]
    rows = [[render('<span title="{{shard}}">{{name}}</span>', shard=s["shard"], name=os.path.basename(s["shard"])),
             f'{s["pairs"]:,}', f'{s["errors"]:,}', _num(s["mean_sim"]), *(_pct(s["share"][r.name]) for r in rules),
             _num(s["mean_weight"], 4), *([_pct(s["share_true"])] if truth else [])] for s in ranked]
    note = (render('<p class="muted">The {{shown}} shards with the highest share flagged by any rule, of {{total}}; '
                   'all of them: <code>pairclean query SCORES -f docs/queries/share-flagged-per-shard.sql</code>.</p>',
                   shown=max_rows, total=f"{len(shards):,}") if len(shards) > max_rows else Html(""))
    return join([_table(head, rows), note])


def _estimator_line(est: dict) -> str:
    """backend · model · pretrained tag, leaving out what the backend does not record."""
    parts = [est.get("backend"), est.get("model"),
             f"pretrained {est['pretrained']}" if est.get("pretrained") else None,
             f"checkpoint sha256 {est['checkpoint_sha256'][:12]}…" if est.get("checkpoint_sha256") else None]
    return " · ".join(str(p) for p in parts if p) or "not recorded"


def _provenance_html(prov: Provenance, scores: Path) -> Html:
    est = prov.estimator or {}
    gmm = prov.gmm
    dataset = prov.dataset
    items = [
        ("scores file", str(scores)),
        ("estimator", _estimator_line(est)),
        ("precision / device", f"{est.get('precision', '?')} / {est.get('device', '?')}"),
        ("pair kind", prov.pair or "?"),
        ("dataset", f"{dataset.format}: {', '.join(dataset.sources)}" if dataset
         else f"{len(prov.input_shards or []):,} shards"),
        ("β", f"{_num(prov.beta, 4)} ± {_num(prov.beta_std, 4)} ({prov.beta_mode}, K = {prov.beta_k})"),
        ("weight function", str(prov.weight_fn)),
        ("GMM", ", ".join(f"μ={m:.3f} σ²={v:.4f} π={w:.2f}"
                          for m, v, w in zip(gmm.means, gmm.variances, gmm.weights))
         + f" (fitted on {gmm.n_fit:,} pairs)" if gmm else "not fitted"),
        ("scored with", f"pairclean {prov.pairclean_version or '?'}, finished {prov.finished_at or '?'}"),
    ]
    return render('<table class="kv">{{rows}}</table><details><summary>full provenance (JSON)</summary>'
                  "<pre>{{full}}</pre></details>",
                  rows=join(render("<tr><th>{{k}}</th><td>{{v}}</td></tr>", k=k, v=v) for k, v in items),
                  full=json.dumps(prov.to_json(), indent=2, sort_keys=True))


def _sweep_html(sweep: Sweep | None) -> Html:
    """The threshold sweep section (`curate.sweep`), or nothing for a run without a null sample."""
    if sweep is None:
        return Html("")
    rows = [[f"sim > {r.threshold:.4f}", _pct(r.null_above), _pct(r.kept), _pct(r.precision), _pct(r.clean_kept),
             _pct(r.noise_caught)] for r in sweep.rows]
    return render('<section id="sweep"><h2>Choosing a threshold</h2><p class="lead">What each threshold would keep, '
                  "estimated from the run's random pairings (in-data pairs that do not belong together) without "
                  "labels: pairs like random pairings (est.) {{share}}. The estimates count noise as dissimilar as a "
                  "random pairing; a caption of a similar item counts as clean here.</p>{{table}}</section>",
                  share=_pct(sweep.random_pairing_share),
                  table=_table(["keep if", "random pairings above", "kept", "est. precision", "est. clean kept",
                                "est. noise caught"], rows))


def _truth_table(stats: ReportStats) -> Html:
    if stats.truth is None:
        return Html("")

    def percent(value: float | None) -> str:  # truth_metrics' shares are in %
        return _pct(None if value is None else value / 100)

    rows = [[rule.label, rule.noisy_if, f"{m.flagged:,}", percent(m.clean_kept), percent(m.noise_caught),
             percent(m.balanced_accuracy), percent(m.precision)]
            for rule in stats.rules for m in [stats.truth.rules[rule.name]]]
    return render("<h3>Against the truth labels</h3>{{table}}", table=_table(
        ["rule", "noisy if", "flagged", "clean kept", "noise caught", "balanced accuracy", "precision"], rows))


def _cards(stats: ReportStats, prov: Provenance) -> list[Html]:
    s, rules, n = stats.summary, stats.rules, stats.summary.scored
    cards = [
        _card("pairs", f"{s.pairs:,}", f"{s.scored:,} scored"),
        _card("errors", f"{s.errors:,}", _pct(s.errors / s.pairs) + " of pairs", "warn" if s.errors else ""),
        _card("β (cone bias)", _num(prov.beta, 4), f"± {_num(prov.beta_std, 4)} · {prov.beta_mode}", "beta"),
        *(_card(f"flagged by {rule.label} rule", _pct(s.flagged[rule.name] / n if n else None),
                f"{s.flagged[rule.name]:,} pairs with {rule.noisy_if}", f"rule {rule.name}") for rule in rules),
        _card("mean OSA weight", _num(s.mean_weight, 4), f"{_pct(s.zero_weight / n if n else None)} weigh 0"),
    ]
    if stats.truth is not None:
        labelled, noisy = stats.truth.labelled, stats.truth.noisy
        cards.append(_card("truly noisy", _pct(noisy / labelled if labelled else None),
                           f"{noisy:,} of {labelled:,} labelled (joined on {stats.truth_join})", "warn"))
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


def _errors(stats: ReportStats) -> Html:
    if not stats.errors:
        return Html("")
    return render('<section id="errors"><h2>Pairs that could not be scored</h2>'
                  '<p class="lead">{{n}} pairs carry an error (weight 0, never kept by a predicate on the scores).'
                  "</p>{{table}}</section>", n=f"{stats.summary.errors:,}",
                  table=_table(["reason", "pairs", "example key"],
                               [[e["error"], f"{e['n']:,}", e["example"]] for e in stats.errors]))


def render_page(scores: Path, prov: Provenance, stats: ReportStats, media: dict, media_note: str | None,
                heading: str, max_shard_rows: int) -> str:
    """The self-contained HTML page."""
    gmm_decides = not any(r.name == "gmm" and r.abstains for r in stats.rules)  # an abstaining GMM has no boundary
    mixture = prov.gmm if prov.gmm and gmm_decides else None
    truth = stats.truth is not None
    return render(
        template("pairclean.curate.report", "page.html"),
        heading=heading, css=Html(template("pairclean.curate.report", "report.css")),
        pairs=f"{stats.summary.pairs:,}", pair=prov.pair or "?",
        estimator=_estimator_line(prov.estimator or {}),
        generated=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        cards=join(_cards(stats, prov)), histogram_lead=_histogram_lead(mixture, stats),
        histogram=similarity_figure(stats.edges, stats.counts, prov.beta, mixture, stats.summary.scored),
        truth_table=_truth_table(stats), sweep=_sweep_html(stats.sweep),
        shard_figure=shard_figure(stats.shards, truth, stats.rules),
        shard_table=_shard_table(stats.shards, truth, max_shard_rows, stats.rules),
        lowest_count=len(stats.lowest),
        media_note=render('<p class="muted">{{note}}</p>', note=media_note) if media_note else Html(""),
        lowest=_gallery(stats.lowest, media, truth, stats.rules, "no scored pairs"),
        highest_count=len(stats.highest),
        highest=_gallery(stats.highest, media, truth, stats.rules, "every scored pair is shown above, or none was asked for"),
        errors=_errors(stats), provenance=_provenance_html(prov, scores), version=__version__)
