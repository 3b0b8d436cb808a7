"""The reader contract: every mode numbers a shard's rows alike, so what scoring wrote can be
filtered, listed for training and copied, even on hostile shards.

The shards are built for real with the hostile-input suite's builders (tarfile member by member,
then cut or corrupted); the filter case runs `pairclean score` and `pairclean filter` end to end.
"""

from __future__ import annotations

import functools
import gzip
import io
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import duckdb
import pytest
from helpers import run_cli
from test_hostile_inputs import _four_pairs, write_tar

from pairclean.cli import main
from pairclean.curate.filter import filter_dataset
from pairclean.data.dataset import Dataset, open_dataset
from pairclean.data.manifest import load_manifest
from pairclean.data.reading import values
from pairclean.data.reading import tar as tar_reading
from pairclean.data.reading.tar import list_samples, read_samples
from pairclean.data.spec import DatasetSpec, UnitFailure, raise_failure
from pairclean.data.units import Unit, UnitKind, unit_shard
from pairclean.errors import UserError

TINY = ["--model", "pairclean-tiny", "--pretrained", "none", "--beta-k", "64", "--workers", "0", "--batch-size", "4"]


@pytest.fixture(scope="module")
def jpeg(coco_src) -> bytes:
    return next((coco_src / "val2017").glob("*.jpg")).read_bytes()


