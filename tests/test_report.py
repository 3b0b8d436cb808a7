"""`pairclean report` on real COCO shards scored by the tiny model: self-contained HTML, the gallery
is the query's lowest pairs with their real thumbnails and captions, the plotted GMM boundary
is where the rows flip, and (when chromium is installed) the page renders with every image loaded."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path
from xml.etree import ElementTree

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from PIL import Image

from pairclean.cli import main
from pairclean.scorefile.contract import METADATA_KEY, SCORES_SCHEMA, read_provenance
from pairclean.scorefile.db import ScoresDB
from pairclean.curate.report import build_report
from pairclean.curate.report.figures import gmm_boundaries
from pairclean.curate.report.stats import histogram as _histogram

GALLERY, CONTRAST, THUMB = 6, 4, 160
CHROMIUM = shutil.which("chromium")


class Page(HTMLParser):
    """Collects <img> sources/alts and every href/src, to check what the page refers to."""

    def __init__(self, text: str):
        super().__init__()
        self.images: list[dict] = []
        self.refs: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.images.append(a)
        self.refs += [a[k] for k in ("src", "href") if a.get(k)]


@pytest.fixture(scope="module")
def report(tmp_path_factory, coco_shards, coco_scores, truth) -> Path:
    out = tmp_path_factory.mktemp("report") / "report.html"
    build_report(coco_scores, out, shards=[str(coco_shards)], truth=truth, gallery=GALLERY, contrast=CONTRAST,
                 thumb=THUMB)
    return out


def decode_data_uri(src: str) -> tuple[str, bytes]:
    head, payload = src.split(",", 1)
    assert head.endswith(";base64")
    return head[5:-7], base64.b64decode(payload)


def test_report_is_self_contained_with_the_querys_pairs(report, coco_scores, coco_shards):
    text = report.read_text()
    page = Page(text)
    assert all(ref.startswith("data:") for ref in page.refs)  # nothing outside the file

    figures = [i for i in page.images if i["src"].startswith("data:image/svg+xml")]
    thumbs = [i for i in page.images if i["src"].startswith("data:image/jpeg")]
    assert len(figures) == 2 and len(thumbs) == GALLERY + CONTRAST
    for fig in figures:
        assert ElementTree.fromstring(decode_data_uri(fig["src"])[1]).tag.endswith("svg")
    for thumb in thumbs:
        img = Image.open(io.BytesIO(decode_data_uri(thumb["src"])[1]))
        assert img.format == "JPEG" and max(img.size) == THUMB

    con = duckdb.connect()
    lowest = con.execute(f"SELECT key, shard, \"index\" FROM read_parquet('{coco_scores}') "
                         f"ORDER BY sim, shard, \"index\" LIMIT {GALLERY}").fetchall()
    highest = con.execute(f"SELECT key FROM read_parquet('{coco_scores}') "
                          f"ORDER BY sim DESC, shard, \"index\" LIMIT {CONTRAST}").fetchall()
    assert [t["alt"] for t in thumbs] == [k for k, _, _ in lowest] + [k for (k,) in highest]

    # Each card shows the caption stored in that very sample.
    captions = {s["__key__"]: s["txt"].decode() for s in
                wds.WebDataset(sorted(str(p) for p in coco_shards.glob("*.tar")), shardshuffle=False,
                               empty_check=False)}
    shown = re.findall(r'<p class="caption">(.*?)</p>', text)
    assert shown[:GALLERY] == [captions[k].replace("'", "&#x27;").replace('"', "&quot;") for k, _, _ in lowest]

    prov = read_provenance(coco_scores)
    assert "pairclean-tiny" in text and f"{prov.beta:.4f}" in text
    assert "Against the truth labels" in text and "truth: noisy" in text


def test_histogram_and_gmm_boundary_agree_with_the_rows(tmp_path):
    # embeddings with random-pairing noise, where the GMM decides (on coco_scores, a random model's, it abstains)
    from test_decisions import _embeddings

    noisy = _embeddings(tmp_path / "emb")
    truth = tmp_path / "truth.parquet"
    pq.write_table(pa.table({"key": [f"k{i}" for i in range(len(noisy))], "noisy": noisy}), truth)
    scores = tmp_path / "s.parquet"
    main(["score", str(tmp_path / "emb"), "--from-embeddings", "--out", str(scores), "--beta-mode", "fixed",
          "--beta", "0.1"])
    prov = read_provenance(scores)
    mixture = prov.gmm
    assert not next(r for r in prov.rules if r.name == "gmm").abstains
    with ScoresDB(scores, truth=truth) as db:
        rows = db.con.execute("SELECT sim, gmm_noisy, noisy FROM labeled").fetchall()
        sims = np.array([r[0] for r in rows])
        edges, counts = _histogram(db, "labeled", float(sims.min()), float(sims.max()), 10, split=True)
    assert counts["noisy"].sum() == sum(r[2] for r in rows) and counts["clean"].sum() == sum(not r[2] for r in rows)
    assert (counts["noisy"] + counts["clean"]).tolist() == np.histogram(sims, edges)[0].tolist()

    lo, hi = float(sims.min()) - 0.5, float(sims.max()) + 0.5
    boundaries = gmm_boundaries(mixture, lo, hi)
    assert boundaries and mixture.p_clean(boundaries) == pytest.approx(0.5, abs=1e-3)
    # The plotted lines cut the axis into regions of one GMM verdict each: every row's
    # gmm_noisy flag is the verdict of the region its similarity falls in.
    cuts = [lo, *boundaries, hi]
    verdict = [mixture.p_clean([(a + b) / 2])[0] < 0.5 for a, b in zip(cuts, cuts[1:])]
    for sim, gmm_noisy, _ in rows:
        assert gmm_noisy == verdict[int(np.searchsorted(boundaries, sim))]


def test_text_pairs_show_the_samples_image_as_context(tmp_path, coco_src):
    """A text-text dataset cut from an image dataset: the card shows both texts and the jpg member;
    texts are escaped, and rows that could not be scored get their own section."""
    images = sorted((coco_src / "val2017").glob("*.jpg"))[:4]
    shard = tmp_path / "tt-000000.tar"
    with wds.TarWriter(str(shard)) as sink:
        for i, img in enumerate(images):
            sink.write({"__key__": f"k{i}", "jpg": img.read_bytes(), "txt": f"first <b>{i}</b> & co",
                        "txt2": f"second {i}"})
    sims = [0.1, -0.3, 0.5, None]
    provenance = {"pair": "text-text", "beta": 0.0, "beta_std": 0.01, "beta_mode": "fixed",
                  "gmm": None, "estimator": {"backend": "sentence-transformers", "model": "all-MiniLM-L6-v2"},
                  "input_shards": [str(shard)]}
    schema = SCORES_SCHEMA.with_metadata({METADATA_KEY: json.dumps(provenance).encode()})
    scores = tmp_path / "scores.parquet"
    pq.write_table(pa.table({
        "key": ["k0", "k1", "k2", "k3"], "shard": [str(shard)] * 4, "index": [0, 1, 2, 3], "sim": sims,
        "sim_debiased": sims, "weight": [0.1, 0.0, 0.5, 0.0], "weight_norm": [0.2, 0.0, 1.0, 0.0],
        "osa_noisy": [False, True, False, None], "p_clean": [None] * 4, "gmm_noisy": [None] * 4,
        "error": [None, None, None, "empty second text"],
    }, schema=schema), scores)
    out = tmp_path / "r.html"
    result = build_report(scores, out, gallery=2, contrast=1, thumb=64)  # shards from the provenance
    assert result.thumbnails == 3 and result.media_note is None
    text = out.read_text()
    assert re.findall(r'<p class="caption">(.*?)</p>', text) == [
        "first &lt;b&gt;1&lt;/b&gt; &amp; co", "second 1", "first &lt;b&gt;0&lt;/b&gt; &amp; co", "second 0",
        "first &lt;b&gt;2&lt;/b&gt; &amp; co", "second 2"]
    assert "Pairs that could not be scored" in text and "<td>empty second text</td><td>1</td><td>k3</td>" in text


def test_missing_shards_are_noted_not_fatal(tmp_path, coco_scores, capsys):
    table = pq.read_table(coco_scores)
    prov = read_provenance(coco_scores)
    prov = replace(prov, input_shards=["/nonexistent/coco-mini-000000.tar"],  # the recorded dataset moved away
                   dataset=replace(prov.dataset, sources=["/nonexistent/coco-mini-000000.tar"]))
    moved = tmp_path / "scores.parquet"
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: prov.dumps().encode()}), moved)
    main(["report", str(moved), "--out", str(tmp_path / "r.html"), "--gallery", "3", "--contrast", "0"])
    out = capsys.readouterr().out
    assert "pass --shards to see the pairs" in out and "0 thumbnails" in out
    assert len(Page((tmp_path / "r.html").read_text()).images) == 2  # the figures only


def test_scores_without_provenance_is_a_one_line_error(tmp_path, coco_scores, capsys):
    plain = tmp_path / "plain.parquet"
    pq.write_table(pq.read_table(coco_scores).replace_schema_metadata(None), plain)
    with pytest.raises(SystemExit) as exc:
        main(["report", str(plain), "--out", str(tmp_path / "r.html")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1 and "no pairclean provenance" in err
    assert not (tmp_path / "r.html").exists()


def chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_chromium_renders_every_image(tmp_path, report):
    images = len(Page(report.read_text()).images)
    shot = tmp_path / "report.png"
    run = chromium(["--dump-dom", f"--screenshot={shot}", "--window-size=1280,2400", report.as_uri()],
                   tmp_path / "profile")
    assert f'data-images-loaded="{images}/{images}"' in run.stdout
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.float32)
    assert pixels.shape == (2400, 1280, 3)
    # The lower half holds the gallery photos: far from a blank page's few flat colours.
    assert len(np.unique(pixels[1200:].reshape(-1, 3), axis=0)) > 5000

    # The check can fail: one corrupted thumbnail is reported as not loaded.
    broken = tmp_path / "broken.html"
    text = report.read_text()
    start = text.index("data:image/jpeg;base64,") + len("data:image/jpeg;base64,")
    broken.write_text(text[:start] + "AAAA" + text[start + 40:])
    run = chromium(["--dump-dom", broken.as_uri()], tmp_path / "profile2")
    assert f'data-images-loaded="{images - 1}/{images}"' in run.stdout
