"""Hostile inputs: each becomes an error row (or a failed-unit record) with a reason, the run goes
on, and the summary reconciles (pairs = scored + errors = rows in the output).

Everything is built for real: tar shards written member by member with `tarfile` (so they can be
truncated, corrupted or repeat keys), images encoded by PIL, a 50,000 x 50,000 PNG that is a
valid file, an unreadable Parquet file, a shard deleted while the run is going.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from helpers import exit_code as _cli

from pairclean.data.decode import DecodeError, decode_image
from pairclean.errors import UserError
from pairclean.scorefile.contract import run_manifest_path
from pairclean.data.dataset import Dataset, open_dataset
from pairclean.data.spec import DatasetSpec, Fields, UnitFailure
from pairclean.scoring.model import score
from pairclean.data.reading.values import MAX_TEXT_CHARS

BOMB_SIDE = 50_000


# -- builders -------------------------------------------------------------------------------

def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def noise_rgb(seed: int = 0, size=(80, 64)) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype("uint8"))


def png_bomb(side: int = BOMB_SIDE) -> bytes:
    """A valid 1-bit greyscale PNG of side x side pixels (2.5 billion for 50,000): ~0.3 MB on disk.

    The IDAT stream repeats one full-flushed deflate block of blank rows (byte-identical each time,
    since a full flush resets the compressor), so it is built in a fraction of a second."""
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte + packed pixels
    rows_per_block = 250
    block = row * rows_per_block
    piece = (c := zlib.compressobj(9, zlib.DEFLATED, -15)).compress(block) + c.flush(zlib.Z_FULL_FLUSH)
    n_blocks, rest = divmod(side, rows_per_block)
    tail = (c := zlib.compressobj(9, zlib.DEFLATED, -15)).compress(row * rest) + c.flush()
    adler = 1
    for _ in range(n_blocks):
        adler = zlib.adler32(block, adler)
    adler = zlib.adler32(row * rest, adler)
    idat = b"\x78\xda" + piece * n_blocks + tail + struct.pack(">I", adler)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def good_images() -> dict[str, tuple[str, bytes]]:
    """Images that must decode: (extension, bytes)."""
    rgb = noise_rgb()
    frames = [rgb, rgb.rotate(90), rgb.transpose(Image.Transpose.FLIP_LEFT_RIGHT)]
    anim = io.BytesIO()
    frames[0].save(anim, "WEBP", save_all=True, append_images=frames[1:], duration=100, lossless=True)
    grey16 = Image.fromarray((np.arange(64 * 80).reshape(64, 80) * 12).astype("uint16"))
    return {
        "rgba_png": ("png", encode(rgb.convert("RGBA"), "PNG")),
        "palette_png": ("png", encode(rgb.convert("P"), "PNG")),
        "palette_transparent_png": ("png", encode(rgb.convert("P"), "PNG", transparency=0)),
        "grey16_png": ("png", encode(grey16, "PNG")),
        "la_png": ("png", encode(rgb.convert("LA"), "PNG")),
        "cmyk_jpeg": ("jpg", encode(rgb.convert("CMYK"), "JPEG")),
        "animated_webp": ("webp", anim.getvalue()),
    }


def bad_images(jpeg: bytes) -> dict[str, tuple[str, bytes, str]]:
    """Images that must become error rows: (extension, bytes, expected reason fragment)."""
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n%%EndComments\nshowpage\n%%EOF\n"
    return {
        "truncated_jpeg": ("jpg", jpeg[: len(jpeg) // 2], "truncated"),
        "garbage_jpeg": ("jpg", b"\xff\xd8\xff\xe0" + bytes(range(256)) * 8, "unknown or corrupt image format"),
        "zero_byte": ("jpg", b"", "zero-byte image"),
        "bomb_png": ("png", png_bomb(), "decompression bomb refused"),
        "eps_as_jpg": ("jpg", eps, "unknown or corrupt image format"),  # never handed to Ghostscript
    }


@pytest.fixture(scope="module")
def jpeg(coco_src) -> bytes:
    return next((coco_src / "val2017").glob("*.jpg")).read_bytes()


# -- decoding -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(good_images()))
def test_every_pixel_format_decodes_to_rgb(name):
    ext, data = good_images()[name]
    img = decode_image(data)
    assert img.mode == "RGB" and img.size == (80, 64)


def test_alpha_is_flattened_onto_white_and_16_bit_is_scaled():
    clear = Image.new("RGBA", (8, 8), (10, 20, 30, 0))
    assert decode_image(encode(clear, "PNG")).getpixel((0, 0)) == (255, 255, 255)
    grey16 = Image.fromarray(np.full((4, 4), 51200, dtype="uint16"))
    assert decode_image(encode(grey16, "PNG")).getpixel((0, 0)) == (200, 200, 200)


def test_animation_yields_its_first_frame():
    first = Image.new("RGB", (16, 16), (200, 30, 30))
    later = Image.new("RGB", (16, 16), (30, 30, 200))
    anim = io.BytesIO()
    first.save(anim, "WEBP", save_all=True, append_images=[later], duration=100, lossless=True)
    assert decode_image(anim.getvalue()).getpixel((8, 8)) == (200, 30, 30)


def test_cmyk_jpeg_comes_out_in_rgb_colours():
    red = Image.new("RGB", (16, 16), (220, 20, 20))
    img = decode_image(encode(red.convert("CMYK"), "JPEG", quality=95), draft_size=8)  # draft: decoded at 8x8
    r, g, b = img.getpixel((img.width // 2, img.height // 2))
    assert r > 180 and g < 70 and b < 70


def test_bad_images_raise_decode_error_with_a_stable_reason(jpeg):
    for name, (ext, data, reason) in bad_images(jpeg).items():
        with pytest.raises(DecodeError) as info:
            decode_image(data, draft_size=224)
        assert reason in str(info.value), name
        assert " at 0x" not in str(info.value)  # no object addresses: reasons are equal across runs


def test_bomb_is_refused_from_the_header_without_allocating(tmp_path):
    """Decode the 50,000 x 50,000 PNG in a fresh interpreter and watch its peak memory: a decoder
    that allocated the pixels would need 2.5 GB."""
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_bomb())
    decode_py = Path(__file__).parent.parent / "pairclean" / "data" / "decode.py"
    code = f"""
