"""Inject synthetic noise into a dataset and write the ground truth beside it.

`shuffle` (the NCR protocol): a share `ratio` of the captions is chosen and permuted among
themselves; a pair whose caption text did not change (it drew its own caption, or an identical
one) stays clean. `hard` (the noise of web crawls: a caption that belongs to a similar item): a
share `ratio` of the pairs gets the caption of its nearest other item, nearest by cosine of TF-IDF
vectors of the item's texts (its caption; for text-text pairs both texts), a similarity that owes
nothing to the estimator; a donor whose caption equals the pair's own is passed over. `weak` (the weak noise of the DiffNCL benchmarks): a share `ratio` of the
captions gets about 30% of its words replaced by random words of the dataset's own vocabulary.
`mixed`: both in one run on disjoint draws, a share `ratio` shuffled and a share `weak_ratio`
weakened; the truth's `noise` column names each pair's kind (clean / weak / shuffle).

Three streaming passes, memory bounded by a batch:
1. every pair is read with the dataset's reader (`Dataset.read`) and (position, shard, index, key, caption) is
   spilled to a temp Parquet file;
2. DuckDB (on a temp database file, so it spills) picks the noisy positions and the permutation
   by ordering on md5 hashes of (seed, position): the choice depends only on the seed and the
   row order, not on numpy's or DuckDB's version; it writes the replacements sorted by position
   (`hard`: the donors come from sklearn's NearestNeighbors over the TF-IDF matrix, queried in
   chunks of drawn pairs; its brute-force search is itself chunked by sklearn's working_memory,
   so no N x N matrix is held; the sparse TF-IDF matrix of every caption is);
3. the dataset is read again and written to the new directory by its input format
   (`InputFormat.rewrite`) with only the caption replaced wherever the text field reads it (the
   text member and a json caption, or the column), every other member byte-identical, one output
   shard per input shard with the same file name (and its metadata sidecar, for img2dataset
   output), while the truth Parquet (key, shard, index, noisy, original_caption, ...) is streamed out.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.ops.atomic import write_json
from pairclean.config import SEED, SHARE, check_choice, declare, within
from pairclean.errors import ConfigError, UserError
from pairclean.data.dataset import Dataset, as_dataset
from pairclean.data.manifest import write_manifest
from pairclean.ops.guard import Output, open_output
from pairclean.ops.records import JsonObject
from pairclean.scorefile.sql import sandboxed_connection, sql_string
from pairclean.data.rewriting import rewriter_for
from pairclean.data.spec import DatasetSpec, UnitFailure
from pairclean.data.units import unit_shard
from pairclean.ops.urls import is_local

MODES = ("shuffle", "weak", "mixed", "hard")
DONOR_KINDS = ("shuffle", "hard")  # noise kinds whose new caption is another pair's, recorded as the donor
WEAK_SHARE = 0.3  # share of a caption's words replaced by weak noise
TRUTH_NAME = "truth/truth.parquet"  # under the output directory; a subdirectory, so scoring the directory skips it
_BATCH = 65536
_HARD_CHUNK = 4096  # drawn pairs per nearest-neighbour query
_ROWS_SCHEMA = pa.schema([("pos", pa.int64()), ("shard", pa.string()), ("index", pa.int64()),
                          ("key", pa.string()), ("caption", pa.string()),
                          ("context", pa.string())])  # text-text: the first text (hard noise's similarity uses it)
TRUTH_SCHEMA = pa.schema([
    ("key", pa.string()), ("shard", pa.string()), ("index", pa.int64()),
    ("noisy", pa.bool_()),  # the caption now differs from the pair's own
    ("selected", pa.bool_()),  # drawn for noise (a drawn pair can keep its caption)
    ("original_caption", pa.string()), ("caption", pa.string()),
    ("donor_shard", pa.string()), ("donor_index", pa.int64()),  # shuffle, hard: where the new caption came from
    ("noise", pa.string()),  # clean, or the kind of noise that changed the caption: weak | shuffle | hard
])


@dataclass
class CorruptResult:
    out: Path
    truth: Path
    manifest: Path
    mode: str
    ratio: float
    seed: int
    pairs: int
    eligible: int  # pairs with a readable caption: the ones noise is drawn from
    selected: int
    noisy: int
    weak_ratio: float | None = None  # mixed mode: the share weakened beside the `ratio` shuffled

    def as_dict(self) -> JsonObject:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


def caption_field(spec: DatasetSpec) -> str:
    """The member extension / column whose text the noise replaces."""
    if spec.pair == "image-text":
        return spec.fields.text
    if spec.pair == "text-text":
        return spec.fields.text2
    raise UserError(f"corrupt replaces captions: {spec.pair} pairs have none (use image-text or text-text)")


def weaken(caption: str, vocabulary: list[str], index: dict[str, int], rng: np.random.Generator,
           share: float = WEAK_SHARE) -> str:
    """Replace round(share * words) (at least one) words by other vocabulary words."""
    words = caption.split()
    n = min(len(words), max(1, round(share * len(words))))
    for p in rng.choice(len(words), size=n, replace=False):
        own = index.get(words[p].lower())
        pick = int(rng.integers(len(vocabulary) - (own is not None)))
        if own is not None and pick >= own:
            pick += 1  # skip the word itself: a replacement always changes the word
        words[p] = vocabulary[pick]
    return " ".join(words)


def _check_source(dataset: Dataset, ratio: float, mode: str, weak_ratio: float | None = None) -> None:
    spec = dataset.spec
    check_choice(mode, MODES, "mode", "noise mode")
    if (mode == "mixed") != (weak_ratio is not None):
        raise ConfigError("weak_ratio goes with mode mixed (the share weakened beside the ratio shuffled), "
                          "and mixed needs it", "weak_ratio", "mode", "ratio")
    if weak_ratio is not None and ratio + weak_ratio > 1.0:
        raise ConfigError(f"ratio + weak_ratio must be at most 1, got {ratio} + {weak_ratio}", "weak_ratio", "ratio")
    caption_field(spec)
    remote = [s for s in spec.shards if not is_local(s)]
    if remote:
        raise UserError(f"corrupt reads local shards twice; copy {remote[0]} (and the other URLs) to disk first")
    rewriter = rewriter_for(dataset)
    rewriter.check_rewritable()
    names = [rewriter.output_name(s) for s in dict.fromkeys(spec.shards)]
    if len(set(names)) != len(names):
        raise UserError("two input shards share a file name: corrupt keeps file names, so rename one of them")


def _spill_rows(dataset: Dataset, units: list[str], path: Path, progress) -> tuple[int, int]:
    """Pass 1: (pos, shard, index, key, caption) of every pair; caption NULL for error rows."""
    pairs = eligible = 0
    buf: dict[str, list] = {name: [] for name in _ROWS_SCHEMA.names}
    with pq.ParquetWriter(path, _ROWS_SCHEMA) as writer:
        def flush():
            writer.write_table(pa.table(buf, schema=_ROWS_SCHEMA))
            for values in buf.values():
                values.clear()

        for unit in units:
            for item in dataset.read(unit):
                if isinstance(item, UnitFailure):
                    if item.fields:  # a setting reads it wrong (the reason names which): nothing to repair
                        raise ConfigError(f"cannot read {item.unit}: {item.reason}", *item.fields)
                    raise UserError(f"cannot read {item.unit}: {item.reason}; corrupt copies whole shards, "
                                    "so repair that shard or leave it out")
                if item.shard != unit_shard(unit):
                    continue  # an error row from the shard's metadata (a failed download): no pair to copy
                caption = item.right if item.error is None else None
                context = item.left if caption is not None and dataset.spec.pair == "text-text" else None
                for name, value in (("pos", pairs), ("shard", item.shard), ("index", item.index),
                                    ("key", item.key), ("caption", caption), ("context", context)):
                    buf[name].append(value)
                pairs += 1
                eligible += caption is not None
                if len(buf["pos"]) >= _BATCH:
                    flush()
            if progress:
                progress(f"read {unit_shard(unit)}")
        flush()
    return pairs, eligible


def _plan(con: duckdb.DuckDBPyConnection, rows: Path, repl: Path, shuffled: int, weakened: int, seed: int,
          hard: int = 0) -> None:
    """Pass 2: the replacement table (pos, kind, donor_shard, donor_index, new_caption) sorted by pos.
    The first `shuffled` pairs of the md5 order are shuffled among themselves, the next `weakened`
    weakened; or (hard noise) the first `hard` take their nearest other item's caption."""
    rows_sql = f"read_parquet({sql_string(rows)})"
    if hard:
        con.execute(f"""CREATE TABLE picked AS SELECT pos, caption FROM {rows_sql} WHERE caption IS NOT NULL
                        ORDER BY md5(concat(?, ':pick:', pos)), pos LIMIT {int(hard)}""", [str(seed)])
        _plan_hard(con, rows, repl)
        return
    con.execute(f"""CREATE TABLE picked AS SELECT pos, caption,
                        CASE WHEN row_number() OVER (ORDER BY md5(concat(?, ':pick:', pos)), pos) <= {int(shuffled)}
                             THEN 'shuffle' ELSE 'weak' END AS kind
                    FROM {rows_sql} WHERE caption IS NOT NULL
                    ORDER BY md5(concat(?, ':pick:', pos)), pos LIMIT {int(shuffled) + int(weakened)}""",
                [str(seed), str(seed)])
    select = f"""
        WITH dest AS (SELECT pos, row_number() OVER (ORDER BY pos) AS r FROM picked WHERE kind = 'shuffle'),
             donor AS (SELECT pos AS donor_pos, caption,
                              row_number() OVER (ORDER BY md5(concat(?, ':perm:', pos)), pos) AS r
                       FROM picked WHERE kind = 'shuffle')
        SELECT dest.pos, 'shuffle' AS kind, rows.shard AS donor_shard, rows."index" AS donor_index,
               donor.caption AS new_caption
        FROM dest JOIN donor USING (r) JOIN {rows_sql} AS rows ON rows.pos = donor.donor_pos
        UNION ALL
        SELECT pos, kind, NULL::VARCHAR, NULL::BIGINT, NULL::VARCHAR FROM picked WHERE kind = 'weak'
        ORDER BY pos"""
    con.execute(f"COPY ({select}) TO {sql_string(repl)} (FORMAT parquet)", [str(seed)])


