"""`pairclean audit`: a stratified sample on a self-contained page, marks made with the keyboard in
headless Chromium (Chrome DevTools Protocol), exported, imported as truth and evaluated."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pairclean.cli import main
from pairclean.curate.audit import import_marks
from pairclean.errors import UserError

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def audit_page(coco_shards, coco_scores, tmp_path) -> Path:
    out = tmp_path / "audit.html"
    main(["audit", str(coco_scores), "--shards", str(coco_shards), "--out", str(out), "--per-decile", "1"])
    return out


def _items(page: Path) -> list[dict]:
    text = page.read_text()
    start = text.index("const ITEMS = ") + len("const ITEMS = ")
    return json.loads(text[start:text.index(";\nconst STORE")])


def test_the_page_holds_one_pair_per_decile_with_its_picture_and_caption(audit_page):
    items = _items(audit_page)
    assert [it["decile"] for it in items] == list(range(1, 11))
    cards = re.findall(r'<article class="pair" hidden>\n<div class="pics"><img src="(data:image/[^"]+)" alt=""></div>'
                       r'<div class="texts"><p>([^<]+)</p><p class="where">similarity decile (\d+)', audit_page.read_text())
    assert [int(decile) for _, _, decile in cards] == list(range(1, 11))
    assert "http" not in audit_page.read_text().replace("http-equiv", "")  # self-contained: nothing fetched


def test_imported_marks_are_a_truth_file_evaluate_detection_accepts(audit_page, coco_scores, tmp_path, capsys):
    items = _items(audit_page)
    marks = [{**{k: it[k] for k in ("key", "shard", "index")}, "mark": "drop" if it["decile"] <= 3 else "keep"}
             for it in items]
    (tmp_path / "marks.json").write_text(json.dumps(marks))
    main(["audit-import", str(tmp_path / "marks.json"), "--out", str(tmp_path / "truth.parquet")])
    truth = pq.read_table(tmp_path / "truth.parquet").to_pylist()
    assert [t["noisy"] for t in truth] == [it["decile"] <= 3 for it in items]
    main(["evaluate", "detection", str(coco_scores), "--truth", str(tmp_path / "truth.parquet")])
    assert "noise detection: 10 pairs, 3 noisy" in capsys.readouterr().out


def test_a_file_that_is_not_an_export_is_one_line(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps([{"key": "a"}]))
    with pytest.raises(UserError, match="not an audit export"):
        import_marks(tmp_path / "bad.json", tmp_path / "t.parquet")


class DevTools:
    """Headless Chromium driven over the Chrome DevTools Protocol (websocket-client)."""

    def __init__(self, url: str, profile: Path, size: str = "1100,800"):
        websocket = pytest.importorskip("websocket")
        self.proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                                      "--disable-background-networking", "--no-first-run", f"--user-data-dir={profile}",
                                      "--remote-debugging-port=0", f"--window-size={size}", url],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        for _ in range(300):
            if port_file.is_file() and port_file.read_text().strip():
                break
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json").read())
        page = next(p for p in pages if p["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self.next_id = 0

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                return message.get("result", {})

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def key(self, key: str) -> None:
        """A key press as the page's keyboard handler receives it."""
        self.evaluate(f"document.dispatchEvent(new KeyboardEvent('keydown', {{key: {json.dumps(key)}}}))")

    def close(self) -> None:
        self.ws.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_marks_made_with_the_keyboard_in_chromium_round_trip(audit_page, coco_scores, tmp_path, capsys):
    browser = DevTools(audit_page.as_uri(), tmp_path / "profile")
    try:
        for _ in range(100):
            if browser.evaluate("typeof exportMarks === 'function' && document.readyState === 'complete'"):
                break
            time.sleep(0.1)
        browser.key("d")  # pair 1: drop, moves on
        browser.key("k")  # pair 2: keep
        browser.key("ArrowRight")  # pair 3 left unmarked
        browser.key("d")  # pair 4: drop
        browser.key("ArrowLeft")
        browser.key("ArrowLeft")  # back to pair 3
        browser.key("k")
        assert browser.evaluate("document.getElementById('progress').textContent") == "4 / 10 marked"
        exported = browser.evaluate("exportMarks()")
        shot = browser.call("Page.captureScreenshot", format="png")["data"]
    finally:
        browser.close()
    assert shot
    items = _items(audit_page)
    marks = json.loads(exported)
    assert [(m["key"], m["mark"]) for m in marks] == [(items[0]["key"], "drop"), (items[1]["key"], "keep"),
                                                       (items[2]["key"], "keep"), (items[3]["key"], "drop")]
    (tmp_path / "marks.json").write_text(exported)
    main(["audit-import", str(tmp_path / "marks.json"), "--out", str(tmp_path / "truth.parquet")])
    main(["evaluate", "detection", str(coco_scores), "--truth", str(tmp_path / "truth.parquet")])
    assert "noise detection: 4 pairs, 2 noisy" in capsys.readouterr().out


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_the_picture_is_drawn_as_large_as_the_window_allows(audit_page, tmp_path):
    """At 1400 x 1000 the picture of the pair shown fills the space the header, the texts column and
    the help line leave (it was drawn at about 240 px in a wide empty page)."""
    browser = DevTools(audit_page.as_uri(), tmp_path / "profile", size="1400,1000")
    try:
        for _ in range(100):
            if browser.evaluate("typeof exportMarks === 'function' && document.readyState === 'complete'"):
                break
            time.sleep(0.1)
        drawn = json.loads(browser.evaluate("""JSON.stringify((() => {
            const img = [...document.images].find(i => i.offsetParent !== null);
            const box = img.getBoundingClientRect(), scale = Math.min(box.width / img.naturalWidth,
                                                                     box.height / img.naturalHeight);
            return {window: [innerWidth, innerHeight], box: [box.width, box.height],
                    drawn: [img.naturalWidth * scale, img.naturalHeight * scale], shown: document.images.length -
                    [...document.images].filter(i => i.offsetParent === null).length};
        })())"""))
        shot = browser.call("Page.captureScreenshot", format="png")["data"]
    finally:
        browser.close()
    width, height = drawn["window"]
    assert drawn["shown"] == 1  # one pair at a time
    assert drawn["box"][0] >= 0.6 * width and drawn["box"][1] >= 0.6 * height
    # contain: the picture touches its box on one side, so it is as large as the box allows
    assert max(drawn["drawn"][0] / drawn["box"][0], drawn["drawn"][1] / drawn["box"][1]) == pytest.approx(1, abs=0.01)
    assert max(drawn["drawn"]) >= 600 and shot


