"""The typer application, its help, and the consoles every command prints to (stdout: results,
stderr: messages): `cli.terminal.LiteralConsole`, which prints every string literally.

Help is written for a person and read at any width: plain text (no rich markup parsed in help
strings, so `NAME[:key=value]` and `[loss, zeta * Psi]` survive; no boxes to squeeze at 80
columns), a usage line such as `pairclean score [OPTIONS] SHARDS...`, and metavars that say
what a value is (`PATH`, `TEXT`, `N`, `NUMBER`, or one a command declares, e.g. `SQL`) instead
of a Python type (`<list[str]>`); a flag has none. Every command and command group is made with
`App`, so a new command gets the same help.

Help is in the order of the work: a command's options stand in sections (`panels`: what to run on
and where the output goes first, then the decisions, the performance, the rarer options last;
an option no section names falls under "Other options"), and `pairclean --help` lists the
commands as a user meets them (`COMMAND_PANELS`: score, then the commands that look at the
scores, then those that act on them, then measuring and the lab), not alphabetically.
"""

import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from pairclean.cli.terminal import LiteralConsole

# What an option's value is, by the kind of its value, when the option declares no metavar.
METAVARS = {"path": "PATH", "text": "TEXT", "integer": "N", "float": "NUMBER"}
_KINDS = {Path: "path", str: "text", int: "integer", float: "float"}


def _kind(param) -> str:
    """The kind of value an option takes: "path", "text", "integer", "float" (else "")."""
    descriptor = getattr(param, "type_descriptor", None)  # typer >= 0.22: the parameter's annotation
    if descriptor is None:
        return getattr(param.type, "name", "")  # older typer: click's parameter type
    annotation = descriptor.annotation
    if typing.get_origin(annotation) in (list, tuple):  # a repeatable option: the kind of one value
        annotation = typing.get_args(annotation)[0]
    return _KINDS.get(annotation, "")


def readable(param) -> None:
    """Give `param` a metavar a person reads: an argument its name in capitals, an option one by
    the kind of its value; a flag none. A metavar the command declared is kept."""
    if param.metavar is not None:
        return
    if param.param_type_name == "argument":
        param.metavar = param.name.upper()
    elif not getattr(param, "is_flag", False) and not getattr(param, "count", False):
        param.metavar = METAVARS.get(_kind(param), "VALUE")


PANELS = "__pairclean_panels__"  # a command function's option sections (`panels`)
OTHER_OPTIONS = "Other options"


def panels(*sections: tuple[str, tuple[str, ...]]):
    """Group a command's options in its help: each (title, flags) is a section, in this order and
    the flags' order; an option no section names is listed under "Other options", last."""
    def decorate(command):
        setattr(command, PANELS, sections)
        return command

    return decorate


class Command(TyperCommand):
    """A command with help a person reads (see the module docstring), and the options its function
    stacks with a decorator (`cli.options.stack`, e.g. `@options.dataset_options`): typer builds
    parameters from the signature only, so they are added here, after the command's own."""

    def __init__(self, *args, params=None, callback=None, **kwargs):
        stacked = [param for provider in getattr(callback, "__pairclean_options__", ()) for param in provider()]
        super().__init__(*args, params=[*(params or []), *stacked], callback=callback, **kwargs)

    def parameters(self, ctx) -> list:
        """The command's parameters (a command that adds some when it is parsed overrides this)."""
        return super().get_params(ctx)

    def get_params(self, ctx):
        params = self.parameters(ctx)
        for param in params:
            readable(param)
        return params

    def sections(self, ctx) -> list[tuple[str, list[tuple[str, str]]]]:
        """The help's sections: the arguments by their metavars (typer would show their Python
        type), then the options, in the command's `panels` where it has them."""
        params = self.get_params(ctx)
        arguments = [(p.metavar + ("..." if p.nargs != 1 else ""), getattr(p, "help", None) or "")
                     for p in params if p.param_type_name == "argument"]
        records = {p.name: record for p in params if p.param_type_name == "option" and (record := p.get_help_record(ctx))}
        by_flag = {flag: p.name for p in params if p.name in records for flag in p.opts}
        found = [("Arguments", arguments)]
        for title, flags in getattr(self.callback, PANELS, ()):
            names = [name for name in dict.fromkeys(by_flag[f] for f in flags if f in by_flag) if name in records]
            found.append((title, [records.pop(name) for name in names]))
        found.append((OTHER_OPTIONS if getattr(self.callback, PANELS, ()) else "Options", list(records.values())))
        return found

    def format_options(self, ctx, formatter) -> None:
        """Each section, its first column as wide as in the others (click's limit of 30 kept)."""
        sections = self.sections(ctx)
        column = min(max((len(term) for _, records in sections for term, _ in records), default=0), 30)
        for title, records in sections:
            if records:
                with formatter.section(title):
                    formatter.write_dl([(term.ljust(column), text) for term, text in records])

    def collect_usage_pieces(self, ctx) -> list[str]:
        """`[OPTIONS] SHARDS...`: an argument by its metavar, `...` when it takes several, in
        brackets when it may be left out."""
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = param.metavar + ("..." if param.nargs != 1 else "")
                pieces.append(name if param.required else f"[{name}]")
        return pieces


