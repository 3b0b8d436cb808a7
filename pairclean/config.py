"""What every config dataclass shares: each setting's range and whether it pins a resumed run,
declared once per field, and the one checker that enforces the declarations.

A numeric setting is declared where it is defined, its type by its annotation and its range by
`setting(default, Bounds)`: a config dataclass field (`seed: int = setting(0, SEED)`), a training
method's Options field, a decision rule's option (`OPTIONS = {"alpha": Declared(float, within(0, 1, ...))}`)
or a library function's parameter (`@declare(thumb=at_least(1))`). `check_value` is the checker
all of them reach: an int must be an int (not a bool, not 1.9), a float a finite number (no NaN or
infinity, ever), each within its bounds, and every int within int64 (a seed within uint32). A
refusal is a ConfigError naming the field, which the CLI words as its flag. `parse_value` turns
the text of `--rule fdr:alpha=0.1` and `--method-option tau2=inf` into the declared type first.

A resumed run (scoring or training) must have been started with the same settings, except for
the fields that cannot change its result (where it runs, how fast, whether to show progress).
Those are declared at the field with `unpinned(...)` (or `setting(..., pinned=False)`);
`pinned_settings(cfg)` is the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import inspect
import math
import numbers
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

from pairclean.errors import ConfigError, UserError

_PINNED = "pinned"
_BOUNDS = "bounds"
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Bounds:
    """Where a number may lie: [low, high], either end open or absent."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        low, high = _number(self.low), _number(self.high)
        if self.low is not None and self.high is not None:
            return f"within {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'above' if self.low_open else 'at least'} {low}"
        if self.high is not None:
            return f"{'below' if self.high_open else 'at most'} {high}"
        return "a finite number"


def _number(value: float | None) -> str:
    if value is None:
        return ""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def at_least(low: float) -> Bounds:
    return Bounds(low=low)


def above(low: float) -> Bounds:
    return Bounds(low=low, low_open=True)


def within(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Bounds:
    return Bounds(low, high, low_open, high_open)


FINITE = Bounds()  # any finite number
SEED = within(0, 2**32 - 1)  # what numpy, torch and Python's random all accept
COUNT = at_least(1)
SHARE = within(0, 1)
COSINE = within(-1, 1)  # a cosine, and the cone bias beta (a mean of cosines)
COSINE_STD = within(0, 1)  # the spread of cosines (beta's std)


@dataclass(frozen=True)
class Declared:
    """A setting declared away from a dataclass field (a rule's option): its type and bounds."""

    kind: type
    bounds: Bounds = FINITE
    optional: bool = False


def setting(default: Any = dataclasses.MISSING, bounds: Bounds = FINITE, *, pinned: bool = True):
    """A numeric config field and its bounds (its type is its annotation); `check_settings` enforces both."""
    return dataclasses.field(default=default, metadata={_PINNED: pinned, _BOUNDS: bounds})


def unpinned(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING):
    """A config field that a resumed run may change without changing its result."""
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={_PINNED: False})
    return dataclasses.field(default=default, metadata={_PINNED: False})


def pinned_settings(cfg) -> dict:
    """The fields of a config dataclass that a resumed run must share with the run it continues."""
    return {f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.metadata.get(_PINNED, True)}


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


def _unwrap(annotation) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of an annotation such as `float | None`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return (args[0] if len(args) == 1 else annotation), type(None) in typing.get_args(annotation)
    return annotation, False


def check_value(value: Any, kind: type, bounds: Bounds, field: str, optional: bool = False) -> Any:
    """The one check of a declared setting: `value` is a `kind` (int or float) within `bounds`;
    a ConfigError naming `field` otherwise. Returns the value (an int given for a float, as a float)."""
    if value is None and optional:
        return None
    if kind is int:  # numpy integers too; a bool is no count
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ConfigError(f"{field} must be an integer, got {value!r}", field)
        value = int(value)
        if bounds.holds(value) and abs(value) > INT64_MAX:
            raise ConfigError(f"{field} must be within [-{INT64_MAX}, {INT64_MAX}], got {value}", field)
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(f"{field} must be a number, got {value!r}", field)
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{field} must be a finite number, got {value}", field)
    else:
        raise TypeError(f"{field}: only int and float settings take bounds, not {kind}")
    if not bounds.holds(value):
        raise ConfigError(f"{field} must be {bounds.describe()}, got {value}", field)
    return value


def split_option(text: str) -> tuple[str, str] | None:
    """`key=value` -> (key, value), both stripped; None when there is no `=` or no key. The one
    reading of option strings (`--rule NAME:key=value,...`, `--method-option key=value`,
    `--attach NAME=FILE`); each caller words its own refusal."""
    key, eq, value = text.partition("=")
    key, value = key.strip(), value.strip()
    return (key, value) if eq and key else None


TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


