"""`pairclean evaluate ...`: detection (scores vs ground truth), dedup (vs planted duplicates) and retrieval (a trained model)."""

from __future__ import annotations

from pathlib import Path

import typer

from typing import TYPE_CHECKING

from pairclean.cli.app import App, app, console
from pairclean.cli.terminal import print_table
from pairclean.errors import UserError

if TYPE_CHECKING:
    from pairclean.dedup.evaluation import DedupEvaluation
    from pairclean.scorefile.evaluation import AuditEstimates, DetectionReport
    from pairclean.scorefile.stratified import Estimate

evaluate_app = App(no_args_is_help=True, help="Measure detection quality, dedup quality or retrieval quality.")
app.add_typer(evaluate_app, name="evaluate")


@evaluate_app.command("retrieval")
def retrieval_command(
    data: list[str] = typer.Argument(..., metavar="SHARDS", help="Validation pairs: shards, Parquet files, or a manifest YAML."),
    model: str = typer.Option(..., "--model", help="A `pairclean train` run directory or model file, a sentence-transformers "
                                                   "directory, or (with --arch) an open_clip checkpoint or tag."),
    arch: str | None = typer.Option(None, help="open_clip model name for a bare checkpoint or pretrained tag."),
    pair: str | None = typer.Option(None, help="Pair kind: image-text, text-text, image-label, image-image."),
    batch_size: int = typer.Option(256, help="Pairs per forward pass."),
    workers: int = typer.Option(2, help="DataLoader workers."),
    device: str = typer.Option("auto", help="auto, cpu, cuda ..."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the metrics to this JSON file."),
    overwrite: bool = typer.Option(False, help="Replace an existing output file."),
) -> None:
    """R@1/5/10 both ways and rSum; an image with several captions is one query (hit if any caption is found)."""
    from rich.table import Table

    from pairclean.ops.guard import open_output
    from pairclean.training.retrieval import METRIC_NAMES, evaluate_retrieval

    target = open_output(json_out, [model, *data], "json", overwrite=overwrite) if json_out is not None else None
    metrics = evaluate_retrieval(model, data, arch=arch, pair=pair, batch_size=batch_size, workers=workers, device=device)
    table = Table(title=f"retrieval: {model}")
    for name in METRIC_NAMES:
        table.add_column(name.replace("_r", " R@"), justify="right")
    table.add_row(*(f"{getattr(metrics, name):.2f}" for name in METRIC_NAMES))
    print_table(console, table)
    console.print(f"{metrics.queries_i2t:,} left items (i2t queries), {metrics.queries_t2i:,} pairs (t2i queries)"
                  + (f", {metrics.skipped:,} unreadable pairs skipped" if metrics.skipped else ""))
    if target is not None:
        target.write_json(metrics.to_json())


def audit_tables(audit: AuditEstimates):
    """A blind audit's estimates for the whole dataset as rich tables: per rule, then the noise share."""
    from rich.table import Table

    def shown(estimate: Estimate) -> str:
        if estimate.value is None:
            return "n/a (none marked)"
        return f"{100 * estimate.value:.1f} [{100 * estimate.low:.1f}, {100 * estimate.high:.1f}]"

    pairs, unmarked = audit.scored_pairs, audit.unmarked_strata
    strata = audit.design.strata
    gaps = "" if not unmarked else (
        f"; no mark in stratum {', '.join(map(str, unmarked))} ({sum(strata[h - 1].pairs for h in unmarked):,} "
        "pairs: their noise is unknown, taken at the pooled share as if one of them were marked)")
    table = Table(title=f"blind audit: {audit.marked:,} marked pairs weighted to all {pairs:,} scored pairs "
                        f"({len(strata)} sim strata{gaps}); % [{audit.confidence:.0%} interval]")
    for name, justify in (("rule", "left"), ("noisy if", "left"), ("flagged\n% of pairs", "right"),
                          ("precision\n%", "right"), ("recall\n%", "right"), ("noise left\nin kept %", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    for m in audit.rules.values():
        table.add_row(m.label, m.noisy_if, f"{100 * m.flagged_share:.1f}", shown(m.precision), shown(m.recall),
                      shown(m.noise_left))
    summary = Table(show_header=False)
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    noise = audit.noise_share
    summary.add_row("noise share of the scored pairs, %", shown(noise))
    if noise.value is not None:
        summary.add_row("noisy pairs (estimate)", f"{noise.value * pairs:,.0f} [{noise.low * pairs:,.0f}, "
                                                  f"{noise.high * pairs:,.0f}]")
    return table, summary


def audit_notes(audit: AuditEstimates) -> list[str]:
    """What a blind audit's intervals rest on, in lines: the judge as the repeats measure it, and
    what the intervals cover and do not."""
    from pairclean.cli.audit import judge_line

    return [judge_line(audit.judge, audit.design.repeated), f"{audit.covers}."]


def detection_tables(result: DetectionReport):
    """The detection metrics as rich tables: the rules, then the threshold-free figures; for a
    blind audit's marks, its estimates for the whole dataset, then the figures of the marked pairs."""
    from rich.table import Table

    from pairclean.scorefile.evaluation import RuleDetection

    def pct(value) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    table = Table(title=f"noise detection: {result.pairs:,} pairs, {result.noisy:,} noisy "
                        f"({pct(result.noise_share)}%)")
    for name, justify in (("rule", "left"), ("noisy if", "left"), ("clean\nkept %", "right"),
                          ("noise\ncaught %", "right"), ("balanced\nacc. %", "right"), ("precision\n%", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    for m in result.rules.values():  # the file's decision rules, then the oracle
        table.add_row(m.label, m.noisy_if, pct(m.clean_kept), pct(m.noise_caught), pct(m.balanced_accuracy),
                      pct(m.precision))
    summary = Table(show_header=False, title=f"on the {result.pairs:,} marked pairs alone (unweighted)"
                    if result.audit is not None else None)
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    auc, ap = result.roc_auc, result.average_precision
    summary.add_row("ROC-AUC (noise vs -sim)", "n/a" if auc is None else f"{auc:.4f}")
    summary.add_row("average precision", "n/a" if ap is None else f"{ap:.4f}")
    rank, best = result.mean_noise_rank, result.mean_noise_rank_optimal
    summary.add_row("mean noise rank by weight (optimum)", "n/a" if rank is None else f"{rank:,.1f} ({best:,.1f})")
    for m in result.rules.values():
        if isinstance(m, RuleDetection) and m.probability is not None:
            summary.add_row(f"ECE of the {m.label} rule's P(clean), pt (0 = calibrated)",
                            "none: the rule abstains" if m.abstains else pct(m.ece))
    summary.add_row("joined on", str(result.join))
    if result.error_rows + result.unlabelled_rows:
        summary.add_row("left out", f"{result.error_rows:,} error rows, {result.unlabelled_rows:,} without truth")
    if result.audit is not None:  # the per-rule shares of a stratified sample are not the dataset's: the audit's are
        return (*audit_tables(result.audit), summary)
    return table, summary


@evaluate_app.command("detection")
def detection_command(
    scores: Path = typer.Argument(..., help="Scores Parquet written by `pairclean score`."),
    truth: Path | None = typer.Option(None, "--truth", help="Truth Parquet (columns noisy + shard/index or key), or a "
                                                            "manifest YAML whose `truth:` names one, or its directory "
                                                            "(`pairclean corrupt` writes all three; default: the truth of "
                                                            "the dataset the scores recorded)."),
    truth_key: str | None = typer.Option(None, "--truth-key", help="The truth's column holding the pair key "
                                                                   "(joined to the scores' key column)."),
    json_out: Path | None = typer.Option(None, "--json", help="Metrics JSON to write (default: SCORES.detection.TRUTH.json, "
                                                              "named after the scores and the truth file, so one scores "
                                                              "file evaluated against two truths keeps both; an existing "
                                                              "one is replaced only with --overwrite)."),
    overwrite: bool = typer.Option(False, help="Replace an existing output file."),
) -> None:
    """Clean kept / noise caught / balanced accuracy / precision per rule in the file and the oracle, ROC-AUC, AP, mean noise rank, ECE of p_clean."""
    from pairclean.ops.guard import open_output
    from pairclean.scorefile.contract import recorded_inputs
    from pairclean.scorefile.db import resolve_truth
    from pairclean.scorefile.evaluation import evaluate_detection, recorded_truth

    truth_file = resolve_truth(truth) if truth is not None else recorded_truth(scores)
    if not truth_file.is_file():  # said before an existing metrics file is
        raise UserError(f"truth file not found: {truth_file}")
    target = open_output(json_out or scores.with_name(f"{scores.stem}.detection.{truth_file.stem}.json"),
                         [*recorded_inputs(scores), truth, truth_file], "json", overwrite=overwrite)
    result = evaluate_detection(scores, truth_file, truth_key=truth_key)
    for table in detection_tables(result):
        print_table(console, table)
    for line in audit_notes(result.audit) if result.audit is not None else []:
        console.print(line, soft_wrap=True)
    target.write_json(result.to_json())
    console.print(f"metrics written to {target.path}")


def dedup_tables(result: DedupEvaluation):
    """The dedup metrics as rich tables: per duplicate kind, then overall and removal."""
    from rich.table import Table
    from rich.text import Text

    def pct(value) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    table = Table(title=f"dedup vs planted truth: {result.side} side, threshold {result.threshold}, "
                        f"keep {result.keep} ({result.rows:,} rows)")
    for name in ("kind", "true pairs", "found", "recall %", "precision %"):
        table.add_column(name, justify="left" if name == "kind" else "right")
    for kind, m in result.kinds.items():
        table.add_row(kind, f"{m.true_pairs:,}", f"{m.found:,}", pct(m.recall), pct(m.precision))
    table.add_row(Text("all", style="bold"), f"{result.true_pairs:,}", f"{result.found_pairs:,}",
                  pct(result.recall), pct(result.precision))
    summary = Table(show_header=False)
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    summary.add_row("removed rows (their kept row a true duplicate)", f"{result.removed:,} ({result.correct_pairs:,})")
    summary.add_row("planted groups: found / one copy kept",
                    f"{result.planted_groups_found:,} / {result.planted_groups_one_kept:,} of {result.planted_groups:,}")
    if result.noise_truth is not None:
        summary.add_row("noisy caption: kept copies / all copies of those groups",
                        f"{pct(result.kept_noisy_share)}% / {pct(result.noisy_share_in_groups)}%")
    summary.add_row("joined on", str(result.join))
    return table, summary


@evaluate_app.command("dedup")
def dedup_command(
    dedup_file: Path = typer.Argument(..., metavar="DEDUP", help="Dedup Parquet written by `pairclean dedup`."),
    truth: Path = typer.Option(..., "--truth", help="Duplicates truth (`pairclean corrupt --mode duplicate` writes it), or its manifest."),
    noise_truth: Path | None = typer.Option(None, "--noise-truth", help="Caption-noise truth of the same pairs (`corrupt --mode shuffle` "
                                                                         "on the duplicated data): how often the kept copy is the noisy one."),
    side: str | None = typer.Option(None, help="image, text or both (default: the side the dedup ran on)."),
    json_out: Path | None = typer.Option(None, "--json", help="Metrics JSON to write (default: DEDUP.evaluation.json; "
                                                              "an existing one is replaced only with --overwrite)."),
    overwrite: bool = typer.Option(False, help="Replace an existing output file."),
) -> None:
    """Precision and recall of a dedup per planted duplicate kind (exact, reencode, resize, crop, caption, identical)."""
    from pairclean.dedup.evaluation import evaluate_dedup
    from pairclean.ops.guard import open_output

    target = open_output(json_out or dedup_file.with_name(dedup_file.stem + ".evaluation.json"),
                         [dedup_file, truth, noise_truth], "json", overwrite=overwrite)
    result = evaluate_dedup(dedup_file, truth, noise_truth=noise_truth, side=side)
    for table in dedup_tables(result):
        print_table(console, table)
    target.write_json(result.to_json())
    console.print(f"metrics written to {target.path}")
