"""Records read back from files: frozen dataclasses with a strict JSON round trip.

What a run writes for later commands (a scores file's provenance and summary, the dataset it
recorded, a saved-embeddings directory's provenance.json, a run's resume state) is read back
after anyone may have edited, truncated or hand-written it: it is an input, checked as strictly as
a flag. `Record.from_json(value, source)` takes decoded JSON and the file it came from and
returns the record, or raises `RecordError`, one line naming the file and the field: an unknown
key, a value of the wrong type, a non-finite number (JSON `NaN` / `Infinity`), a missing field.
`to_json()` writes it back in the same shape (a field that is None by default and None now is
left out, as files from before a field existed lack it).

The types come from the dataclass annotations: `str`, `int` (never a bool), `float` (an int
is taken; finite), `bool`, `None`, unions (`X | None`), `list[T]`, `dict[str, T]`, any
dataclass (recursively: a record's fields, or a plain dataclass such as
`core.mixture.FittedMixture`), and `Json` or a bare `dict` (any JSON value with finite numbers:
the open maps a registry fills, e.g. an encoder backend's own provenance). A number's range
is declared at its field as a setting's is (`config.setting(default, bounds)`: beta within
[-1, 1], its K at least 1) and checked here, for every record and plain dataclass read, in
one place; a record may also check values against each other (`problems`) and read an older
shape of itself (`upgraded`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, Union

from pairclean.config import Declared, declarations
from pairclean.errors import UserError

Json = Any  # any JSON value whose numbers are finite (an open map: its keys are not known here)

# What a function returns when a dict is what it is, not a record whose shape only its readers know
# (docs/architecture.md, "A record"); `benchmarks/architecture_stats.py` counts each kind, and every
# other function annotated to return a dict as a bare one. Each is `dict`, subscripted as one.
Keyed = dict  # a mapping keyed by data: units, names, columns, files, rows (`Keyed[str, Path]`)
JsonObject = dict  # JSON written, sent or compared as it is: a provenance entry, a metrics line, pinned settings
StateDict = dict  # torch's convention: state saved with `torch.save` and loaded back for an exact resume
MAX_SHOWN = 60  # characters of a wrong value an error quotes


class RecordError(UserError):
    """A record read back from a file is not what pairclean writes there: one line naming the
    file (`source`, or the file and where in it) and the field."""

    def __init__(self, source: str | Path, what: str, field: str, problem: str):
        self.source, self.field, self.problem = str(source), field, problem
        where = f"{field}: " if field else ""
        super().__init__(f"{source} is not a valid {what} ({where}{problem}); was it edited or cut short?")


class Problem(ValueError):
    """A value that does not fit its field (`field`: dotted path inside the record)."""

    def __init__(self, field: str, problem: str):
        super().__init__(problem)
        self.field, self.problem = field, problem


def _shown(value) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, float) else repr(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


def _json_name(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _join(path: str, name) -> str:
    return f"{path}[{name}]" if isinstance(name, int) else (f"{path}.{name}" if path else str(name))


@cache
def _hints(cls: type) -> Keyed[str, Any]:
    return typing.get_type_hints(cls)


@cache
def _declared(cls: type) -> Keyed[str, Declared]:
    return declarations(cls)


def _finite_json(value, path: str):
    """Any JSON value, its numbers finite (and its objects keyed by strings)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise Problem(path, f"must be a finite number, got {value!r}")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise Problem(path, f"has a key that is not a string ({_shown(key)})")
            _finite_json(item, _join(path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _finite_json(item, _join(path, i))
    elif not isinstance(value, (str, int, float, bool, type(None))):
        raise Problem(path, f"is {type(value).__name__}, not JSON")
    return value


def _wrong(path: str, wanted: str, value) -> Problem:
    return Problem(path, f"must be {wanted}, got {_json_name(value)} {_shown(value)}")


def convert(value, hint, path: str = ""):
    """`value` (decoded JSON) as the type `hint`, or a Problem naming `path`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Json:
        return _finite_json(value, path)
    if origin in (Union, types.UnionType):  # `X | None`, the one union records use
        (inner,) = [a for a in args if a is not type(None)]
        return None if value is None else convert(value, inner, path)
    if origin is list:
        if not isinstance(value, list):
            raise _wrong(path, "a list", value)
        return [convert(item, args[0], _join(path, i)) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _wrong(path, "an object", value)
        return {key: convert(item, args[1], _join(path, key)) for key, item in value.items()}
    if dataclasses.is_dataclass(hint):
        return _from_fields(hint, value, path)
    if hint is bool:
        if not isinstance(value, bool):
            raise _wrong(path, "true or false", value)
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _wrong(path, "an integer", value)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _wrong(path, "a number", value)
        if not math.isfinite(value):
            raise Problem(path, f"must be a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise _wrong(path, "a string", value)
        return value
    if hint is dict:  # a bare `dict` annotation: an open JSON object
        if not isinstance(value, dict):
            raise _wrong(path, "an object", value)
        return _finite_json(value, path)
    raise TypeError(f"cannot read a field of type {hint!r} from JSON")


def _from_fields(cls: type, value, path: str):
    if isinstance(cls, type) and issubclass(cls, Record):
        value = cls.upgraded(value) if isinstance(value, dict) else value
    if not isinstance(value, dict):
        raise Problem(path, f"must be an object, got {_json_name(value)}" + ("" if path else f" {_shown(value)}"))
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [key for key in value if key not in fields]
    if unknown:
        raise Problem(_join(path, unknown[0]), "unknown field")
    given = {}
    for name, field in fields.items():
        if name in value:
            given[name] = convert(value[name], hints[name], _join(path, name))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise Problem(_join(path, name), "missing")
    for name, declared in _declared(cls).items():  # a field declared with `config.setting(default, bounds)`
        if given.get(name) is not None and not declared.bounds.holds(given[name]):
            raise Problem(_join(path, name), f"must be {declared.bounds.describe()}, got {_shown(given[name])}")
    record = cls(**given)
    if isinstance(record, Record):
        for field, problem in record.problems():
            raise Problem(_join(path, field), problem)
    return record


def _written(value) -> JsonObject:
    """A dataclass's fields as JSON, less those that are None by default and None now (absent
    reads back as None; a field without a default is always written)."""
    return {f.name: _as_json(getattr(value, f.name)) for f in dataclasses.fields(value)
            if getattr(value, f.name) is not None or f.default is dataclasses.MISSING}


def _as_json(value):
    """A record, dataclass or container as JSON values."""
    if isinstance(value, Record):
        return value.to_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _written(value)
    if isinstance(value, (list, tuple)):
        return [_as_json(item) for item in value]
    if isinstance(value, dict):
        return {key: _as_json(item) for key, item in value.items()}
    return value


@dataclasses.dataclass(frozen=True)
class Record:
    """Base of the records pairclean writes for later commands to read (see the module)."""

    what: ClassVar[str] = "record"  # how errors name it: "saved-embeddings provenance"

    @classmethod
    def from_json(cls, value, source: str | Path):
        """The record `value` (decoded JSON) holds; a RecordError naming `source` and the field otherwise."""
        try:
            return _from_fields(cls, value, "")
        except Problem as problem:
            raise RecordError(source, cls.what, problem.field, problem.problem) from None

    @classmethod
    def read(cls, path: str | Path, max_bytes: int = 64 << 20):
        """The record in a JSON file (at most `max_bytes`): unreadable, not JSON or not the record
        is one RecordError."""
        try:
            with open(path, "rb") as fh:
                data = fh.read(max_bytes + 1)
        except OSError as exc:
            raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
        if len(data) > max_bytes:
            raise RecordError(path, cls.what, "", f"it is over {max_bytes:,} bytes")
        return cls.from_json(cls.parse(data, path), path)

    @classmethod
    def parse(cls, data: bytes | str, source: str | Path):
        """Decoded JSON (NaN and Infinity are decoded, for the fields to refuse by name)."""
        try:
            return json.loads(data)
        except RecursionError:
            raise RecordError(source, cls.what, "", "its JSON is nested too deeply") from None
        except ValueError as exc:
            raise RecordError(source, cls.what, "", f"not JSON: {str(exc)[:120]}") from None

    @classmethod
    def upgraded(cls, value: dict) -> JsonObject:
        """An older shape of this record's JSON in today's (the identity unless a record changed shape)."""
        return value

    def problems(self) -> typing.Iterator[tuple[str, str]]:
        """(field, why) for values that each fit their type but not together or not their range."""
        return iter(())

    def to_json(self) -> JsonObject:
        return _written(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), allow_nan=False)
