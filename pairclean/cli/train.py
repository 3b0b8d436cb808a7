"""`pairclean train`: a thin layer over pairclean.training.train.

The method shortcut flags (`--weights`, `--filter`, `--online` ...) are not written here: every
registered method declares its own (`Method.shortcuts`). They are added to the command when it is
parsed (`_TrainCommand`, so that other commands do not import the training stack), their values
collected, and `method_and_options` turns them into a method and its options the same way for all.
"""

from __future__ import annotations

import contextlib
import inspect
from functools import lru_cache
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

import pairclean.cli.options as options
from pairclean.ops.guard import open_output
from pairclean.cli.app import Command, announce, app, console, panels
from pairclean.cli.progress import RichProgress
from pairclean.cli.terminal import print_table
from pairclean.config import split_option
from pairclean.errors import ConfigError, UserError
from pairclean.ops.records import Keyed

SHORTCUTS_GIVEN = "pairclean_method_shortcuts"  # ctx.meta key: {option name: value} of the shortcut flags


def declared_shortcuts() -> Keyed[str, tuple]:
    """flag -> (its Shortcut declaration, the methods that declare it), over every registered method."""
    from pairclean.training import METHODS

    flags: dict[str, tuple] = {}
    for name, cls in sorted(METHODS.items()):
        for shortcut in cls.shortcuts:
            flags.setdefault(shortcut.flag, (shortcut, []))[1].append(name)
    return flags


def _parameter_name(flag: str) -> str:
    return f"shortcut_{flag.lstrip('-').replace('-', '_')}"


@lru_cache(maxsize=1)
def _shortcut_parameters() -> tuple:
    """One option per declared flag, built by typer (`options.borrowed_options`) from a declaration
    made of the methods' `Shortcut`s (the flags are data, so this one declaration is generated);
    their values go to ctx.meta, never to the command function."""
    kinds = {str: Optional[str], int: Optional[int], bool: bool}

    def declaration(**values) -> None:
        """The method shortcut flags (never called: the options are borrowed)."""

    declaration.__signature__ = inspect.Signature([
        inspect.Parameter(_parameter_name(flag), inspect.Parameter.KEYWORD_ONLY, annotation=kinds[s.kind],
                          default=typer.Option(False if s.kind is bool else None, flag, help=s.help))
        for flag, (s, _) in declared_shortcuts().items()])
    return tuple(options.borrowed_options(declaration, SHORTCUTS_GIVEN))


def shortcuts_given(ctx) -> Keyed:
    """{flag: value} of the shortcut flags the command line gave."""
    values = ctx.meta.get(SHORTCUTS_GIVEN, {})
    return {flag: value for flag in declared_shortcuts()
            if (value := values.get(_parameter_name(flag))) not in (None, False)}


class _TrainCommand(Command):
    """`pairclean train` with the methods' shortcut flags added when it is parsed or its help shown."""

    def parameters(self, ctx):
        params = super().parameters(ctx)
        return [*params[:-1], *_shortcut_parameters(), params[-1]] if params else list(_shortcut_parameters())


def method_and_options(method: Optional[str], given: dict, extra: list[str]) -> tuple[str, Keyed]:
    """The method named by --method, or else picked by the shortcut flags given (the highest `selects`;
    plain when none picks one), and its options: those the shortcuts set, then the --method-option items."""
    from pairclean.training import METHODS

    flags = declared_shortcuts()
    if method is None:
        picks = [(s.selects, name) for name, cls in METHODS.items() for s in cls.shortcuts
                 if s.selects and s.flag in given]
        method = max(picks)[1] if picks else "plain"
    declared = {s.flag: s for s in getattr(METHODS.get(method), "shortcuts", ())}
    chosen: dict = {}
    set_by: dict = {}
    for flag, value in given.items():
        if flag not in declared:
            raise UserError(f"{flag} does not apply to method {method} (it goes with {', '.join(flags[flag][1])})")
        option = declared[flag].option
        if option is None:
            continue
        if option in chosen and chosen[option] != value:
            raise UserError(f"{set_by[option]} and {flag} both set {option}: give one")
        chosen[option], set_by[option] = value, flag
    for item in extra:
        option = split_option(item)
        if option is None:
            raise UserError(f"--method-option takes key=value, not {item!r}")
        key, value = option
        chosen[key.replace("-", "_")] = value
    return method, chosen


