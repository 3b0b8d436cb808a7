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

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import run_cli

from pairclean.cli import main
from pairclean.curate.audit import import_marks
from pairclean.errors import UserError
from pairclean.scores.stratified import audit_design, ratio_estimate, wilson

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


def test_the_blind_page_shows_no_score_in_random_order_and_records_its_strata(blind_page, coco_scores):
    """The decile page shows each pair's similarity and decile, lowest first: the judge sees the
    model's verdict. The blind page: 2 pairs drawn from each of 4 sim strata of 4 pairs, in an
    order that is not the strata's, with nothing of the scores on it but the strata in its script."""
    text = blind_page.read_text()
    cards = text[text.index("<article"):text.index('<p class="help">')]  # what the judge sees of the pairs
    assert "similarity" not in cards and "sim " not in cards and "decile" not in cards
    items, design = _items(blind_page), _design(blind_page)
    assert all(set(it) == {"key", "shard", "index", "stratum"} for it in items) and len(items) == 8
    assert [it["stratum"] for it in items] != sorted(it["stratum"] for it in items)
    assert [(s["stratum"], s["pairs"], s["drawn"]) for s in design["strata"]] == [(h, 4, 2) for h in (1, 2, 3, 4)]
    assert design["scored_pairs"] == 16 and design["scores"] == coco_scores.name
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
    marks = _blind_marks(blind_page, truth, tmp_path / "marks.json", keep_only=7)  # one pair left unmarked
    code, out, err = run_cli(["audit-import", marks, "--out", tmp_path / "audit-truth.parquet"], capsys)
    assert code == 0 and "7 marks" in out and "a blind audit: 4 strata of 16 scored pairs" in out, err
    table = pq.read_table(tmp_path / "audit-truth.parquet")
    assert table.column_names == ["key", "shard", "index", "noisy", "stratum"]
    assert audit_design(tmp_path / "audit-truth.parquet").to_json() == _design(blind_page)
    code, out, err = run_cli(["evaluate", "detection", coco_scores, "--truth", tmp_path / "audit-truth.parquet",
                              "--json", tmp_path / "d.json"], capsys)
    assert code == 0, err
    assert "blind audit: 7 marked pairs weighted to all 16 scored pairs (4 sim strata)" in out
    assert "noise share of the scored pairs, %" in out and "on the 7 marked pairs alone (unweighted)" in out
    audit = json.loads((tmp_path / "d.json").read_text())["audit"]
    rows = {(r["shard"], r["index"]): r for r in pq.read_table(truth).to_pylist()}
    marked = table.to_pylist()
    population = {s["stratum"]: s["pairs"] for s in audit["design"]["strata"]}
    expected = ratio_estimate([rows[(m["shard"], m["index"])]["noisy"] for m in marked], [1] * len(marked),
                              [m["stratum"] for m in marked], population)
    assert audit["noise_share"] == expected.as_dict()
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
    (lambda e: e["marks"].extend([dict(e["marks"][0], index=100 + i) for i in range(3)]),
     "more marks in stratum"),
])
def test_a_blind_export_is_typed_strictly(blind_page, truth, tmp_path, change, message):
    entries = json.loads(_blind_marks(blind_page, truth, tmp_path / "marks.json").read_text())
    change(entries)
    (tmp_path / "bad.json").write_text(json.dumps(entries))
    with pytest.raises(UserError, match=re.escape(message)):
        import_marks(tmp_path / "bad.json", tmp_path / "t.parquet")
    assert not (tmp_path / "t.parquet").exists()