@dataclass(frozen=True)
class Mode:
    """A mode of a command: the flag that selects it, the command it becomes, one line of help."""

    flag: str
    command: Any
    line: str


class ModalCommand(Command):
    """A command with modes: a flag that makes it another command with only its own options
    (`pairclean score SHARDS` runs a model; `pairclean score EMBEDDINGS --from-embeddings` scores
    precomputed vectors). The flag may stand anywhere before `--`; the mode's command parses the
    rest, runs, and has its own help (`pairclean score --from-embeddings --help`). A subclass
    names its modes in `modes()`."""

    def modes(self) -> tuple[Mode, ...]:
        return ()

    def make_context(self, info_name, args, parent=None, **extra):
        args = list(args)
        given = args[:args.index("--")] if "--" in args else args
        for mode in self.modes():
            if mode.flag in given:
                args.remove(mode.flag)
                return mode.command.make_context(f"{info_name} {mode.flag}", args, parent=parent, **extra)
        return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx):
        return super().invoke(ctx) if ctx.command is self else ctx.command.invoke(ctx)

    def sections(self, ctx) -> list[tuple[str, list[tuple[str, str]]]]:
        """The modes right after the arguments: what the command reads is the first thing to know."""
        arguments, *options = super().sections(ctx)
        modes = [(mode.flag, f"{mode.line} Its options: {ctx.command_path} {mode.flag} --help.") for mode in self.modes()]
        return [arguments, ("Modes", modes), *options]


# The root's commands as a user meets them: the sections of `pairclean --help`, in order.
COMMAND_PANELS = (
    ("Score, then look at the scores", ("score", "query", "report", "audit", "audit-import")),
    ("Act on the scores", ("filter", "train", "dedup")),
    ("Measure", ("evaluate", "bench")),
    ("Lab: data with known noise", ("demo", "corrupt", "synth")),
)


class Group(TyperGroup):
    """A command group with the same help as `Command`; the root lists its commands in the order
    of the work (`COMMAND_PANELS`), a group its own in the order they were added."""

    def list_commands(self, ctx) -> list[str]:
        names = super().list_commands(ctx)
        if ctx.parent is not None:
            return names
        order = [name for _, panel in COMMAND_PANELS for name in panel]
        return sorted(names, key=lambda name: order.index(name) if name in order else len(order))

    def format_commands(self, ctx, formatter) -> None:
        """The root's commands in `COMMAND_PANELS`' sections (any other under "Commands")."""
        if ctx.parent is not None:
            return super().format_commands(ctx, formatter)
        listed = {name: self.get_command(ctx, name) for name in self.list_commands(ctx)}
        shown = {name: command for name, command in listed.items() if command is not None and not command.hidden}
        longest = max((len(name) for name in shown), default=0)  # one column for every section
        width = formatter.width - 6 - longest
        placed = set()
        for title, names in (*COMMAND_PANELS, ("Commands", tuple(shown))):
            rows = [(name.ljust(longest), shown[name].get_short_help_str(width)) for name in names
                    if name in shown and name not in placed]
            placed.update(name.strip() for name, _ in rows)
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            readable(param)
        return params


class App(typer.Typer):
    """pairclean's typer application and its command groups: plain help, `Command` for every command."""

    def __init__(self, **kwargs):
        super().__init__(cls=Group, rich_markup_mode=None, add_completion=False, **kwargs)

    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or Command, **kwargs)


app = App(no_args_is_help=True, pretty_exceptions_enable=False,
          help="Find and neutralise mismatched pairs in CLIP-style training data.")
console = LiteralConsole()
err_console = LiteralConsole(stderr=True)


def announce(source) -> None:
    """The one line a run over a dataset (or precomputed embeddings) starts with: its format and
    how it is read (`describe`); under torchrun only rank 0 says it."""
    import os

    if os.environ.get("RANK", "0") == "0":
        console.print(source.describe())