def test_the_pair_kind_the_scores_were_made_with_is_what_the_page_shows(tmp_path, coco_src):
    """Text-text pairs cut from an image dataset, in a shard without a manifest: the page shows both
    texts the scores compared (and the sample's image as context), not an image and its first text."""
    import webdataset as wds

    from pairclean.scores.contract import METADATA_KEY, SCORES_SCHEMA

    images = sorted((coco_src / "val2017").glob("*.jpg"))[:3]
    shard = tmp_path / "tt-000000.tar"
    with wds.TarWriter(str(shard)) as sink:
        for i, img in enumerate(images):
            sink.write({"__key__": f"k{i}", "jpg": img.read_bytes(), "txt": f"first {i}", "txt2": f"second {i}"})
    provenance = {"pair": "text-text", "beta": 0.0, "input_shards": [str(shard)]}
    sims = [0.1, -0.3, 0.5]
    pq.write_table(pa.table({
        "key": ["k0", "k1", "k2"], "shard": [str(shard)] * 3, "index": [0, 1, 2], "sim": sims, "sim_debiased": sims,
        "weight": [0.1, 0.0, 0.5], "weight_norm": [0.2, 0.0, 1.0], "osa_noisy": [False, True, False],
        "p_clean": [None] * 3, "gmm_noisy": [None] * 3, "error": [None] * 3,
    }, schema=SCORES_SCHEMA.with_metadata({METADATA_KEY: json.dumps(provenance).encode()})), tmp_path / "s.parquet")
    main(["audit", str(tmp_path / "s.parquet"), "--shards", str(shard), "--out", str(tmp_path / "a.html"),
          "--per-decile", "1"])
    cards = re.findall(r'<article class="pair" hidden>\n<div class="pics"><img src="data:image/jpeg[^"]+" alt=""></div>'
                       r'<div class="texts">((?:<p>[^<]*</p>)+)', (tmp_path / "a.html").read_text())
    assert cards == ["<p>first 1</p><p>second 1</p>", "<p>first 0</p><p>second 0</p>", "<p>first 2</p><p>second 2</p>"]