def test_the_ratio_estimator_by_hand():
    """Two strata of 100 and 300 pairs, 4 and 6 marked: the estimates and the variance written out."""
    population = {1: 100, 2: 300}
    strata = [1] * 4 + [2] * 6
    noisy = [1, 1, 1, 0] + [0, 0, 0, 0, 1, 0]
    share = ratio_estimate(noisy, [1] * 10, strata, population)
    assert share.value == pytest.approx((100 * 0.75 + 300 / 6) / 400)
    z1, z2 = [y - share.value for y in noisy[:4]], [y - share.value for y in noisy[4:]]
    var = lambda z: sum((a - sum(z) / len(z)) ** 2 for a in z) / (len(z) - 1)  # noqa: E731
    variance = (100 ** 2 * (1 - 4 / 100) * var(z1) / 4 + 300 ** 2 * (1 - 6 / 300) * var(z2) / 6) / 400 ** 2
    assert share.effective_n == pytest.approx(share.value * (1 - share.value) / variance)
    assert (share.low, share.high) == pytest.approx(wilson(share.value, share.effective_n))
    flagged = [1, 1, 0, 0] + [0, 0, 0, 0, 1, 1]
    precision = ratio_estimate([n and f for n, f in zip(noisy, flagged)], flagged, strata, population)
    assert precision.value == pytest.approx((25 * 2 + 50 * 1) / (25 * 2 + 50 * 2)) and precision.sampled == 4
    none_flagged = ratio_estimate([0] * 10, [0] * 10, strata, population)
    assert none_flagged.value is None and none_flagged.sampled == 0
    assert wilson(1.0, 7)[1] == 1.0 and wilson(0.0, 7)[0] == 0.0  # a true share of 1 is covered, to the bit
    pure = ratio_estimate([1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 2, 2], population)  # no variance seen: n_eff = n
    assert pure.value == 1 and pure.effective_n == 4 and (pure.low, pure.high) == pytest.approx(wilson(1.0, 4))


def test_the_intervals_cover_the_truth_at_their_rate():
    """A population shaped like the demo's (2,000 pairs, 50% noise, the noise at low sim, a rule with
    97% precision): over 400 stratified samples of 100 and of 400 pairs, the 95% intervals of the
    noise share and of the precision cover the true values at least 90% of the time, and the normal
    approximation's, R +- 1.96 sqrt(v), do not for the precision at 100 pairs (the reason for Wilson)."""
    import numpy as np
    from scipy.stats import norm

    rng = np.random.default_rng(7)
    n_pop = 2000
    noisy = np.arange(n_pop) < n_pop // 2
    sim = np.where(noisy, rng.normal(0.1, 0.35, n_pop), rng.normal(0.85, 0.03, n_pop))
    flagged = sim < np.quantile(sim, 0.497)
    order = np.argsort(sim, kind="stable")
    strata = np.empty(n_pop, dtype=int)
    strata[order] = np.arange(n_pop) * 10 // n_pop + 1
    population = {h: int((strata == h).sum()) for h in range(1, 11)}
    truth = {"share": noisy.mean(), "precision": noisy[flagged].mean()}
    for n in (100, 400):
        covered = {"share": 0, "precision": 0, "wald precision": 0}
        for _ in range(400):
            drawn = np.concatenate([rng.choice(np.flatnonzero(strata == h), n // 10, replace=False)
                                    for h in range(1, 11)])
            y, f, h = noisy[drawn], flagged[drawn], strata[drawn]
            share = ratio_estimate(y, np.ones_like(y), h, population)
            precision = ratio_estimate(y & f, f, h, population)
            covered["share"] += share.low <= truth["share"] <= share.high
            covered["precision"] += precision.low <= truth["precision"] <= precision.high
            if precision.value < 1:
                half = norm.ppf(0.975) * np.sqrt(precision.value * (1 - precision.value) / precision.effective_n)
                covered["wald precision"] += abs(precision.value - truth["precision"]) <= half
        assert covered["share"] >= 360 and covered["precision"] >= 360, (n, covered)
        if n == 100:
            assert covered["wald precision"] < 340, covered


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
    from pairclean.scores.stratified import DESIGN_KEY

    _blind_marks(blind_page, truth, tmp_path / "marks.json")
    import_marks(tmp_path / "marks.json", tmp_path / "t.parquet")
    table = pq.read_table(tmp_path / "t.parquet")
    pq.write_table(table.replace_schema_metadata({DESIGN_KEY: design}), tmp_path / "t.parquet")
    code, _, err = run_cli(["evaluate", "detection", coco_scores, "--truth", tmp_path / "t.parquet",
                            "--json", tmp_path / "d.json"], capsys)
    assert code == 2 and f"the audit design in {tmp_path / 't.parquet'} is not a valid blind audit design" in err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "d.json").exists()
