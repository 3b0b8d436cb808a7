"""The score sink: one Parquet part per unit plus a JSON commit record, both written atomically.

The commit record is the truth: a part without one is redone on resume, so a killed run loses
and duplicates nothing. The parts directory also pins the run's settings and its beta, so that
a resumed run cannot silently mix scores computed under different settings.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.atomic import atomic_path, write_json
from pairclean.errors import UserError

PART_SCHEMA = pa.schema([
    ("key", pa.string()),
    ("shard", pa.string()),
    ("index", pa.int64()),
    ("sim", pa.float32()),
    ("error", pa.string()),
])


def parts_dir_for(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


class PartStore:
    def __init__(self, directory: Path):
        self.dir = Path(directory)

    @staticmethod
    def _stem(unit: str) -> str:
        return "part-" + hashlib.sha1(unit.encode()).hexdigest()[:20]

    def part_path(self, unit: str) -> Path:
        return self.dir / f"{self._stem(unit)}.parquet"

    def record_path(self, unit: str) -> Path:
        return self.dir / f"{self._stem(unit)}.done.json"

    def committed(self) -> dict[str, dict]:
        """Commit records of finished units, keyed by unit (only those whose part file exists)."""
        records = {}
        if not self.dir.is_dir():
            return records
        for path in self.dir.glob("part-*.done.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # an unreadable record means the unit is redone
            if self.part_path(record["unit"]).is_file():
                records[record["unit"]] = record
        return records

    def commit(self, unit: str, columns: dict[str, list], record: dict) -> None:
        table = pa.Table.from_pydict(columns, schema=PART_SCHEMA)
        with atomic_path(self.part_path(unit)) as tmp:
            pq.write_table(table, tmp)
        write_json(self.record_path(unit), {**record, "unit": unit, "rows": table.num_rows})

    def open_run(self, settings: dict, overwrite: bool) -> bool:
        """Create the parts directory, or check that an existing one was made with the same settings.

        Returns True when resuming an earlier run.
        """
        config = self.dir / "settings.json"
        if self.dir.exists() and overwrite:
            shutil.rmtree(self.dir)
        if config.is_file():
            earlier = json.loads(config.read_text())
            differ = sorted(k for k in set(earlier) | set(settings) if earlier.get(k) != settings.get(k))
            if differ:
                shown = "; ".join(f"{k}: {earlier.get(k)!r} -> {settings.get(k)!r}" for k in differ[:4])
                raise UserError(f"{self.dir} holds an unfinished run with different settings ({shown}); "
                                "re-run with the same settings to resume, or pass --overwrite to start over")
            return True
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json(config, settings)
        return False

    def load_beta(self) -> dict | None:
        path = self.dir / "beta.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def save_beta(self, beta: dict) -> None:
        write_json(self.dir / "beta.json", beta)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