def _plan_hard(con: duckdb.DuckDBPyConnection, rows: Path, repl: Path) -> None:
    """The replacement table of hard noise: each drawn pair takes the caption of its nearest other
    item by TF-IDF cosine (ties: the lower position), skipping donors with the pair's own caption."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.neighbors import NearestNeighbors

    rows_sql = f"read_parquet({sql_string(rows)})"
    items = con.sql(f"""SELECT pos, shard, "index", caption, coalesce(context || ' ', '') || caption AS text
                            FROM {rows_sql} WHERE caption IS NOT NULL ORDER BY pos""").to_arrow_table()
    picked = con.execute("SELECT pos FROM picked ORDER BY pos").fetchnumpy()["pos"]
    positions = items.column("pos").to_numpy()
    captions = items.column("caption").to_pylist()
    try:
        vectors = TfidfVectorizer().fit_transform(items.column("text").to_pylist())
    except ValueError:  # an empty vocabulary: no caption has a word
        raise UserError("hard noise needs captions with words to compare (every caption is empty or stop words)") from None
    rows_of_picked = np.searchsorted(positions, picked)
    n_neighbors = min(len(captions), 8)  # a few spares for donors that share the pair's own caption
    index = NearestNeighbors(n_neighbors=n_neighbors, metric="cosine", algorithm="brute").fit(vectors)
    dest, donors = [], []
    for start in range(0, len(rows_of_picked), _HARD_CHUNK):
        chunk = rows_of_picked[start:start + _HARD_CHUNK]
        distances, neighbours = index.kneighbors(vectors[chunk])
        for row, dist, near in zip(chunk, distances, neighbours):
            order = np.lexsort((near, np.round(dist, 9)))  # nearest first; ties by row, so the choice is stable
            donor = next((int(n) for n in near[order] if n != row and captions[n] != captions[row]), None)
            if donor is not None:
                dest.append(int(positions[row]))
                donors.append(donor)
    table = pa.table({"pos": pa.array(dest, pa.int64()), "kind": pa.array(["hard"] * len(dest), pa.string()),
                      "donor_shard": items.column("shard").take(pa.array(donors, pa.int64())),
                      "donor_index": items.column("index").take(pa.array(donors, pa.int64())),
                      "new_caption": pa.array([captions[d] for d in donors], pa.string())})
    pq.write_table(table, repl)


def _vocabulary(con: duckdb.DuckDBPyConnection, rows: Path) -> list[str]:
    words = [r[0] for r in con.execute(
        f"""SELECT DISTINCT w FROM (SELECT unnest(regexp_extract_all(lower(caption), '[^\\s[:punct:]]+')) AS w
            FROM read_parquet({sql_string(rows)}) WHERE caption IS NOT NULL) WHERE w <> '' ORDER BY w""").fetchall()]
    if len(words) < 2:
        raise UserError("weak noise needs captions with at least two distinct words")
    return words


def _records(path: Path) -> Iterator[dict]:
    for batch in pq.ParquetFile(path).iter_batches(batch_size=_BATCH):
        yield from batch.to_pylist()


class _Noise:
    """Walks the spilled rows and the replacement table in position order, one pair at a time,
    and streams the truth rows."""

    def __init__(self, rows: Path, repl: Path, seed: int, vocabulary: list[str] | None,
                 names: dict[str, str], truth_path: Path, weak_share: float):
        self.rows = _records(rows)
        self.repl = _records(repl)
        self.next_repl = next(self.repl, None)
        self.seed, self.vocabulary, self.weak_share = seed, vocabulary, weak_share
        self.word_index = {w: i for i, w in enumerate(vocabulary)} if vocabulary else {}
        self.names = names  # input shard -> output shard path
        self.truth_path = truth_path
        self.writer = pq.ParquetWriter(truth_path, TRUTH_SCHEMA)
        self.buf: dict[str, list] = {name: [] for name in TRUTH_SCHEMA.names}
        self.selected = self.noisy = 0

    def next(self, shard: str, index: int, key: str | None) -> str | None:
        """The new caption of the next pair (None: unchanged); checks it is the pair pass 1 read."""
        row = next(self.rows, None)
        if row is None or row["shard"] != shard or row["index"] != index or (key is not None and row["key"] != key):
            seen = "nothing" if row is None else f"{row['key']!r} at {row['shard']}#{row['index']}"
            raise UserError(f"{shard} changed while it was being corrupted (pass 1 read {seen} where the copy "
                            f"finds {key!r} #{index}); run again on a dataset nobody is writing")
        repl = self.next_repl if self.next_repl is not None and self.next_repl["pos"] == row["pos"] else None
        new = None
        if repl is not None:
            self.next_repl = next(self.repl, None)
            self.selected += 1
            if repl["kind"] in DONOR_KINDS:
                new = repl["new_caption"]
            else:
                rng = np.random.default_rng([self.seed, row["pos"]])
                new = weaken(row["caption"], self.vocabulary, self.word_index, rng, self.weak_share)
        noisy = new is not None and new != row["caption"]
        donor = repl is not None and repl["kind"] in DONOR_KINDS
        for name, value in (("key", row["key"]), ("shard", self.names[shard]), ("index", index), ("noisy", noisy),
                            ("selected", repl is not None), ("original_caption", row["caption"]),
                            ("caption", new if noisy else row["caption"]),
                            ("donor_shard", self.names[repl["donor_shard"]] if donor else None),
                            ("donor_index", repl["donor_index"] if donor else None),
                            ("noise", repl["kind"] if noisy else "clean")):
            self.buf[name].append(value)
        if len(self.buf["key"]) >= _BATCH:
            self._flush()
        self.noisy += noisy
        return new if noisy else None

    def _flush(self) -> None:
        self.writer.write_table(pa.table(self.buf, schema=TRUTH_SCHEMA))
        for values in self.buf.values():
            values.clear()

    def finish(self) -> None:
        if next(self.rows, None) is not None:
            raise UserError("the dataset lost pairs while it was being corrupted; run again on a stable dataset")
        self._flush()

    def close(self) -> None:
        self.writer.close()


@declare(ratio=SHARE, seed=SEED, weak_share=within(0, 1, low_open=True), weak_ratio=SHARE)
def corrupt(source: str | list[str] | DatasetSpec | Dataset, out: str | Path | Output, ratio: float, seed: int = 0,
            mode: str = "shuffle", overwrite: bool = False, weak_share: float = WEAK_SHARE,
            progress: Callable[[str], None] | None = None, weak_ratio: float | None = None) -> CorruptResult:
    """Write a noisy copy of `source` to the directory `out` with `out/truth/truth.parquet`,
    `out/manifest.yaml` (whose `truth:` points at it) and `out/corrupt.json`. `ratio` is the share
    drawn for `mode`'s noise; in mixed mode the share shuffled, beside `weak_ratio` weakened."""
    dataset = as_dataset(source)
    spec = dataset.spec
    _check_source(dataset, ratio, mode, weak_ratio)
    target = open_output(out, [*spec.shards, spec.truth], "out", kind="directory", overwrite=overwrite)
    out = target.path
    field = caption_field(spec)
    units = dataset.units()
    shards = list(dict.fromkeys(spec.shards))
    with tempfile.TemporaryDirectory(prefix="pairclean-corrupt-") as work, target.stage() as tmp:
        work = Path(work)
        rows, repl = work / "rows.parquet", work / "replacements.parquet"
        pairs, eligible = _spill_rows(dataset, units, rows, progress)
        shares = {"shuffle": (ratio, 0.0, 0.0), "weak": (0.0, ratio, 0.0), "mixed": (ratio, weak_ratio, 0.0),
                  "hard": (0.0, 0.0, ratio)}[mode]
        shuffled, weakened, hard = (round(share * eligible) for share in shares)
        con = sandboxed_connection(work / "spill", directories=[work], database=str(work / "plan.duckdb"))
        try:
            _plan(con, rows, repl, shuffled, weakened, seed, hard)
            vocabulary = _vocabulary(con, rows) if weakened else None
        finally:
            con.close()
        fmt = rewriter_for(dataset)
        names = {s: str(out / fmt.output_name(s)) for s in shards}
        (tmp / "truth").mkdir()
        noise = _Noise(rows, repl, seed, vocabulary, names, tmp / TRUTH_NAME, weak_share)
        try:
            for shard in shards:
                fmt.rewrite(shard, tmp, noise.next, field)
                if progress:
                    progress(f"wrote {names[shard]}")
            noise.finish()
        finally:
            noise.close()
        new_spec = DatasetSpec(format=spec.format, shards=list(names.values()), pair=spec.pair, fields=spec.fields,
                               image_root=fmt.copy_root(),
                               label_template=spec.label_template, truth=str(out / TRUTH_NAME),
                               name=f"{spec.name or 'dataset'}-{mode}-{ratio:g}"
                                    + (f"-weak-{weak_ratio:g}" if weak_ratio is not None else ""))
        write_manifest(tmp / "manifest.yaml", new_spec, shards_relative_to=out)
        result = CorruptResult(out=out, truth=out / TRUTH_NAME, manifest=out / "manifest.yaml", mode=mode, ratio=ratio,
                               seed=seed, pairs=pairs, eligible=eligible, selected=noise.selected, noisy=noise.noisy,
                               weak_ratio=weak_ratio)
        write_json(tmp / "corrupt.json", {**result.as_dict(), "source": spec.shards, "source_format": spec.format,
                                          "pair": spec.pair, "caption_field": field, "weak_share": weak_share,
                                          "selection": "md5(seed:pick:position) order: the first round(ratio * eligible) pairs "
                                       "(mixed: shuffled, then the next round(weak_ratio * eligible) weakened)"})
    return result