def parse_value(text: str, declared: Declared, field: str) -> Any:
    """A setting given as text (`--rule fdr:alpha=0.05`, `--method-option networks=2`) as its declared
    type: an integer must be written as one ("1.9" and "1e3" are refused), then `check_value`; a
    bool is true/false (1/0, yes/no); `none` is None where the setting allows it; text stays text."""
    text = text.strip()
    if declared.optional and text.lower() in ("none", "null"):
        return None
    if declared.kind is bool:
        if text.lower() not in TRUE + FALSE:
            raise ConfigError(f"{field} must be true or false, got {text!r}", field)
        return text.lower() in TRUE
    if declared.kind not in (int, float):
        return text
    try:
        value = int(text) if declared.kind is int else float(text)
    except ValueError:
        noun = "an integer" if declared.kind is int else "a number"
        raise ConfigError(f"{field} must be {noun}, got {text!r}", field) from None
    return check_value(value, declared.kind, declared.bounds, field, declared.optional)


def parse_attachments(values: list[str] | None, field: str = "attach",
                      check_name: Callable[[str, str], Any] | None = None) -> dict[str, list[str]]:
    """`NAME=FILE` values -> {NAME: files} (a glob names several Parquet files); a malformed value or
    a name given twice is refused naming `field`, and each name is checked by `check_name(name,
    field)` (the names a table may have are the scores database's: `scores.db.check_attach_name`)."""
    tables: dict[str, list[str]] = {}
    for value in values or []:
        item = split_option(value)
        if item is None or not item[1]:
            raise ConfigError(f"`{field}` {value!r}: give NAME=FILE (e.g. meta=out/00000.parquet)", field)
        name, pattern = item
        if check_name is not None:
            check_name(name, field)
        if name.lower() in {n.lower() for n in tables}:
            raise ConfigError(f"`{field}` {value!r}: the table {name} is attached twice", field)
        files = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        if not files:
            raise UserError(f"`{field}` {value!r}: no file matches {pattern}")
        tables[name] = files
    return tables


def _resolved(annotation, owner) -> Any:
    """An annotation as a type (`from __future__ import annotations` leaves it a string)."""
    if isinstance(annotation, str):
        return eval(annotation, vars(sys.modules[owner.__module__]))  # noqa: S307 - the package's own annotations
    return annotation


def declarations(cls) -> dict[str, Declared]:
    """Every declared setting of a config dataclass: field name -> its type and bounds."""
    found = {}
    for f in dataclasses.fields(cls):
        if _BOUNDS in f.metadata:
            kind, optional = _unwrap(_resolved(f.type, cls))
            found[f.name] = Declared(kind, f.metadata[_BOUNDS], optional)
    return found


def field_types(cls) -> dict[str, Declared]:
    """Every field of a config dataclass as `parse_value` reads it from text: the declared settings
    with their bounds, any other field by its annotation (bool, text, optional)."""
    found = declarations(cls)
    for f in dataclasses.fields(cls):
        if f.name not in found:
            kind, optional = _unwrap(_resolved(f.type, cls))
            found[f.name] = Declared(kind, FINITE, optional)
    return {f.name: found[f.name] for f in dataclasses.fields(cls)}


def check_settings(cfg) -> None:
    """Enforce every declared setting of a config dataclass (call it in `__post_init__`)."""
    for name, declared in declarations(type(cfg)).items():
        setattr(cfg, name, check_value(getattr(cfg, name), declared.kind, declared.bounds, name, declared.optional))


def declare(**bounds: Bounds):
    """Declare a library function's numeric parameters (their type is their annotation): every call
    is checked by `check_value` before the function runs."""
    def wrap(function):
        signature = inspect.signature(function)
        kinds = {name: _unwrap(_resolved(signature.parameters[name].annotation, function)) for name in bounds}

        @functools.wraps(function)
        def checked(*args, **kwargs):
            given = signature.bind(*args, **kwargs)
            given.apply_defaults()
            for name, limit in bounds.items():
                kind, optional = kinds[name]
                given.arguments[name] = check_value(given.arguments[name], kind, limit, name, optional)
            return function(*given.args, **given.kwargs)

        checked.declared = {name: Declared(kinds[name][0], limit, kinds[name][1]) for name, limit in bounds.items()}
        return checked
    return wrap


def check_choice(value: Any, choices, field: str, what: str | None = None) -> None:
    """Refuse a value outside a fixed set, naming the config field and every choice (one wording for all)."""
    if value not in choices:
        raise ConfigError(f"unknown {what or field} {value!r} for `{field}`; "
                          f"choose one of {', '.join(map(str, choices))}", field)


def check_pretrained(pretrained: str | None) -> None:
    """An empty weights name is a mistake (an unset variable), not a request for random init."""
    if pretrained is not None and not str(pretrained).strip():
        raise ConfigError("pretrained is empty: give a pretrained tag, a checkpoint path, or 'none' for random init",
                          "pretrained")