@contextlib.contextmanager
def train_wording(method: str):
    """ConfigErrors worded as `pairclean train` spells its settings: a method option as the shortcut flag
    that sets it (else `--method-option NAME`), any other field as its flag."""
    try:
        yield
    except ConfigError as exc:
        from pairclean.cli.options import flag_for
        from pairclean.training import METHODS

        cls = METHODS.get(method)
        shortcut = {s.option: s.flag for s in reversed(getattr(cls, "shortcuts", ())) if s.option}
        option_names = set(getattr(cls.Options, "__dataclass_fields__", {})) if cls else set()

        def flag(field: str) -> str:
            if field in shortcut:
                return shortcut[field]
            if field in option_names:
                return f"--method-option {field}"
            return "--method-option" if field == "method_options" else flag_for(field)

        raise UserError(exc.worded(flag)) from None


def epochs_table(result) -> Table:
    table = Table(title=f"pairclean train -> {result.run_dir}")
    for name in ("epoch", "train loss", "pairs/s", "i2t R@1", "t2i R@1", "rSum", "seconds"):
        table.add_column(name, justify="right")
    for rec in result.epochs:
        def val(key):
            return f"{rec[key]:.1f}" if rec.get(key) is not None else "-"
        mark = " *" if rec["epoch"] == result.best_epoch else ""
        table.add_row(f"{rec['epoch']}{mark}", f"{rec['train_loss']:.4f}", f"{rec['pairs_per_second']:,.1f}",
                      val("val_i2t_r1"), val("val_t2i_r1"), val("val_rsum"), f"{rec['seconds']:.1f}")
    return table


HELP_READS = ("method", "method_option", "epochs")  # eager: read before the other options, in the order given


def list_method_options(ctx: typer.Context, param: typer.CallbackParam, value):
    """`--method-option help`: every method (or the one --method names) with its options and defaults, and
    the warm-up and phases it would run at --epochs (given options included), then exit. --method,
    --method-option and --epochs are eager, and click reads eager options in the order they stand on
    the line: this callback is theirs, and answers once it has seen all three."""
    seen = ctx.meta.setdefault("train-method-help", {})
    seen[param.name] = value
    requested = seen.get("method_option") or ()
    if len(seen) < len(HELP_READS) or "help" not in requested:
        return value
    import dataclasses

    from pairclean.training import METHODS, Method, build_method

    epochs, named = seen["epochs"], seen["method"]
    given = dict(option for item in requested if (option := split_option(item)) is not None)
    table = Table(title="pairclean train --method NAME --method-option key=value")
    for column in ("method", "what it does", "when it pays (measured)", "options (default)", "shortcut flags",
                   f"schedule at --epochs {epochs}"):
        table.add_column(column)
    for name, cls in sorted(METHODS.items()):
        if named is not None and name != named:
            continue
        options = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls.Options)) or "-"
        flags = ", ".join(s.flag + (f" ({s.option})" if s.option else "") for s in cls.shortcuts) or "-"
        schedule = {}
        if cls.schedule is not Method.schedule:  # only methods with a schedule: the others may need options
            with train_wording(name):
                schedule = build_method(name, given if name == named else {}).schedule(epochs)
        shown = ", ".join(f"{k}={v}" for k, v in schedule.items()) or "-"
        table.add_row(name, (cls.__doc__ or "").strip().splitlines()[0], cls.pays or "-", options, flags, shown)
    print_table(console, table)
    raise typer.Exit()


# `train --help` in the order of the work: the data and the run, then what the scores do to it
# (the method and its shortcut flags), then the optimisation, performance, and reading the data.
TRAIN_PANELS = (
    ("What to train, on what, into what", ("--out", "--val", "--model", "--pretrained", "--backend", "--pair",
                                           "--resume", "--overwrite")),
    ("The scores: weights, filter, online weights, methods", (
        "--weights", "--scores", "--filter", "--online", "--attach", "--method", "--method-option", "--weight-column",
        "--join", "--on-missing", "--estimator-model", "--estimator-pretrained", "--weight-fn", "--beta-k",
        "--reduction")),
    ("Optimisation", ("--epochs", "--batch-size", "--lr", "--weight-decay", "--warmup-steps", "--min-lr-ratio",
                      "--grad-clip", "--temperature", "--seed")),
    ("Performance and logs", ("--device", "--precision", "--decode", "--workers", "--shuffle-buffer",
                              "--val-batch-size", "--log-every", "--diagnostics")),
    ("Reading the data (where detection needs help)", ("--input-format", "--split", "--image-root", "--image-field",
                                                       "--image-path-field", "--text-field", "--json-text-key",
                                                       "--key-field", "--text2-field", "--image2-field",
                                                       "--image2-path-field", "--label-field", "--label-template",
                                                       "--allow-pipe")),
)