def _with_symlink(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A tar whose second entry is a symlink (not a regular member: every mode skips it)."""
    link = tarfile.TarInfo("k0.png")
    link.type, link.linkname = tarfile.SYMTYPE, "k0.jpg"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for i, (name, data) in enumerate(members):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
            if i == 0:
                tf.addfile(link)
    return path


def hostile_shards(root: Path, jpeg: bytes) -> dict[str, Path]:
    """Every hostile tar the hostile-input suite reads, plus the shapes only a copy or a listing
    meets (metadata members, suffix case, members without a suffix, a cut inside padding)."""
    four = _four_pairs(jpeg)
    full = write_tar(root / "full.tar", four).read_bytes()
    member = 512 + (len(jpeg) + 511) // 512 * 512  # header + padded data of one jpg member
    shards = {"whole": root / "full.tar"}

    def cut(name: str, size: int) -> None:
        (root / f"{name}.tar").write_bytes(full[:size])
        shards[name] = root / f"{name}.tar"

    cut("cut-in-member-data", member // 2)
    cut("cut-in-a-header", member + 200)
    cut("cut-at-a-member-boundary", member + 1024)
    cut("cut-in-the-third-jpg", 2 * (member + 1024) + member // 2)
    cut("cut-in-padding", member + 512 + 200)  # the 1st caption's bytes are whole, its padding is not
    corrupt = bytearray(full)
    corrupt[member + 5] ^= 0xFF
    (root / "corrupt-header.tar").write_bytes(bytes(corrupt))
    shards["corrupt-header"] = root / "corrupt-header.tar"
    shards["empty-file"] = root / "empty.tar"
    shards["empty-file"].write_bytes(b"")
    shards["not-a-tar"] = root / "garbage.tar"
    shards["not-a-tar"].write_bytes(b"this is not a tar file " * 100)
    shards["vanished"] = root / "never-written.tar"

    built = {
        "repeated-keys": [("a.jpg", jpeg), ("a.txt", b"one"), ("a.jpg", jpeg), ("a.txt", b"two"),
                          ("b.jpg", jpeg), ("b.txt", b"three"), ("a.jpg", jpeg), ("a.txt", b"four")],
        "meta-members": [("__meta__", b"{}"), ("k.jpg", jpeg), ("__info__", b"[]"), ("k.txt", b"cap"),
                         ("__cache__/k.txt", b"x"), ("m.jpg", jpeg), ("m.txt", b"cap")],
        "mixed-case-suffixes": [("a.JPG", jpeg), ("a.txt", b"one"), ("a.jpg", jpeg), ("a.TXT", b"two"),
                                ("b.Jpg", jpeg), ("b.json.GZ", b"\x1f\x8b"), ("b.json.gz", b"\x1f\x8b")],
        "no-suffix-and-dirs": [("README", b"notes"), ("d/x.jpg", jpeg), ("d/x.txt", b"in a dir"),
                               ("e/x.jpg", jpeg), ("e/x.txt", b"same stem, other dir")],
        "captions": [("missing.jpg", jpeg), ("empty.jpg", jpeg), ("empty.txt", b"  \n\t "),
                     ("latin1.jpg", jpeg), ("latin1.txt", "caf\xe9".encode("latin-1")),
                     ("noimage.txt", b"a caption without an image")],
        "oversized-member": [("x.jpg", jpeg), ("x.txt", b"fine"), ("y.jpg", jpeg), ("y.txt", b"also fine")],
    }
    for name, members in built.items():
        shards[name] = write_tar(root / f"{name}.tar", members)
    shards["symlink-member"] = _with_symlink(root / "symlink.tar", four)
    claim = tarfile.TarInfo("k1.jpg")
    claim.size = 40 << 30  # the header claims 40 GB, the file ends 1,000 bytes into the data
    shards["cut-claiming-40-gb"] = root / "cut-claiming-40-gb.tar"
    shards["cut-claiming-40-gb"].write_bytes(full[:member + 1024] + claim.tobuf(tarfile.GNU_FORMAT) + jpeg[:1000])
    compressed = gzip.compress(full)
    for name, data in (("gzip-whole", compressed), ("gzip-cut", compressed[:len(compressed) * 2 // 3])):
        shards[name] = root / f"{name}.tar.gz"
        shards[name].write_bytes(data)
    return shards


def rows_by_mode(shard: str) -> dict[str, tuple[list[tuple[str, int, str]], bool]]:
    """(shard, index, key) of every row, and whether the shard broke, as each mode reads it."""
    items = list(Dataset(DatasetSpec("webdataset", [shard])).read(shard))
    out = {"pairs": ([(p.shard, p.index, p.key) for p in items if not isinstance(p, UnitFailure)],
                     any(isinstance(p, UnitFailure) for p in items))}
    for mode, read in (("raw samples", read_samples), ("header listing", list_samples),
                       ("the copy's listing", functools.partial(list_samples, copy=True))):
        failures: list[UnitFailure] = []
        rows = [(s.shard, s.index, s.key) for s in read(shard, failures.append)]
        out[mode] = (rows, bool(failures))
    return out


def test_every_mode_yields_the_same_rows_on_every_hostile_shard(tmp_path, jpeg, monkeypatch):
    monkeypatch.setattr(values, "MAX_MEMBER_BYTES", 1000)  # every jpg is "oversized" for the pairs mode
    shards = hostile_shards(tmp_path, jpeg)
    broken = {"cut-in-member-data", "cut-in-a-header", "cut-at-a-member-boundary", "cut-in-the-third-jpg",
              "cut-in-padding", "corrupt-header", "empty-file", "not-a-tar", "vanished", "gzip-cut",
              "cut-claiming-40-gb"}
    for name, path in shards.items():
        modes = rows_by_mode(str(path))
        pairs = modes.pop("pairs")
        for mode, got in modes.items():
            assert got == pairs, (name, mode)
        assert pairs[1] == (name in broken), name
    keys = {name: [k for _, _, k in rows_by_mode(str(shards[name]))["pairs"][0]] for name in shards}
    assert keys["repeated-keys"] == ["a", "a", "b", "a"]
    assert keys["meta-members"] == ["k", "m"]
    assert keys["mixed-case-suffixes"] == ["a", "a", "b", "b"]
    assert keys["no-suffix-and-dirs"] == ["d/x", "e/x"]
    assert keys["cut-in-padding"] == ["k0"] and keys["cut-in-the-third-jpg"] == ["k0", "k1"]


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar writes the sparse and long-named members")
@pytest.mark.parametrize("writer", ["gnu", "posix", "webdataset"])
def test_every_mode_reads_the_bytes_stored_by_gnu_tar_and_webdataset(tmp_path, jpeg, writer):
    """Members are read from where their data lies: the bytes as stored, through GNU tar's sparse
    members (holes read as zeros), names too long for a ustar header (GNU's long-name members,
    PAX's path records) and webdataset's PAX header before each member; compressed shards too."""
    import webdataset as wds

    stem = "d" * 120 + "/k1"  # a name no ustar header holds
    files = {"k0.jpg": jpeg, "k0.txt": b"a caption", f"{stem}.jpg": jpeg + bytes(300_000) + b"end",
             f"{stem}.txt": b"the second caption"}
    src = tmp_path / "src"
    for name, data in files.items():
        path = src / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            if data.startswith(jpeg) and len(data) > len(jpeg):  # written with a hole, for tar --sparse
                f.write(jpeg)
                f.seek(len(data) - 3)
                f.write(b"end")
            else:
                f.write(data)
    shard = tmp_path / "shard.tar"
    if writer == "webdataset":
        with wds.TarWriter(str(shard)) as sink:
            for key in ("k0", stem):
                sink.write({"__key__": key, "jpg": files[f"{key}.jpg"], "txt": files[f"{key}.txt"]})
    else:
        subprocess.run(["tar", "--sparse", f"--format={writer}", "-cf", str(shard), "-C", str(src), *files],
                       check=True)
    holes = (src / f"{stem}.jpg").stat().st_blocks * 512 < len(files[f"{stem}.jpg"])  # as the filesystem keeps it
    with tarfile.open(shard) as archive:
        sparse = [m.name for m in archive.getmembers() if m.issparse()]
    assert sparse == ([f"{stem}.jpg"] if holes and writer != "webdataset" else [])  # the case is the one meant
    gz = tmp_path / "shard.tar.gz"
    gz.write_bytes(gzip.compress(shard.read_bytes()))
    for path in (str(shard), str(gz)):
        stored = [{f"{s.key}.{suffix}": data for suffix, data in s.members.items()} for s in read_samples(path, raise_failure)]
        assert stored == [{n: files[n] for n in files if n.startswith(key + ".")} for key in ("k0", stem)]
        listed = [s.members for s in list_samples(path, raise_failure)]
        assert listed == [{"jpg": len(files[f"{key}.jpg"]), "txt": len(files[f"{key}.txt"])} for key in ("k0", stem)]
        pairs = list(Dataset(DatasetSpec("webdataset", [path])).read(path))
        assert [(p.key, p.left, p.right) for p in pairs] == [
            (key, files[f"{key}.jpg"], files[f"{key}.txt"].decode()) for key in ("k0", stem)]


def test_a_copy_allocates_no_more_than_a_member_holds(tmp_path, jpeg, monkeypatch):
    """A cut member whose header claims 40 GB: raw mode reads what is there (before, it asked for a
    40 GB buffer and the shard failed as "MemoryError") and ends the shard as the other modes do.
    A whole member read in pieces is the member's bytes, plain and gzipped."""
    shards = hostile_shards(tmp_path, jpeg)
    shard = str(shards["cut-claiming-40-gb"])
    for read in (read_samples, list_samples):
        failures: list[UnitFailure] = []
        assert [s.key for s in read(shard, failures.append)] == ["k0"]
        assert [f.reason for f in failures] == ["truncated tar: the file ends inside member data after 3 member(s)"]
    whole = [[(s.key, s.members) for s in read_samples(str(shards[name]), raise_failure)]
             for name in ("whole", "gzip-whole")]
    monkeypatch.setattr(tar_reading, "RAW_READ_PIECE", 1000)  # every jpg in pieces
    assert len(jpeg) > 2000
    assert [[(s.key, s.members) for s in read_samples(str(shards[name]), raise_failure)]
            for name in ("whole", "gzip-whole")] == whole == [
        [(f"k{i}", {"jpg": jpeg, "txt": f"caption {i}".encode()}) for i in range(4)]] * 2


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar writes the sparse member")
def test_a_sparse_member_a_copy_would_expand_past_the_cap_is_refused(tmp_path, jpeg, monkeypatch, capsys):
    """A GNU sparse member stores a few bytes and declares any size, and a copy writes it out whole
    (holes as zeros): over the cap raw mode refuses it - one line, the shard's rows before it kept -
    where it used to fill memory. Scoring reads the pairs (the member is neither side); filter and
    its dry run stop with that reason, not "changed since it was scored" or a 3 MiB dry run."""
    src = tmp_path / "src"
    src.mkdir()
    captions = [b"a photo", b"another photo"]
    for i, caption in enumerate(captions):
        (src / f"k{i}.jpg").write_bytes(jpeg)
        (src / f"k{i}.txt").write_bytes(caption)
    with open(src / "k0.bin", "wb") as f:  # 3 MiB declared, 5 bytes written
        f.write(b"hello")
        f.truncate(3 << 20)
    if (src / "k0.bin").stat().st_blocks * 512 >= 3 << 20:
        pytest.skip("this filesystem keeps no holes")
    shard = tmp_path / "sparse-000000.tar"
    subprocess.run(["tar", "--sparse", "-cf", str(shard), "-C", str(src), "k0.bin", "k0.jpg", "k0.txt",
                    "k1.jpg", "k1.txt"], check=True)
    monkeypatch.setattr(values, "MAX_MEMBER_BYTES", 1 << 20)
    failures: list[UnitFailure] = []
    assert list(read_samples(str(shard), failures.append)) == []
    reason = (r"member k0.bin is a sparse file of 3,145,728 bytes \([\d,]+ stored\), over the 1,048,576-byte "
              r"limit of a copy; the rest of the shard was not read")
    assert len(failures) == 1 and re.fullmatch(reason, failures[0].reason)
    pairs = list(Dataset(DatasetSpec("webdataset", [str(shard)])).read(str(shard)))
    assert [(p.key, p.right, p.error) for p in pairs] == [("k0", "a photo", None), ("k1", "another photo", None)]

    listed: list[UnitFailure] = []
    assert list(list_samples(str(shard), listed.append)) != [] and listed == []  # counts and keys list it
    assert list(list_samples(str(shard), listed.append, copy=True)) == [] and listed == failures

    scores = tmp_path / "scores.parquet"
    main(["score", str(shard), "--out", str(scores), *TINY])
    for dry in ([], ["--dry-run"]):  # the dry run foretells the run
        code, out, err = run_cli(["filter", str(scores), "--where", "sim > -2", "--out", str(tmp_path / "kept"),
                                  *dry], capsys)
        assert code == 2 and "Traceback" not in err
        assert re.search(f"cannot copy {shard}, read 0 of its 2 scored samples: {reason}", " ".join(err.split()))
        assert not (tmp_path / "kept").exists()


def test_raw_samples_are_the_members_as_stored_and_listing_their_sizes(tmp_path, jpeg):
    shard = str(hostile_shards(tmp_path, jpeg)["mixed-case-suffixes"])
    raw = list(read_samples(shard, raise_failure))
    assert [s.members for s in raw] == [{"JPG": jpeg, "txt": b"one"}, {"jpg": jpeg, "TXT": b"two"},
                                        {"Jpg": jpeg, "json.GZ": b"\x1f\x8b"}, {"json.gz": b"\x1f\x8b"}]
    listed = list(list_samples(shard, raise_failure))
    assert [s.members for s in listed] == [{k: len(v) for k, v in s.members.items()} for s in raw]


def test_error_policy_records_or_raises_after_the_rows_before_the_break(tmp_path, jpeg):
    shard = str(hostile_shards(tmp_path, jpeg)["cut-in-the-third-jpg"])
    failures: list[UnitFailure] = []
    assert [s.key for s in read_samples(shard, failures.append)] == ["k0", "k1"]
    assert len(failures) == 1 and failures[0].unit == shard and "truncated tar" in failures[0].reason
    seen = []
    with pytest.raises(UserError, match=r"cannot read .*cut-in-the-third-jpg.tar: truncated tar"):
        for sample in list_samples(shard, raise_failure):
            seen.append(sample.key)
    assert seen == ["k0", "k1"]


def test_parquet_keys_are_the_keys_the_reader_gives(tmp_path, coco_parquet):
    import pyarrow.parquet as pq

    no_keys = tmp_path / "nokey.parquet"
    pq.write_table(pq.read_table(coco_parquet).drop_columns(["key"]), no_keys, row_group_size=5)
    for path in (str(coco_parquet), str(no_keys)):
        dataset = Dataset(DatasetSpec("parquet", [path]))
        read = [p.key for unit in dataset.units() for p in dataset.read(unit)]
        assert dataset.keys(path) == read and len(read) == 16
    assert Dataset(DatasetSpec("parquet", [str(no_keys)])).keys(str(no_keys))[:2] == ["nokey/0", "nokey/1"]


@pytest.mark.parametrize("text, unit", [
    ("shards/a-000.tar", Unit("shards/a-000.tar")),
    ("pipe:curl -s https://host/a.tar", Unit("pipe:curl -s https://host/a.tar")),
    ("/d/x.parquet#rg=12", Unit("/d/x.parquet", UnitKind.ROW_GROUP, 12)),
    ("/d/img_emb/left.npy#rows=0-262144", Unit("/d/img_emb/left.npy", UnitKind.ROWS, range(0, 262144))),
    ("/d/odd#rg=name.tar", Unit("/d/odd#rg=name.tar")),  # not a row-group suffix: a tar path
])
def test_unit_strings_round_trip(text, unit):
    assert Unit.parse(text) == unit and str(unit) == text
    assert unit_shard(text) == unit.path


def test_filter_cli_on_back_to_back_repeated_keys(tmp_path, coco_src, capsys):
    """Scored as 5 pairs (a, a, b, a, c): the filter must see the same 5 and copy the kept ones whole."""
    jpegs = [p.read_bytes() for p in sorted((coco_src / "val2017").glob("*.jpg"))[:5]]
    members = [("a.jpg", jpegs[0]), ("a.txt", b"a photo of one thing"), ("a.jpg", jpegs[1]), ("a.txt", b"another"),
               ("b.jpg", jpegs[2]), ("b.txt", b"a third photo"), ("a.jpg", jpegs[3]), ("a.txt", b"the key again"),
               ("c.jpg", jpegs[4]), ("c.txt", b"the last one")]
    shard = write_tar(tmp_path / "dups-000000.tar", members)
    scores = tmp_path / "scores.parquet"
    main(["score", str(shard), "--out", str(scores), *TINY])
    rule = "key = 'a' OR sim >= (SELECT max(sim) FROM scores WHERE key <> 'a')"  # the three `a` and b or c
    con = duckdb.connect()
    con.execute(f"CREATE VIEW scores AS SELECT * FROM read_parquet('{scores}')")
    assert con.execute("SELECT count(*) FROM scores").fetchone()[0] == 5
    expected = [i for (i,) in con.execute(f"SELECT \"index\" FROM scores WHERE {rule} ORDER BY \"index\"").fetchall()]
    assert {0, 1, 3} <= set(expected) and len(expected) == 4

    out = tmp_path / "kept"
    main(["filter", str(shard), "--scores", str(scores), "--where", rule, "--out", str(out)])
    assert f"wrote {len(expected)} pairs" in capsys.readouterr().out
    written = []
    for path in load_manifest(out / "manifest.yaml").shards:
        with tarfile.open(path) as tar:
            written += [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isreg()]
    assert written == [m for i in expected for m in members[2 * i:2 * i + 2]]  # byte-identical, in order

    dry = filter_dataset(open_dataset(str(shard)), scores, tmp_path / "dry", where=[rule], dry_run=True)
    assert dry.kept_pairs == 4 and dry.kept_bytes == sum(len(data) for _, data in written)
    assert dry.total_bytes == sum(len(data) for _, data in members) and not dry.read_failures
