"""Parquet files, read in stages: row groups (the units) -> rows -> pairs.

    row_groups     each file's row groups as units (`path#rg=N`)
    parquet_pairs  one row group's rows -> RawPairs, through the dataset's fields
                   (`reading.values`); a row the source itself marks failed becomes an error row
    parquet_keys   the keys of every row of a file, reading the key column alone
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

from pairclean.data.reading.inputs import parquet_file
from pairclean.data.reading.values import decode_text, fill, image_value, read_image_path
from pairclean.data.spec import PAIR_KINDS, DatasetSpec, Fields, RawPair, UnitFailure
from pairclean.data.units import Unit, unique_shards
from pairclean.ops.records import Keyed


def row_groups(shards: list[str]) -> list[str]:
    """Each Parquet file's row groups as units (a file that cannot be opened is one unit, whose
    read reports why)."""
    units = []
    for path in unique_shards(shards):
        try:
            n = parquet_file(path).metadata.num_row_groups  # 0 for an empty file: no unit, no pairs
        except Exception:  # pyarrow, the OS or a remote filesystem: the unit's read names the failure
            n = 1
        units.extend(str(Unit.row_group(path, i)) for i in range(n))
    return units


def row_group_rows(unit: str) -> int:
    """How many rows a row group holds, from the file's metadata (0 when the file cannot be read:
    its read reports why)."""
    parsed = Unit.parse(unit)
    try:
        return parquet_file(parsed.path).metadata.row_group(parsed.part).num_rows
    except Exception:  # pyarrow, the OS or a remote filesystem: the unit's read names the failure
        return 0


def columns(spec: DatasetSpec) -> Keyed[str, str | None]:
    """role (`key`, `left_image`, `right_text`, ...) -> the column that holds it for this pair kind."""
    f = spec.fields
    cols = {"key": f.key}
    if spec.pair in ("image-text", "image-label", "image-image"):
        cols["left_image"] = f.image_path or f.image
    if spec.pair == "image-text":
        cols["right_text"] = f.text
    elif spec.pair == "image-label":
        cols["right_label"] = f.label
    elif spec.pair == "image-image":
        cols["right_image"] = f.image2_path or f.image2
    elif spec.pair == "text-text":
        cols["left_text"] = f.text
        cols["right_text"] = f.text2
    return cols


def positional_key(path: str, index: int) -> str:
    """The key of a Parquet row when the file has no key column."""
    return f"{Path(path).stem}/{index}"


def parquet_keys(spec: DatasetSpec, path: str) -> list[str]:
    """Header mode for Parquet: the keys of every row of the file, reading the key column alone."""
    pf = parquet_file(path)
    if spec.fields.key in pf.schema_arrow.names:
        return [str(k) for k in pf.read(columns=[spec.fields.key]).column(0).to_pylist()]
    return [positional_key(path, i) for i in range(pf.metadata.num_rows)]


def _pairs_fitting(spec: DatasetSpec, available: set[str], defaults: dict) -> list[str]:
    """Other pair kinds whose default columns a Parquet file has: the likely fix when the given
    kind's columns are missing (text-text pairs read as the default image-text)."""
    fits = []
    for kind in PAIR_KINDS:
        other = replace(spec, pair=kind, fields=Fields().resolved(defaults))
        if kind != spec.pair and all(c in available or c == other.fields.key for c in columns(other).values()):
            fits.append(kind)
    return fits


RowError = Callable[[dict], "str | None"]  # a format's own per-row failure (img2dataset's status), from `extra` columns


def parquet_pairs(spec: DatasetSpec, unit: str, root: Path, defaults: dict, extra: tuple[str, ...] = (),
                  row_error: RowError | None = None) -> Iterator[RawPair | UnitFailure]:
    """Pairs mode for a Parquet row group. Image paths are read under `root`; `row_error(values of
    the `extra` columns)` names a row the source itself marks failed (it becomes an error row).
    `defaults`: the format's field defaults, for the hint when the pair kind's columns are missing."""
    parsed = Unit.parse(unit)
    path, rg = parsed.path, parsed.part
    try:
        pf = parquet_file(path)
        offset = sum(pf.metadata.row_group(i).num_rows for i in range(rg))
        cols = columns(spec)
        available = set(pf.schema_arrow.names)
        missing = [c for c in cols.values() if c not in available and c != spec.fields.key]
        if missing:
            fits = _pairs_fitting(spec, available, defaults)
            hint = f"; its columns fit `pair` {' or '.join(fits)}" if fits else ""
            yield UnitFailure(unit, f"column(s) {missing} not in {path} (has {sorted(available)}){hint}",
                              ("pair",) if fits else ())
            return
        extra = tuple(c for c in extra if c in available)
        table = pf.read_row_group(rg, columns=[c for c in dict.fromkeys([*cols.values(), *extra]) if c in available])
    except Exception as exc:  # pyarrow, the OS or a remote filesystem: the unit fails with its reason
        yield UnitFailure(unit, f"cannot read Parquet: {str(exc).splitlines()[0][:300]}")
        return
    f = spec.fields
    extras = {c: table.column(c).to_pylist() for c in extra}
    by_path = {"left_image": f.image_path is not None, "right_image": f.image2_path is not None}
    data = {role: (table.column(col).to_pylist() if col in table.column_names else None) for role, col in cols.items()}
    for i in range(table.num_rows):
        keys = data["key"]
        pair = RawPair(key=str(keys[i]) if keys is not None else positional_key(path, offset + i), shard=path,
                       index=offset + i)
        if row_error is not None and (reason := row_error({c: v[i] for c, v in extras.items()})):
            pair.error = reason
            yield pair
            continue
        for role, values in data.items():
            if role == "key":
                continue
            side, kind = role.split("_")
            value = values[i]
            if kind == "image":
                if by_path[role]:
                    fill(pair, side, *read_image_path(root, value))
                else:
                    fill(pair, side, *image_value(value, root))
            elif kind == "label":
                label, err = decode_text(None if value is None else str(value), "label")
                fill(pair, side, spec.label_template.format(label=label) if label else None, err)
            else:
                # The same words as the tar path: a text-text pair's right side is its "second text".
                fill(pair, side, *decode_text(value, "second text" if side == "right" and spec.pair == "text-text"
                                              else "caption"))
        yield pair