import importlib.util, resource, json
spec = importlib.util.spec_from_file_location("decode", {str(decode_py)!r})
decode = importlib.util.module_from_spec(spec); spec.loader.exec_module(decode)
data = open({str(bomb)!r}, "rb").read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    decode.decode_image(data, draft_size=224)
    reason = None
except decode.DecodeError as exc:
    reason = str(exc)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"reason": reason, "grew_kb": after - before}}))
"""
    result = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout)
    assert result["reason"] and "decompression bomb refused" in result["reason"]
    assert "2500000000 pixels" in result["reason"]
    assert result["grew_kb"] < 32 * 1024, result


def test_a_sliver_image_is_resized_over_its_crop_without_gigabytes(tmp_path):
    """A 20,000 x 1 PNG (a few hundred bytes: a web page's rule line) resized to ViT-B-32's 224 on
    its short side is a 4,480,000 x 224 image before its centre is cut: 4 GB as PIL holds it and 6 s
    of a worker, more in every worker that meets one. The workers resize the crop's window only
    (`StandardTransform.resized_window`); measured in a fresh interpreter, as the bomb above."""
    for size in [(20_000, 1), (1, 2_000_000)]:  # wide; tall, whose every row a horizontal pass would resize
        sliver = tmp_path / "sliver.png"
        Image.new("RGB", size, (200, 30, 30)).save(sliver, format="PNG")
        code = f"""
import json, resource
from torchvision import transforms as T
from pairclean.backends.inputs import StandardTransform
from pairclean.data.decode import decode_image
transform = StandardTransform.parse(T.Compose([T.Resize(224, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(224),
                                               T.ToTensor(), T.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))]))
image = decode_image(open({str(sliver)!r}, "rb").read(), draft_size=224)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
pixels = transform.geometry_pixels(image)
sent = transform.device_sized(image)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"shape": list(pixels.shape), "colours": pixels.reshape(-1, 3).unique(dim=0).tolist(),
                  "sent": list(sent.size), "grew_kb": after - before}}))