@app.command("train", cls=_TrainCommand)
@panels(*TRAIN_PANELS)
@options.dataset_options
def train_command(
    ctx: typer.Context,
    source: options.Source,
    out: Path = typer.Option(..., "--out", "-o", help="Run directory (checkpoints, metrics.jsonl, run.json)."),
    val: Optional[List[str]] = typer.Option(None, "--val", help="Validation pairs: R@K and rSum each epoch, best checkpoint by rSum."),
    model: str = typer.Option("ViT-B-32", help="open_clip model name, hf-hub:ORG/REPO or a pairclean tiny config, or a sentence-transformers directory / all-MiniLM-L6-v2."),
    pretrained: options.Pretrained = None,
    backend: str = typer.Option("auto", help="auto, open_clip, or sentence-transformers."),
    method: Optional[str] = typer.Option(None, is_eager=True, callback=list_method_options, help="Training method by name (plain, osa-weights, filter, osa-online, sdd, gsc, ...)."),
    method_option: Optional[List[str]] = typer.Option(None, metavar="KEY=VALUE", callback=list_method_options, is_eager=True,
                                                      help="Method option key=value (repeatable); 'help' lists every "
                                                           "method's options, defaults and schedule at --epochs."),
    epochs: int = typer.Option(5, is_eager=True, callback=list_method_options, help="Passes over the training data."),
    batch_size: int = typer.Option(256, help="Pairs per step (in-batch negatives)."),
    lr: float = typer.Option(5e-6, help="Peak AdamW learning rate."),
    weight_decay: float = typer.Option(0.2, help="AdamW weight decay (not on gains, biases, logit scale)."),
    warmup_steps: int = typer.Option(500, help="Linear warm-up steps before the cosine decay (at most a fifth of the run)."),
    min_lr_ratio: float = typer.Option(0.0, help="The cosine ends at lr x this."),
    grad_clip: Optional[float] = typer.Option(1.0, help="Max gradient norm (0 disables)."),
    temperature: Optional[float] = typer.Option(None, help="Fixed softmax temperature (default: open_clip learns it; sentence-transformers 0.05)."),
    device: options.Device = "auto",
    precision: options.Precision = "fp32",
    decode: options.Decode = "fast",
    workers: options.Workers = "auto",
    shuffle_buffer: int = typer.Option(1000, help="Pairs in each worker's shuffle buffer."),
    val_batch_size: int = typer.Option(256, help="Pairs per forward pass during validation."),
    log_every: int = typer.Option(10, help="Write a step line to metrics.jsonl every N steps."),
    diagnostics: bool = typer.Option(True, help="Write per-pair loss/weight Parquet per epoch."),
    seed: int = typer.Option(0, help="Seed for initialisation, data order and beta."),
    resume: bool = typer.Option(False, help="Continue the run in --out from its last finished epoch."),
    overwrite: bool = typer.Option(False, help="Replace the run in --out."),
) -> None:
    """Train a dual encoder on (reweighted or filtered) pairs: weighted symmetric InfoNCE."""
    dataset = options.dataset_given(ctx)
    target = open_output(out, [*source, *(val or [])], "out", kind="directory", overwrite=None,
                         parents=True)  # train() adds the files it reads, and creates the directory with its parents
    name, method_options = method_and_options(method, shortcuts_given(ctx), method_option or [])
    from pairclean.training import TrainConfig, train

    with train_wording(name):
        cfg = TrainConfig(model=model, pretrained=pretrained, backend=backend, device=device, precision=precision,
                          decode=decode, epochs=epochs, batch_size=batch_size, lr=lr, weight_decay=weight_decay,
                          warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio, grad_clip=grad_clip or None,
                          temperature=temperature, method=name, method_options=method_options, workers=options.workers_given(workers),
                          shuffle_buffer=shuffle_buffer, val_batch_size=val_batch_size, log_every=log_every,
                          diagnostics=diagnostics, seed=seed, resume=resume, overwrite=overwrite,
                          progress=RichProgress(console))
    data = dataset.open(source)
    announce(data)
    val_data = dataset.open(val, pair=data.spec.pair) if val else None
    with train_wording(name):
        result = train(data, target, cfg, val=val_data)
    from pairclean.ops import distributed

    if not distributed.is_main():  # under torchrun rank 0 reports
        return
    print_table(console, epochs_table(result))
    if result.best_model is not None:
        console.print(f"best: epoch {result.best_epoch}, rSum {result.best_rsum:.1f} -> {result.best_model}")
    console.print(f"last: {result.last_model}")
