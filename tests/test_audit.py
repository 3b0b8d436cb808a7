"""`pairclean audit`: a stratified sample on a self-contained page, marks made with the keyboard in
headless Chromium (Chrome DevTools Protocol), exported, imported as truth and evaluated; the blind
audit (random pairs within sim strata, random order, no scores shown) and its estimates for the
whole dataset with 95% intervals (`scores/stratified.py`), whose coverage is checked here."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import run_cli

from pairclean.cli import main
from pairclean.curate.audit import import_marks
from pairclean.errors import UserError
from pairclean.core.null import wilson
from pairclean.scorefile.stratified import (AuditFigures, Cell, JudgeError, audit_design, audit_figures,
                                         stratified_share)

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


def _design(page: Path) -> dict | None:
    return json.loads(re.search(r"const DESIGN = (.*);  //", page.read_text()).group(1))


@pytest.fixture
def blind_page(coco_shards, coco_scores, tmp_path) -> Path:
    out = tmp_path / "blind.html"
    code = main(["audit", str(coco_scores), "--shards", str(coco_shards), "--out", str(out), "--blind", "--pairs", "8",
                 "--strata", "4"])
    assert code in (0, None)
    return out


def _blind_marks(page: Path, truth: Path, out: Path, keep_only=None) -> Path:
    """The export a judge who knows the truth makes of the blind page (as the benchmark's script)."""
    noisy = {(r["shard"], r["index"]): r["noisy"] for r in pq.read_table(truth).to_pylist()}
    marks = [{**it, "mark": "drop" if noisy[(it["shard"], it["index"])] else "keep"} for it in _items(page)]
    out.write_text(json.dumps({"audit": "blind", "design": _design(page), "marks": marks[:keep_only]}))
    return out


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
    main(["evaluate", "detection", str(coco_scores), "--truth", str(tmp_path / "truth.parquet"), "--json",
          str(tmp_path / "detection.json")])
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
    main(["evaluate", "detection", str(coco_scores), "--truth", str(tmp_path / "truth.parquet"), "--json",
          str(tmp_path / "detection.json")])
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

    from pairclean.scorefile.contract import METADATA_KEY, SCORES_SCHEMA

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


def test_the_blind_page_shows_no_score_in_random_order_and_records_its_strata(blind_page, coco_scores):
    """The decile page shows each pair's similarity and decile, lowest first: the judge sees the
    model's verdict. The blind page: 2 pairs drawn from each of 4 sim strata of 4 pairs, in an
    order that is not the strata's, with nothing of the scores on it but the strata in its script."""
    text = blind_page.read_text()
    cards = text[text.index("<article"):text.index('<p class="help">')]  # what the judge sees of the pairs
    assert "similarity" not in cards and "sim " not in cards and "decile" not in cards
    items, design = _items(blind_page), _design(blind_page)
    assert all(set(it) == {"key", "shard", "index", "stratum", "look"} for it in items) and len(items) == 8 + 2
    assert [it["stratum"] for it in items] != sorted(it["stratum"] for it in items)
    assert [(s["stratum"], s["pairs"], s["drawn"]) for s in design["strata"]] == [(h, 4, 2) for h in (1, 2, 3, 4)]
    assert design["scored_pairs"] == 16 and design["scores"] == coco_scores.name
    # 20% of the pairs shown twice, unannounced: the second look after the first, somewhere else, nothing on its card
    # (no key, no shard) telling it from another pair
    twice = [(it["shard"], it["index"]) for it in items if it["look"] == 2]
    assert design["repeated"] == len(twice) == 2 and len(set(twice)) == 2
    for pair in twice:
        looks = [i for i, it in enumerate(items) if (it["shard"], it["index"]) == pair]
        assert len(looks) == 2 and items[looks[0]]["look"] == 1
    assert "class=\"where\"" not in cards
    sims = {(r["shard"], r["index"]): r["sim"] for r in pq.read_table(coco_scores).to_pylist()}
    for it in items:  # each drawn pair lies in its stratum's sim range
        stratum = design["strata"][it["stratum"] - 1]
        sim = sims[(it["shard"], it["index"])]
        assert (stratum["sim_above"] is None or sim > stratum["sim_above"]) and \
            (stratum["sim_at_most"] is None or sim <= stratum["sim_at_most"])
    again = blind_page.with_name("again.html")
    main(["audit", str(coco_scores), "--out", str(again), "--blind", "--pairs", "8", "--strata", "4"])
    assert _items(again) == items  # the same command draws the same pairs in the same order


def test_blind_marks_carry_their_strata_into_the_estimates_for_the_whole_dataset(blind_page, coco_scores, truth,
                                                                                 tmp_path, capsys):
    marks = _blind_marks(blind_page, truth, tmp_path / "marks.json")
    code, out, err = run_cli(["audit-import", marks, "--out", tmp_path / "audit-truth.parquet"], capsys)
    assert code == 0 and "8 marks" in out and "a blind audit: 4 strata of 16 scored pairs" in out, err
    assert "judge: 2 pairs marked on both looks, 0 differently (agreement 100.0%)" in out
    table = pq.read_table(tmp_path / "audit-truth.parquet")
    assert table.column_names == ["key", "shard", "index", "noisy", "stratum", "noisy_again"]
    assert sum(v is not None for v in table.column("noisy_again").to_pylist()) == 2
    assert audit_design(tmp_path / "audit-truth.parquet").to_json() == _design(blind_page)
    code, out, err = run_cli(["evaluate", "detection", coco_scores, "--truth", tmp_path / "audit-truth.parquet",
                              "--json", tmp_path / "d.json"], capsys)
    assert code == 0, err
    assert "blind audit: 8 marked pairs weighted to all 16 scored pairs (4 sim strata)" in out
    assert "noise share of the scored pairs, %" in out and "on the 8 marked pairs alone (unweighted)" in out
    assert "judge: 2 pairs marked on both looks" in out and "not errors the judge makes alike on both looks" in out
    audit = json.loads((tmp_path / "d.json").read_text())["audit"]
    rows = {(r["shard"], r["index"]): r for r in pq.read_table(truth).to_pylist()}
    marked = table.to_pylist()
    population = {s["stratum"]: s["pairs"] for s in audit["design"]["strata"]}
    noisy = [rows[(m["shard"], m["index"])]["noisy"] for m in marked]
    expected = audit_figures(np.array([m["stratum"] for m in marked]), np.array(noisy),
                             [m["noisy_again"] for m in marked], {}, population, {})
    assert audit["noise_share"] == expected.noise_share.as_dict() and audit["judge"] == expected.judge.as_dict()
    assert audit["unmarked_strata"] == []
    assert set(audit["rules"]) == {"beta", "gmm"}
    for rule in audit["rules"].values():
        for what in ("precision", "recall", "noise_left"):
            e = rule[what]
            assert e["value"] is None or 0 <= e["low"] <= e["value"] <= e["high"] <= 1


def test_a_blind_audit_is_refused_against_another_scores_file(blind_page, coco_scores, truth, tmp_path, capsys):
    import duckdb

    _blind_marks(blind_page, truth, tmp_path / "marks.json")
    import_marks(tmp_path / "marks.json", tmp_path / "t.parquet")
    fewer = tmp_path / "fewer.parquet"
    duckdb.execute(f"COPY (SELECT * FROM '{coco_scores}' WHERE \"index\" > 0) TO '{fewer}' (FORMAT parquet)")
    import pyarrow.parquet as parquet

    metadata = parquet.read_schema(coco_scores).metadata
    parquet.write_table(parquet.read_table(fewer).replace_schema_metadata(metadata), fewer)
    code, _, err = run_cli(["evaluate", "detection", fewer, "--truth", tmp_path / "t.parquet"], capsys)
    assert code == 2 and "the audit was drawn from 16 scored pairs" in err and "holds 13" in err


def _scores_changed(coco_scores: Path, out: Path, select: str) -> Path:
    """A copy of the scores file with its rows as `select` (over the view s) makes them, its metadata kept."""
    import duckdb

    source = f"'{coco_scores}'"
    duckdb.execute(f"COPY ({select.format(s=source)}) TO '{out}' (FORMAT parquet)")
    pq.write_table(pq.read_table(out).replace_schema_metadata(pq.read_schema(coco_scores).metadata), out)
    return out


def test_strata_moved_in_the_scores_file_are_refused(blind_page, coco_scores, truth, tmp_path, capsys):
    """Issue 55: the design was never recounted in the scores file: sims moved across a stratum's
    bounds (a file scored again) weighted the marks by strata that no longer hold those pairs."""
    _blind_marks(blind_page, truth, tmp_path / "marks.json")
    import_marks(tmp_path / "marks.json", tmp_path / "t.parquet")
    marked = {(r["shard"], r["index"]) for r in pq.read_table(tmp_path / "t.parquet").to_pylist()}
    design = _design(blind_page)
    top = design["strata"][-1]["sim_above"]
    lowest = min((r for r in pq.read_table(coco_scores).to_pylist() if (r["shard"], r["index"]) not in marked),
                 key=lambda r: r["sim"])  # an unmarked pair of stratum 1, moved to the top stratum
    moved = _scores_changed(coco_scores, tmp_path / "moved.parquet",
                            f"SELECT * REPLACE (CASE WHEN shard = '{lowest['shard']}' AND \"index\" = {lowest['index']} "
                            f"THEN {top + 0.5} ELSE sim END AS sim) FROM {{s}}")
    code, _, err = run_cli(["evaluate", "detection", moved, "--truth", tmp_path / "t.parquet", "--json",
                            tmp_path / "d.json"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "stratum 1 of the audit" in err and "holds 3 scored pairs" in err and "the sims moved" in err
    assert not (tmp_path / "d.json").exists()


def test_a_marked_pair_is_matched_by_its_key_too(blind_page, coco_scores, truth, tmp_path, capsys):
    """Issue 55: marks were matched by (shard, index) only: a shard changed and scored again had its
    marks counted against the pairs now at those places."""
    _blind_marks(blind_page, truth, tmp_path / "marks.json")
    import_marks(tmp_path / "marks.json", tmp_path / "t.parquet")
    first = pq.read_table(tmp_path / "t.parquet").to_pylist()[0]
    changed = _scores_changed(coco_scores, tmp_path / "changed.parquet",
                              f"SELECT * REPLACE (CASE WHEN shard = '{first['shard']}' AND \"index\" = {first['index']} "
                              "THEN 'another-pair' ELSE key END AS key) FROM {s}")
    code, _, err = run_cli(["evaluate", "detection", changed, "--truth", tmp_path / "t.parquet", "--json",
                            tmp_path / "d.json"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"as the pair '{first['key']}', which" in err and "holds as 'another-pair'" in err
    assert not (tmp_path / "d.json").exists()


@pytest.mark.parametrize("change, message", [
    (lambda e: e["design"].update(version=9), "blind audit design (version: must be 1, got 9)"),
    (lambda e: e.update(design=[]), "blind audit design (must be an object, got a list [])"),
    (lambda e: e["design"]["strata"][0].update(pairs=0), "(strata[0].pairs: must be an integer from 1 to"),
    (lambda e: e["design"]["strata"][1].update(drawn=9), "(strata[1].drawn: must be from 0 to the stratum's pairs (4), got 9)"),
    (lambda e: e["design"]["strata"][1].update(stratum=1), "(strata[1].stratum: must be 2"),
    (lambda e: e["design"]["strata"][1].update(sim_above="0.2"), "(strata[1].sim_above: must be a number, got a string"),
    (lambda e: e["design"]["strata"][1].update(pairs=True), "(strata[1].pairs: must be an integer, got a boolean true)"),
    (lambda e: e["design"].update(seed=-1), "(seed: must be an integer from 0 to"),
    (lambda e: e["design"].update(extra=1), "(extra: unknown field)"),
    (lambda e: e["design"].update(scored_pairs=17), "the strata hold 16 pairs, not the 17 scored"),
    (lambda e: e["marks"][0].update(stratum=5), "entry 0: stratum must be one of the design's 1..4, got 5"),
    (lambda e: e["marks"][0].update(stratum=True), "entry 0: stratum must be one of the design's 1..4, got true"),
    (lambda e: e["marks"].extend([dict(e["marks"][0], index=100 + i, look=1) for i in range(3)]),
     "more marks in stratum"),
    (lambda e: e["marks"][0].update(look=3), "entry 0: look must be 1 or 2 (the second look at a pair shown twice), got 3"),
    (lambda e: e["marks"][0].update(look=True), "entry 0: look must be 1 or 2"),
    (lambda e: e["marks"].append(dict(e["marks"][0])), "twice on look"),
    # issue 55: ranges that overlap or leave sims out, refused with one line where the design is read
    (lambda e: e["design"]["strata"][2].update(sim_above=e["design"]["strata"][0]["sim_at_most"]),
     "(strata[2].sim_above: must be"),
    (lambda e: e["design"]["strata"][0].update(sim_above=-2.0), "(strata[0].sim_above: must be None"),
    (lambda e: e["design"].update(repeated=99), "(repeated: must be from 0 to the pairs drawn, got 99)"),
])
def test_a_blind_export_is_typed_strictly(blind_page, truth, tmp_path, change, message):
    entries = json.loads(_blind_marks(blind_page, truth, tmp_path / "marks.json").read_text())
    change(entries)
    (tmp_path / "bad.json").write_text(json.dumps(entries))
    with pytest.raises(UserError, match=re.escape(message)):
        import_marks(tmp_path / "bad.json", tmp_path / "t.parquet")
    assert not (tmp_path / "t.parquet").exists()


def test_the_stratified_share_by_hand():
    """Two strata of 100 and 300 pairs, 4 and 6 marked: the estimate and the variance written out,
    each stratum's variance at least that of Jeffreys' centre (k + 1/2) / (m + 1)."""
    cells = [Cell(100, 4, 3), Cell(300, 6, 1)]
    share = stratified_share(cells)
    assert share.value == pytest.approx((100 * 0.75 + 300 / 6) / 400)
    v1 = max(0.75 * 0.25 * 4 / 3, (3.5 / 5) * (1.5 / 5))
    v2 = max((1 / 6) * (5 / 6) * 6 / 5, (1.5 / 7) * (5.5 / 7))
    variance = (0.25 ** 2 * (1 - 4 / 100) * v1 / 4 + 0.75 ** 2 * (1 - 6 / 300) * v2 / 6)
    centre = 0.25 * 3.5 / 5 + 0.75 * 1.5 / 7
    assert (share.low, share.high) == pytest.approx(wilson(share.value, centre * (1 - centre) / variance))


def test_one_mark_or_a_pure_sample_adds_variance_and_no_interval_is_of_zero_width():
    """Issue 55: every stratum's sample pure gave a variance of float round-off (~1e-33) and an
    interval of zero width (noise share 50.03 [50.03, 50.03]); a stratum of one mark added none,
    and the effective n ran past the dataset (6,652 for 1,951 pairs)."""
    pure = stratified_share([Cell(975, 200, 200), Cell(976, 200, 0)])  # each stratum's sample pure
    assert pure.value == pytest.approx(975 / 1951) and pure.high - pure.low > 0.02
    one = stratified_share([Cell(1000, 1, 1), Cell(1000, 99, 50)])
    alone = stratified_share([Cell(1000, 99, 50)])
    assert one.high - one.low > alone.high - alone.low + 0.05  # the one-mark stratum counts for its uncertainty
    stratum = np.repeat([1, 2], 200)
    figures = audit_figures(stratum, stratum == 1, [None] * 400, {}, {1: 975, 2: 976}, {})
    e = figures.noise_share
    assert e.high > e.low and e.effective_n <= 1951 and e.low < 975 / 1951 < e.high
    census = audit_figures(stratum, stratum == 1, [None] * 400, {}, {1: 200, 2: 200}, {}).noise_share
    assert census.value == 0.5 and census.effective_n == 400 and census.high > census.low  # never past N


def test_an_unmarked_stratum_is_named(blind_page, coco_scores, truth, tmp_path, capsys):
    """Issue 55: 3 marks from 1 stratum of 4 were reported as the noise share of all 48 pairs."""
    entries = json.loads(_blind_marks(blind_page, truth, tmp_path / "marks.json").read_text())
    entries["marks"] = [m for m in entries["marks"] if m["stratum"] == 2]
    (tmp_path / "marks.json").write_text(json.dumps(entries))
    import_marks(tmp_path / "marks.json", tmp_path / "t.parquet")
    code, out, err = run_cli(["evaluate", "detection", coco_scores, "--truth", tmp_path / "t.parquet", "--json",
                              tmp_path / "d.json"], capsys)
    assert code == 0, err
    assert "no mark in stratum 1, 3, 4 (12 pairs: their noise is unknown" in out
    assert json.loads((tmp_path / "d.json").read_text())["audit"]["unmarked_strata"] == [1, 3, 4]


def _judged(population: np.ndarray, strata: np.ndarray, rules: dict, marks: int, flip: float, repeat: float,
            rng) -> tuple[dict, AuditFigures]:
    """One simulated blind audit: `marks` pairs drawn evenly over the strata, a `repeat` share shown
    twice, every mark (both looks) flipped with probability `flip`."""
    numbers = sorted(set(strata.tolist()))
    drawn = np.concatenate([rng.choice(np.flatnonzero(strata == h), marks // len(numbers), replace=False)
                            for h in numbers])
    seen = population[drawn] ^ (rng.random(len(drawn)) < flip)
    again = [None] * len(drawn)
    for i in rng.choice(len(drawn), round(repeat * len(drawn)), replace=False):
        again[i] = bool(population[drawn[i]] ^ (rng.random() < flip))
    pairs = {h: int((strata == h).sum()) for h in numbers}
    flagged = {name: {h: int((f & (strata == h)).sum()) for h in numbers} for name, f in rules.items()}
    return drawn, audit_figures(strata[drawn], seen, again, {n: f[drawn] for n, f in rules.items()}, pairs, flagged)


@pytest.mark.parametrize("flip", [0.0, 0.05], ids=["perfect judge", "a judge who errs 5%"])
def test_the_intervals_cover_the_truth_for_a_perfect_and_an_erring_judge(flip):
    """A population shaped like the demo's (2,000 pairs, 50% noise at low sim, a rule with 98.6%
    precision, one with 100%): over 200 simulated audits of 100 and of 400 pairs, 20% of them shown
    twice, the noise share's and both rules' precision and recall intervals cover the true values
    at least 90% of the time, for a perfect judge and for one who flips 5% of the marks (before:
    0/20 at 400 marks for several figures), and none has zero width."""
    rng = np.random.default_rng(7)
    n_pop = 2000
    noisy = np.arange(n_pop) < n_pop // 2
    sim = np.where(noisy, rng.normal(0.1, 0.35, n_pop), rng.normal(0.85, 0.03, n_pop))
    rules = {"gmm": sim < np.quantile(sim, 0.497), "beta": sim < np.quantile(sim, 0.37)}
    order = np.argsort(sim, kind="stable")
    strata = np.empty(n_pop, dtype=int)
    strata[order] = np.arange(n_pop) * 10 // n_pop + 1
    truth = {("noise", None): noisy.mean()}
    for name, f in rules.items():
        truth[(name, "precision")], truth[(name, "recall")] = noisy[f].mean(), f[noisy].mean()
    for marks in (100, 400):
        covered = dict.fromkeys(truth, 0)
        for _ in range(200):
            _, figures = _judged(noisy, strata, rules, marks, flip, 0.2, rng)
            for (name, what), value in truth.items():
                e = figures.noise_share if what is None else figures.rules[name][what]
                covered[(name, what)] += e.low <= value <= e.high
                assert e.high > e.low and e.effective_n <= n_pop
        assert min(covered.values()) >= 180, (marks, covered)


def test_the_judge_is_measured_by_the_pairs_shown_twice():
    """Two looks disagree with probability 2e(1 - e): 19 disagreements in 200 pairs is e = 5%;
    the estimates are corrected for it (a judge who errs pulls every share towards 1/2)."""
    judge = JudgeError(200, 19)
    value, low, high = judge.interval()
    assert value == pytest.approx(0.05, abs=0.001) and low < 0.05 < high
    assert judge.as_dict()["agreement"] == pytest.approx(181 / 200)
    assert JudgeError(0, 0).as_dict()["error_rate"] is None and list(JudgeError(0, 0).rates()) == [0.0]
    # 90% flagged pairs marked noisy by a judge at e = 5%: truly (0.9 - 0.05) / 0.9 = 94.4%
    from pairclean.scorefile.stratified import corrected

    assert corrected(0.9, 0.05) == pytest.approx(0.85 / 0.9) and corrected(0.02, 0.05) == 0.0


@pytest.mark.parametrize("design, message", [
    (b"{not json", "blind audit design (not JSON"),
    (b'{"version": 1, "seed": 0, "scores": "s", "scored_pairs": 16, "strata": [{"stratum": 1, "sim_above": NaN, '
     b'"sim_at_most": null, "pairs": 16, "drawn": 2}]}', "(strata[0].sim_above: must be a finite number, got nan)"),
    (b'{"version": 1, "seed": 0, "scores": "s", "scored_pairs": 16, "strata": []}', "(strata: must hold at least one"),
])
def test_a_truth_file_s_audit_design_is_read_back_strictly(blind_page, coco_scores, truth, tmp_path, capsys,
                                                             design, message):
    """The design travels in the truth Parquet's metadata, where anyone may edit it: evaluating
    against a tampered one is one line naming the file and the field, exit 2, nothing written."""
    from pairclean.scorefile.stratified import DESIGN_KEY

    _blind_marks(blind_page, truth, tmp_path / "marks.json")
    import_marks(tmp_path / "marks.json", tmp_path / "t.parquet")
    table = pq.read_table(tmp_path / "t.parquet")
    pq.write_table(table.replace_schema_metadata({DESIGN_KEY: design}), tmp_path / "t.parquet")
    code, _, err = run_cli(["evaluate", "detection", coco_scores, "--truth", tmp_path / "t.parquet",
                            "--json", tmp_path / "d.json"], capsys)
    assert code == 2 and f"the audit design in {tmp_path / 't.parquet'} is not a valid blind audit design" in err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "d.json").exists()


NODE = shutil.which("node")
FAKE_DOM = """
const listeners = {};
function element() {
  return {hidden: false, className: "", textContent: "", title: "", children: [],
          appendChild(c) { this.children.push(c); return c; }, addEventListener() {}, click() {}};
}
const elements = {};
globalThis.document = {
  querySelectorAll: () => Array.from({length: COUNT}, element),
  getElementById: id => (elements[id] = elements[id] || element()),
  createElement: element,
  addEventListener: (type, f) => { listeners[type] = f; },
};
const store = {};
globalThis.localStorage = {getItem: k => store[k] || null, setItem: (k, v) => { store[k] = v; }};
globalThis.URL = {createObjectURL: () => ""};
globalThis.Blob = function () {};
"""


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_the_page_keeps_both_looks_at_a_pair_shown_twice(blind_page, tmp_path):
    """The page's own script (run by node over a minimal document): the second look at a pair
    keeps its own mark, and the export carries both, each with its look."""
    text = blind_page.read_text()
    script = text[text.index("<script>") + len("<script>"):text.index("</script>")]
    items = _items(blind_page)
    marks = ["d" if i % 3 == 0 else "k" for i in range(len(items))]
    drive = "".join(f"listeners.keydown({{key: {json.dumps(m)}}});" for m in marks)
    program = (FAKE_DOM.replace("COUNT", str(len(items))) + script + drive
               + "process.stdout.write(exportMarks());")
    (tmp_path / "page.js").write_text(program)
    exported = json.loads(subprocess.run([NODE, tmp_path / "page.js"], capture_output=True, text=True,
                                         check=True).stdout)
    assert [m["mark"] for m in exported["marks"]] == ["drop" if m == "d" else "keep" for m in marks]
    assert [(m["shard"], m["index"], m["look"]) for m in exported["marks"]] == \
        [(it["shard"], it["index"], it["look"]) for it in items]
    (tmp_path / "marks.json").write_text(json.dumps(exported))
    imported = import_marks(tmp_path / "marks.json", tmp_path / "t.parquet")
    looks = {(it["shard"], it["index"], it["look"]): m == "d" for it, m in zip(items, marks)}
    expected = sum(looks[(s, i, 1)] != looks[(s, i, 2)] for s, i, look in looks if look == 2)
    assert imported.judge == JudgeError(2, expected) and imported.marked == 8