"""
        result = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout)
        assert result["shape"] == [224, 224, 3] and result["colours"] == [[200, 30, 30]] and result["sent"] == [224, 224]
        assert result["grew_kb"] < 64 * 1024, (size, result)


# -- tar reading ----------------------------------------------------------------------------

def _read(path: Path) -> tuple[list, list[UnitFailure]]:
    items = list(Dataset(DatasetSpec("webdataset", [str(path)])).read(str(path)))
    return [i for i in items if not isinstance(i, UnitFailure)], [i for i in items if isinstance(i, UnitFailure)]


def _four_pairs(jpeg: bytes) -> list[tuple[str, bytes]]:
    return [(f"k{i}.{ext}", jpeg if ext == "jpg" else f"caption {i}".encode()) for i in range(4) for ext in ("jpg", "txt")]


def test_truncated_tar_keeps_the_rows_before_the_cut_and_reports_the_shard(tmp_path, jpeg):
    full = write_tar(tmp_path / "full.tar", _four_pairs(jpeg)).read_bytes()
    member = 512 + (len(jpeg) + 511) // 512 * 512  # header + padded data of one jpg member
    cuts = {
        "inside member data": (member // 2, 0, "inside member data"),
        "inside a header": (member + 200, 1, "inside a member header"),  # tarfile alone ends silently here
        "at a member boundary": (member + 1024, 1, "without an end-of-archive marker"),  # and here
    }
    for what, (cut, rows, reason) in cuts.items():
        path = tmp_path / "cut.tar"
        path.write_bytes(full[:cut])
        pairs, failures = _read(path)
        assert len(pairs) == rows, what
        assert len(failures) == 1 and reason in failures[0].reason and "truncated tar" in failures[0].reason, what
    pairs, failures = _read(tmp_path / "full.tar")
    assert len(pairs) == 4 and not failures


def test_end_of_archive_is_recognised_when_tarfile_parses_headers_privately(tmp_path, jpeg, monkeypatch):
    """Newer tarfiles (seen: Ubuntu's Python 3.12.3 build) parse headers through a private
    `_frombuf`, never calling `TarInfo.frombuf`: a hook on `frombuf` then saw no end-of-archive
    marker and reported every whole shard as truncated."""
    parse = tarfile.TarInfo.frombuf.__func__

    def private_fromtarfile(cls, archive):  # what those builds do, with frombuf out of the path
        buf = archive.fileobj.read(tarfile.BLOCKSIZE)
        info = parse(cls, buf, archive.encoding, archive.errors)
        info.offset = archive.fileobj.tell() - tarfile.BLOCKSIZE
        return info._proc_member(archive)

    def frombuf_unused(cls, *args):
        raise AssertionError("frombuf is not on this tarfile's path")

    monkeypatch.setattr(tarfile.TarInfo, "fromtarfile", classmethod(private_fromtarfile))
    monkeypatch.setattr(tarfile.TarInfo, "frombuf", classmethod(frombuf_unused))
    full = write_tar(tmp_path / "full.tar", _four_pairs(jpeg))
    pairs, failures = _read(full)
    assert len(pairs) == 4 and not failures
    member = 512 + (len(jpeg) + 511) // 512 * 512
    (tmp_path / "cut.tar").write_bytes(full.read_bytes()[:member + 1024])
    pairs, failures = _read(tmp_path / "cut.tar")
    assert len(pairs) == 1 and "without an end-of-archive marker" in failures[0].reason


def test_corrupt_member_header_is_reported_not_silently_ended(tmp_path, jpeg):
    data = bytearray(write_tar(tmp_path / "t.tar", _four_pairs(jpeg)).read_bytes())
    second_header = 512 + (len(jpeg) + 511) // 512 * 512
    data[second_header + 5] ^= 0xFF
    (tmp_path / "t.tar").write_bytes(bytes(data))
    pairs, failures = _read(tmp_path / "t.tar")
    assert [p.error for p in pairs] == ["missing caption"]
    assert "corrupt tar" in failures[0].reason


def test_repeated_keys_are_separate_pairs(tmp_path, jpeg):
    """webdataset's group_by_keys would drop the second of two back-to-back `a` samples."""
    members = [("a.jpg", jpeg), ("a.txt", b"one"), ("a.jpg", jpeg), ("a.txt", b"two"),
               ("b.jpg", jpeg), ("b.txt", b"three"), ("a.jpg", jpeg), ("a.txt", b"four")]
    pairs, failures = _read(write_tar(tmp_path / "d.tar", members))
    assert not failures
    assert [(p.key, p.index, p.right) for p in pairs] == [("a", 0, "one"), ("a", 1, "two"), ("b", 2, "three"),
                                                          ("a", 3, "four")]


def test_oversized_member_is_refused_unread(tmp_path, jpeg, monkeypatch):
    from pairclean.data.reading import values

    monkeypatch.setattr(values, "MAX_MEMBER_BYTES", 1000)
    pairs, failures = _read(write_tar(tmp_path / "o.tar", [("x.jpg", jpeg), ("x.txt", b"fine")]))
    assert not failures and "over the 1,000-byte limit" in pairs[0].error


def test_caption_hostility(tmp_path, jpeg):
    huge = b"word " * ((4 << 20) // 5 + 1)  # just over 4 MiB
    members = [("missing.jpg", jpeg), ("empty.jpg", jpeg), ("empty.txt", b"  \n\t "),
               ("latin1.jpg", jpeg), ("latin1.txt", "caf\xe9".encode("latin-1")),
               ("huge.jpg", jpeg), ("huge.txt", huge), ("noimage.txt", b"a caption without an image")]
    pairs, failures = _read(write_tar(tmp_path / "c.tar", members))
    got = {p.key: p for p in pairs}
    assert not failures
    assert got["missing"].error == "missing caption"
    assert got["empty"].error == "empty caption"
    assert got["latin1"].error == "caption is not valid UTF-8"
    assert got["huge"].error is None and len(got["huge"].right) == MAX_TEXT_CHARS and len(huge) >= 4 << 20
    assert got["noimage"].error.startswith("no image member")


# -- safe loading ---------------------------------------------------------------------------

def test_pipe_urls_need_an_explicit_flag(tmp_path, jpeg):
    shard = write_tar(tmp_path / "p.tar", [("k.jpg", jpeg), ("k.txt", b"cap")])
    url = f"pipe:cat {shard}"
    with pytest.raises(UserError, match="`allow_pipe`"):
        open_dataset(url)
    with pytest.raises(UserError, match="`allow_pipe`"):
        Dataset(DatasetSpec("webdataset", [url])).units()  # a spec built in Python is checked too
    dataset = open_dataset(url, allow_pipe=True)
    pairs = [p for p in dataset.read(dataset.units()[0]) if not isinstance(p, UnitFailure)]
    assert [(p.key, p.right) for p in pairs] == [("k", "cap")]


def test_failing_pipe_command_is_a_failed_unit(tmp_path):
    dataset = open_dataset(f"pipe:cat {tmp_path / 'nothing-here.tar'}", allow_pipe=True)
    items = list(dataset.read(dataset.spec.shards[0]))
    assert len(items) == 1 and isinstance(items[0], UnitFailure)


def test_score_cli_refuses_pipe_without_flag(tmp_path, capsys):
    code = _cli(["score", "pipe:cat x.tar", "--out", str(tmp_path / "s.parquet")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--allow-pipe" in err


def test_malicious_checkpoint_is_not_unpickled(tmp_path, capsys, coco_shards):
    """A pickle that runs code on load: torch.load(weights_only=True) refuses it."""
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    import pickle

    ckpt = tmp_path / "evil.pt"
    ckpt.write_bytes(pickle.dumps({"state_dict": Payload()}))
    code = _cli(["score", str(coco_shards), "--out", str(tmp_path / "s.parquet"), "--model", "pairclean-tiny",
                 "--pretrained", str(ckpt)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "cannot load pairclean-tiny" in err, err
    assert not marker.exists()


def test_no_torch_load_without_weights_only():
    """Every torch.load in the package passes weights_only=True (open_clip's own loader does too)."""
    package = Path(__file__).parent.parent / "pairclean"
    offenders = []
    for path in package.rglob("*.py"):
        text = path.read_text()
        start = 0
        while (i := text.find("torch.load(", start)) >= 0:
            depth, end = 0, i
            for end in range(i + len("torch.load"), len(text)):  # to the call's closing parenthesis
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                if depth == 0:
                    break
            call = text[i:end + 1]
            if "weights_only=True" not in call:
                offenders.append(f"{path.relative_to(package)}: {' '.join(call.split())}")
            start = end
    assert not offenders


# -- end to end -----------------------------------------------------------------------------

class DeletingEstimator:
    """The real estimator; deletes a shard when it first encodes, i.e. after the run listed its
    units and before that shard is read."""

    def __init__(self, inner, doomed: Path):
        self.inner, self.doomed = inner, doomed

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, modality, batch):
        if self.doomed.exists():
            self.doomed.unlink()
        return self.inner.encode(modality, batch)


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory, coco_src):
    """One scoring run over six hostile shards (workers=0 keeps shard order = read order)."""
    import torch

    from pairclean.backends import build_estimator
    from pairclean.scoring.model import ScoreConfig

    root = tmp_path_factory.mktemp("hostile")
    jpegs = sorted((coco_src / "val2017").glob("*.jpg"))
    jpeg = jpegs[0].read_bytes()
    shards = root / "shards"
    shards.mkdir()
    expect: dict[tuple[str, int], str | None] = {}  # (shard name, index) -> expected error fragment or None

    members = []
    for i in range(3):
        members += [(f"g{i}.jpg", jpegs[i].read_bytes()), (f"g{i}.txt", f"photo {i}".encode())]
    members += [("twin.jpg", jpeg), ("twin.txt", b"the same key in another shard")]
    write_tar(shards / "s0-good.tar", members)
    expect.update({("s0-good.tar", i): None for i in range(4)})

    members = []
    for i, (name, (ext, data)) in enumerate(sorted(good_images().items())):
        members += [(f"{name}.{ext}", data), (f"{name}.txt", name.encode())]
        expect[("s1-images.tar", i)] = None
    offset = len(good_images())
    for i, (name, (ext, data, reason)) in enumerate(sorted(bad_images(jpeg).items())):
        members += [(f"{name}.{ext}", data), (f"{name}.txt", name.encode())]
        expect[("s1-images.tar", offset + i)] = reason
    write_tar(shards / "s1-images.tar", members)

    huge = ("caption " * (1 << 19)).encode()  # 4 MB
    write_tar(shards / "s2-captions.tar", [
        ("missing.jpg", jpeg), ("empty.jpg", jpeg), ("empty.txt", b""), ("latin1.jpg", jpeg),
        ("latin1.txt", b"\xe9t\xe9"), ("huge.jpg", jpeg), ("huge.txt", huge), ("noimage.txt", b"no image")])
    expect.update({("s2-captions.tar", 0): "missing caption", ("s2-captions.tar", 1): "empty caption",
                   ("s2-captions.tar", 2): "not valid UTF-8", ("s2-captions.tar", 3): None,
                   ("s2-captions.tar", 4): "no image member"})

    write_tar(shards / "s3-dups.tar", [("a.jpg", jpeg), ("a.txt", b"1"), ("a.jpg", jpeg), ("a.txt", b"2"),
                                       ("b.jpg", jpeg), ("b.txt", b"3"), ("a.jpg", jpeg), ("a.txt", b"4"),
                                       ("twin.jpg", jpeg), ("twin.txt", b"5")])
    expect.update({("s3-dups.tar", i): None for i in range(5)})

    full = write_tar(root / "full.tar", _four_pairs(jpeg)).read_bytes()
    member = 512 + (len(jpeg) + 511) // 512 * 512
    third_jpg = 2 * (member + 1024)  # two jpg members and two 1 KiB txt members before it
    (shards / "s4-truncated.tar").write_bytes(full[: third_jpg + member // 2])
    expect.update({("s4-truncated.tar", i): None for i in range(2)})

    doomed = write_tar(shards / "s5-vanishing.tar", _four_pairs(jpeg)[:4])

    cfg = ScoreConfig(model="pairclean-tiny", pretrained="none", beta_k=32, batch_size=8, workers=0, seed=0)
    torch.manual_seed(cfg.seed)
    estimator = DeletingEstimator(build_estimator("open_clip", model=cfg.model, pretrained=cfg.pretrained,
                                                  device="cpu"), doomed)
    out = root / "scores.parquet"
    result = score(str(shards), out, cfg, estimator=estimator)
    return result, pq.read_table(out).to_pylist(), expect


def test_every_hostile_row_has_its_reason_and_the_run_finished(hostile_run):
    result, rows, expect = hostile_run
    got = {(Path(r["shard"]).name, r["index"]): r for r in rows}
    assert set(got) == set(expect)
    for where, reason in expect.items():
        row = got[where]
        if reason is None:
            assert row["error"] is None and row["sim"] is not None, (where, row["error"])
        else:
            assert row["sim"] is None and reason in row["error"], (where, row["error"])


def test_hostile_summary_reconciles(hostile_run):
    result, rows, expect = hostile_run
    s = result.summary
    errors = sum(r["error"] is not None for r in rows)
    assert s.pairs == len(rows) == s.scored + s.errors
    assert s.errors == errors == sum(v is not None for v in expect.values())
    failures = {Path(f.unit).name: f for f in s.unit_failures}
    assert set(failures) == {"s4-truncated.tar", "s5-vanishing.tar"}
    assert "truncated tar" in failures["s4-truncated.tar"].reason and failures["s4-truncated.tar"].rows == 2
    assert "not found" in failures["s5-vanishing.tar"].reason and failures["s5-vanishing.tar"].rows == 0
    assert json.loads(run_manifest_path(result.out).read_text())["summary"]["pairs"] == s.pairs


def test_duplicate_keys_within_and_across_shards_are_distinct_rows(hostile_run):
    _, rows, _ = hostile_run
    a_rows = [(Path(r["shard"]).name, r["index"]) for r in rows if r["key"] == "a"]
    assert a_rows == [("s3-dups.tar", 0), ("s3-dups.tar", 1), ("s3-dups.tar", 3)]
    assert sorted(Path(r["shard"]).name for r in rows if r["key"] == "twin") == ["s0-good.tar", "s3-dups.tar"]


def test_parquet_unreadable_file_and_escaping_paths(tmp_path, coco_src, fast_config):
    data = tmp_path / "data"
    (data / "img").mkdir(parents=True)
    jpegs = sorted((coco_src / "val2017").glob("*.jpg"))
    (data / "img" / "ok.jpg").write_bytes(jpegs[0].read_bytes())
    outside = tmp_path / "secret.jpg"
    outside.write_bytes(jpegs[1].read_bytes())
    (data / "img" / "link.jpg").symlink_to(outside)
    paths = ["img/ok.jpg", "../secret.jpg", str(outside), "img/link.jpg", "img/missing.jpg", None]
    pq.write_table(pa.table({"key": [f"r{i}" for i in range(len(paths))], "path": paths,
                             "caption": ["a photo"] * len(paths)}), data / "pairs.parquet")
    (data / "broken.parquet").write_bytes(b"PAR1 this is not a parquet file")
    spec = DatasetSpec("parquet", [str(data / "pairs.parquet"), str(data / "broken.parquet")],
                       fields=Fields(image_path="path"))
    result = score(spec, tmp_path / "s.parquet", fast_config)
    rows = pq.read_table(tmp_path / "s.parquet").to_pylist()
    errors = [r["error"] for r in rows]
    assert errors[0] is None
    assert all("escapes the dataset root" in e for e in errors[1:4])
    assert "cannot read image file" in errors[4] and errors[5] == "missing image path"
    s = result.summary
    assert s.pairs == 6 == s.scored + s.errors and s.errors == 5
    assert [Path(f.unit).name for f in s.unit_failures] == ["broken.parquet#rg=0"]
    assert "cannot read Parquet" in s.unit_failures[0].reason


# -- CLI hygiene ----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, expect", [
    (["score", "somewhere"], "Missing option"),
    (["score", "x", "--out", "y", "--no-such-flag"], "No such option"),
    (["score", "x", "--out", "y", "--batch-size", "many"], "--batch-size"),
    (["no-such-command"], "No such command"),
])
def test_usage_errors_are_one_line_exit_2(argv, expect, capsys):
    code = _cli(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expect in err, err


def test_crash_is_one_line_with_a_log_holding_the_traceback(tmp_path, capsys, monkeypatch, coco_shards):
    import pairclean.scoring.model as score_api

    def broken(*args, **kwargs):
        raise RuntimeError("disk controller on fire\nsecond line")

    monkeypatch.setenv("PAIRCLEAN_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(score_api, "score", broken)
    code = _cli(["score", str(coco_shards), "--out", str(tmp_path / "s.parquet")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and "disk controller on fire" in err
    log = Path(err.rsplit("traceback in ", 1)[1].rstrip(")"))
    assert log.parent == tmp_path / "logs" and "Traceback" in log.read_text() and "broken" in log.read_text()
