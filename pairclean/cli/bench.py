"""`pairclean bench ...`: throughput on the user's own hardware (`bench score` sizes a scoring job)."""

from __future__ import annotations

import typer
from rich.table import Table

import pairclean.cli.options as options
from pairclean.cli.app import App, app, console, err_console
from pairclean.cli.progress import RichProgress
from pairclean.cli.terminal import print_table

bench_app = App(no_args_is_help=True, help="Measure throughput on this machine.")
app.add_typer(bench_app, name="bench")


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} MiB"


def report_tables(report) -> list[Table]:
    tables = []
    for i, r in enumerate(report.rounds):
        title = "pairclean bench score" + (f" - round {i + 1}" if len(report.rounds) > 1 else "")
        if r.ceiling is not None:
            tables.append(_phase_table(title, r))
        if r.pipeline_only is not None:
            tables.append(_pipeline_table(title + ": pipeline only (zero-cost model)", r.pipeline_only))
    return tables


def _phase_table(title: str, r) -> Table:
    table = Table(title=title)
    for name in ("phase", "pairs", "seconds", "pairs/s", "CPU ms/pair", "peak PSS (+workers)", "peak RSS",
                 "GPU peak", "load 1m"):
        table.add_column(name, justify="left" if name == "phase" else "right")
    for phase in (r.ceiling, r.end_to_end, r.naive):
        if phase is None:
            table.add_row("naive loop", "-", "-", "n/a (open_clip image-text only)", "-", "-", "-", "-", "-")
            continue
        table.add_row(phase.name, f"{phase.pairs:,}", f"{phase.seconds:.1f}", f"{phase.pairs_per_second:,.1f}",
                      f"{phase.cpu_ms_per_pair:,.1f}", _mib(phase.peak_mib), _mib(phase.peak_rss_mib),
                      _mib(phase.gpu_peak_mib), f"{phase.load[0]:.1f} -> {phase.load[1]:.1f}")
    e = r.end_to_end.extra
    table.add_row("end-to-end whole call", f"{r.end_to_end.pairs:,}", f"{e['whole_call_seconds']:.1f}",
                  f"{e['whole_call_pairs_per_second']:,.1f}", "", "", "", "", f"beta {e['beta_seconds']:.1f} s ({e['beta_source']})")
    return table


def _pipeline_table(title: str, p) -> Table:
    """The main process's time per pair by stage: CPU of its main thread, and wall time."""
    table = Table(title=title)
    for name in ("stage", "main-process CPU ms/pair", "wall ms/pair"):
        table.add_column(name, justify="left" if name == "stage" else "right")
    m = p.meter
    for stage, cpu in m["stages"].items():
        wall = m["stage_wall_ms_per_pair"].get(stage)
        table.add_row(stage, f"{cpu:.4f}", "-" if wall is None else f"{wall:.4f}")
    table.add_row("main process in all", f"{m['main_cpu_ms_per_pair']:.4f}", f"{1000 * m['seconds'] / max(m['pairs'], 1):.4f}")
    return table


def decode_label(decode: str, share: float | None) -> str:
    """`decode`, with the share of the JPEGs the workers decoded where a device decoder ran."""
    from pairclean.backends.device_jpeg import DEVICE_DECODERS

    return decode + (f", {share:.0%} of the JPEGs in the workers" if share and decode in DEVICE_DECODERS else "")


def pipeline_lines(report) -> list[str]:
    lines = []
    for r in report.rounds:
        p = r.pipeline_only
        if p is None:
            continue
        m = p.meter
        over = p.over_worker_capacity
        lines.append(f"pipeline only (decode {decode_label(p.decode, report.config.get('cpu_decode_share'))}): {m['pairs']:,} pairs at {m['pairs_per_second']:,.1f} pairs/s; main "
                     f"process {m['main_cpu_ms_per_pair']:.4f} CPU ms per pair; {m['worker_bytes_per_pair'] / 1000:,.1f} kB per "
                     f"pair from the workers; {p.workers} worker(s) at {p.worker_ms_per_pair:.2f} ms per pair can prepare "
                     f"{p.worker_capacity:,.1f} pairs/s" + (f" ({over:.2f} of it reached)" if over is not None else "")
                     + f"; load {p.load[0]:.1f} -> {p.load[1]:.1f}")
        lines.append(startup_line(m))
    return lines


def startup_line(meter: dict) -> str:
    """The start-up (until the first batch was through) and its milestones, in seconds."""
    steps = ", ".join(f"{name} {seconds:.2f}" for name, seconds in meter.get("startup_milestones", {}).items())
    return f"start-up {meter['startup_seconds']:.2f} s ({steps}), then {meter['pairs_per_second']:,.1f} pairs/s"


def summary_lines(report) -> list[str]:
    if report.config.get("pipeline_only"):
        return pipeline_lines(report)
    c = report.config
    lines = [f"model {c['model']} ({c['pretrained']}) on {c['device']}, {c['precision']}, batch {c['batch_size']}, "
             f"{c['workers']} workers, decode {decode_label(c['decode'], c.get('cpu_decode_share'))}, compile {c['compile']}, "
             f"{c['torch_threads']} torch threads / {c['cpu_count']} CPUs"]
    eager = {tower: how for tower, how in (c.get("compiled_towers") or {}).items() if how != "compiled"}
    if c["compile"] and eager:
        lines.append("compile asked, but " + "; ".join(f"the {tower} tower ran {how}" for tower, how in eager.items()))
    e2e = report.rounds[-1].end_to_end.extra
    if not c["device"].startswith("cuda"):
        lines.append("GPU: no CUDA device (--decode gpu, --compile on a GPU and GPU utilisation not measured here)")
    else:
        busy = [(name, phase.extra.get("gpu_utilisation")) for name, phase in
                (("ceiling", report.rounds[-1].ceiling), ("end to end", report.rounds[-1].end_to_end))]
        lines.append("GPU utilisation (NVML, mean): " + ", ".join(
            f"{name} {value:.0f}%" if value is not None else f"{name} n/a (no NVML)" for name, value in busy))
    if e2e.get("batches"):
        lines.append(f"end to end: {e2e['batches']:,} batches, {e2e['full_batches']:,} full, mean fill "
                     f"{e2e['mean_batch_fill']:.1%} of --batch-size {c['batch_size']}; {startup_line(e2e['meter'])}")
    last = report.rounds[-1].ceiling.extra
    if "text_tokens_trimmed" in last:
        lines.append(f"text tower: {last['text_tokens_trimmed']:.1f} of {last['text_tokens_full']} positions per caption "
                     f"(exact trimming), {last['text_seconds_per_caption_full'] / last['text_seconds_per_caption_trimmed']:.1f}x "
                     "faster than the full context on the first batch")
    cost = {k: v for k, v in report.prepare_ms.items() if k != "items"}
    if cost:
        per_pair = sum(v for k, v in cost.items() if not k.startswith("exact"))
        top = max(r.ceiling.pairs_per_second for r in report.rounds)
        shown = ", ".join(f"{k} {v:.2f} ms" for k, v in cost.items())
        lines.append(f"worker CPU per pair ({report.prepare_ms['items']} pairs, one thread): {shown}; feeding the "
                     f"ceiling's {top:,.1f} pairs/s takes about {top * per_pair / 1000:.2f} cores of decoding")
    ceiling, naive = report.median("vs_ceiling"), report.median("vs_naive")
    median = " (medians over rounds)" if len(report.rounds) > 1 else ""
    lines.append(f"end-to-end / ceiling = {ceiling:.2f}" + (f", end-to-end / naive = {naive:.2f}" if naive else "") + median)
    cpu_ceiling, cpu_naive = report.median("cpu_vs_ceiling"), report.median("cpu_vs_naive")
    lines.append(f"by CPU per pair (unaffected by other load): ceiling / end-to-end = {cpu_ceiling:.2f}"
                 + (f", naive / end-to-end = {cpu_naive:.2f}" if cpu_naive else ""))
    return lines + pipeline_lines(report)


def _files(*given: str) -> list[str]:
    """The given values that name files (a --pretrained checkpoint, not a tag)."""
    import os

    return [g for g in given if g and os.path.isfile(g)]


@bench_app.command("score")
@options.dataset_options
def bench_score_command(
    ctx: typer.Context,
    source: options.Source,
    model: str = typer.Option("ViT-B-32", help="open_clip model name (or a pairclean tiny config)."),
    pretrained: options.Pretrained = "openai",
    backend: options.Backend = "open_clip",
    device: options.Device = "auto",
    precision: options.Precision = "fp32",
    decode: options.Decode = "fast",
    cpu_decode_share: options.CpuDecodeShare = 0.0,
    compile: options.Compile = False,
    batch_size: int = typer.Option(256, help="Pairs per forward pass (all three measurements)."),
    workers: options.Workers = "auto",
    beta_mode: options.BetaMode = "random-inputs",
    beta_k: options.BetaK = 1024,
    beta_cache: options.BetaCache = True,
    naive_pairs: int = typer.Option(512, help="Pairs for the naive reference loop (0 skips it)."),
    min_seconds: float = typer.Option(10.0, help="Run the model-only ceiling at least this long."),
    repeat: int = typer.Option(1, help="Rounds of (a)(b)(c)(d), interleaved; ratios are reported per round and as medians."),
    pipeline_only: bool = typer.Option(False, "--pipeline-only", help="Run only (d), the scoring loop around a "
                                       "zero-cost model: where the main process spends its time, quick on any machine."),
    json_out: options.JsonOut = None,
    overwrite: bool = typer.Option(False, help="Replace an existing output file."),
) -> None:
    """Model-only ceiling vs end-to-end `pairclean score` vs a naive loop vs the pipeline alone: pairs/s,
    ratios, peak memory, the main process's CPU per pair by stage."""
    dataset = options.dataset_given(ctx)
    from pairclean.bench.score import bench_score
    from pairclean.ops.guard import open_output
    from pairclean.scoring.model import ScoreConfig

    data = dataset.open(source)
    target = open_output(json_out, [*source, *data.spec.shards, *_files(pretrained)], "json", overwrite=overwrite) if json_out is not None else None
    cfg = ScoreConfig(model=model, pretrained=pretrained, backend=backend, device=device, precision=precision,
                      decode=decode, cpu_decode_share=cpu_decode_share, compile=compile, batch_size=batch_size, workers=options.workers_given(workers), beta_mode=beta_mode,
                      beta_k=beta_k, beta_cache=beta_cache)
    report = bench_score(data, cfg, naive_pairs=naive_pairs, min_seconds=min_seconds, repeat=repeat,
                         progress=RichProgress(err_console), pipeline_only=pipeline_only, out=target)
    for table in report_tables(report):
        print_table(console, table)
    for line in summary_lines(report):
        console.print(line, highlight=False)
    if target is not None:  # written after each phase
        console.print(f"report: {target.path}", highlight=False)
