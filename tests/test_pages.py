"""Issue 25, class 2: data enters a page pairclean writes (the report, the audit page) one way only
(`curate.pages`). Each example of the issue is its own test on real COCO pairs scored by the tiny
model: a caption `__STORE__`; a scores file named `__ITEMS__.parquet` whose captions hold
`<img src=x onerror=...>`; a caption holding `<!--<script>`; NUL and right-to-left overrides in
keys (and a few more of the kind: `</script>`, a template field, U+2028). Each page is parsed by
an HTML5 parser (html5lib, strict: any parse error fails) and, where Chromium is installed,
loaded in headless Chromium: the page's own script runs, no injected one."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pairclean.cli import main

html5lib = pytest.importorskip("html5lib")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
XHTML = "{http://www.w3.org/1999/xhtml}"
PWNED = "document.documentElement.dataset.pwned=1"  # what an injected script would do
EXAMPLES = {  # the captions (and three more of the kind), each on pair 3 of its own dataset
    "store": "__STORE__",
    "img": f"<img src=x onerror={PWNED}>",
    "comment": "a dog <!--<script> on a couch",
    "script": "</script><script>" + PWNED + "</script>",
    "fields": "{{title}} {{items}} ${heading} __ITEMS__ __TITLE__",
    "separators": "one line\u2028another\u2029and a third",
}
KEYS = {0: "nul\x00key", 1: "rtl\u202egpj.exe", 2: "esc\x1b[31mred"}
SHOWN_KEYS = ["nul<U+0000>key", "rtl<U+202E>gpj.exe", "esc<U+001B>[31mred"]


def _dataset(coco_src: Path, out: Path, keys: dict, caption: str | None = None) -> Path:
    records = [json.loads(line) for line in (coco_src / "pairs.jsonl").read_text().splitlines()]
    out.mkdir(parents=True)
    pq.write_table(pa.table({
        "key": [keys.get(i, f"{r['image_id']:012d}") for i, r in enumerate(records)],
        "caption": [caption if i == 3 and caption is not None else r["captions"][0] for i, r in enumerate(records)],
        "image": [(coco_src / r["image"]).read_bytes() for r in records]}), out / "data.parquet")
    return out / "data.parquet"


def _score(data: Path, out: Path) -> Path:
    main(["score", str(data), "--out", str(out), "--model", "pairclean-tiny", "--pretrained", "none",
          "--beta-k", "64", "--batch-size", "8", "--workers", "0"])
    return out


@pytest.fixture(scope="module")
def pages(tmp_path_factory, coco_src):
    """name -> {"audit": page, "report": page}: the 16 pairs scored into `__ITEMS__.parquet`, pages
    drawn from a copy of the data with one example caption; "keys": scored with the examples' keys."""
    root = tmp_path_factory.mktemp("pages")
    scores = _score(_dataset(coco_src, root / "clean", {}), root / "__ITEMS__.parquet")
    keyed = _score(_dataset(coco_src, root / "keyed", KEYS), root / "keys.parquet")
    built = {}

    def build(name: str) -> dict[str, Path]:
        if name not in built:
            if name == "keys":
                data, used = root / "keyed" / "data.parquet", keyed
            else:  # another copy of the data, one caption changed: the scores are used with it on purpose
                data, used = _dataset(coco_src, root / name, {}, EXAMPLES[name]), scores
            built[name] = {kind: root / f"{name}-{kind}.html" for kind in ("audit", "report")}
            for kind, page in built[name].items():
                main([kind, str(used), "--shards", str(data), "--out", str(page), "--allow-other-dataset"])
        return built[name]
    return build


def parse(page: Path):
    """The page as an HTML5 parser builds it; a parse error (NUL, a script left open ...) fails the test."""
    return html5lib.HTMLParser(strict=True, namespaceHTMLElements=True).parse(page.read_bytes())


def texts(document, tag: str) -> list[str]:
    return ["".join(element.itertext()) for element in document.iter(XHTML + tag)]


def handlers(document) -> list:
    """Event-handler attributes (onerror, onload ...): the page has none of its own."""
    return [(el.tag, attr) for el in document.iter() for attr in el.attrib if attr.lower().startswith("on")]


def audit_data(document) -> tuple[list, str]:
    (script,) = texts(document, "script")
    items = json.loads(re.search(r"const ITEMS = (.*);\nconst STORE", script).group(1))
    store = json.loads(re.search(r"const STORE = (.*);\n", script).group(1))
    return items, store


def chromium_dom(page: Path, profile: Path) -> str:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120).stdout


def audit_ran(dom: str) -> bool:
    return 'id="progress">0 / 16 marked<' in dom  # the audit page's script ran to its end


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_a_caption_is_shown_as_text_in_a_page_that_parses(pages, name):
    shown = EXAMPLES[name].replace("\u2028", "<U+2028>").replace("\u2029", "<U+2029>")
    for kind, page in pages(name).items():
        document = parse(page)
        assert shown in texts(document, "p"), kind
        assert len(texts(document, "script")) == 1 and handlers(document) == [], kind


def test_a_caption_store_leaves_the_audit_script_whole(pages, tmp_path):
    items, store = audit_data(parse(pages("store")["audit"]))
    assert store == "pairclean-audit:__ITEMS__.parquet" and len(items) == 16
    if CHROMIUM:
        assert audit_ran(chromium_dom(pages("store")["audit"], tmp_path / "profile"))


def test_a_scores_file_named_items_with_img_captions_runs_no_injected_script(pages, tmp_path):
    for kind, page in pages("img").items():
        document = parse(page)
        assert texts(document, "title") == texts(document, "h1") == [f"pairclean {kind} · __ITEMS__.parquet"]
        assert [img for img in document.iter(XHTML + "img") if not img.get("src", "").startswith("data:")] == []
        if CHROMIUM:
            dom = chromium_dom(page, tmp_path / kind)
            assert "data-pwned" not in dom
            assert audit_ran(dom) if kind == "audit" else re.search(r'data-images-loaded="(\d+)/\1"', dom)


def test_a_caption_with_a_comment_and_script_start_cannot_keep_the_script_open(pages, tmp_path):
    document = parse(pages("comment")["audit"])
    (script,) = texts(document, "script")
    assert script.rstrip().endswith("render();")  # the page's </script> closed the page's script
    assert "<!--" not in script and "<script" not in script
    if CHROMIUM:
        assert audit_ran(chromium_dom(pages("comment")["audit"], tmp_path / "profile"))


def test_nul_rtl_and_escape_characters_in_keys_are_shown_as_code_points(pages):
    for kind, page in pages("keys").items():
        raw = page.read_text(encoding="utf-8")
        assert not re.search("[\x00\x1b\u202e]", raw), kind
        main_text = "".join(next(parse(page).iter(XHTML + "main")).itertext())
        assert all(f"key {shown}" in main_text for shown in SHOWN_KEYS), kind


def test_the_audit_exports_the_raw_keys(pages):
    """What the page shows is made visible; what it exports (and audit-import reads back) is the key itself."""
    items, _ = audit_data(parse(pages("keys")["audit"]))
    assert set(KEYS.values()) <= {it["key"] for it in items}


def test_the_audit_page_draws_one_card_per_pair_with_its_picture(pages):
    document = parse(pages("store")["audit"])
    items, _ = audit_data(document)
    cards = list(document.iter(XHTML + "article"))
    assert len(cards) == len(items) == 16
    for card, item in zip(cards, items):
        (img,) = card.iter(XHTML + "img")
        assert img.get("src").startswith("data:image/jpeg;base64,")
        assert f"sim {item['sim']:.4f}" in "".join(card.itertext())


def test_render_fills_each_field_once_by_the_values_type():
    from pairclean.curate.pages import Html, ScriptJson, render

    page = render("<p title='{{a}}'>{{a}}</p>{{b}}<script>const X = {{c}};</script>",
                  a="{{b}} <b>'\x00'</b>", b=Html("<i>ours</i>"), c=ScriptJson(["</script>", "<!--", "&", "\u2028"]))
    assert page == ("<p title='{{b}} &lt;b&gt;&#x27;&lt;U+0000&gt;&#x27;&lt;/b&gt;'>{{b}} &lt;b&gt;&#x27;&lt;U+0000&gt;"
                    "&#x27;&lt;/b&gt;</p><i>ours</i><script>const X = "
                    '["\\u003c/script\\u003e","\\u003c!--","\\u0026","\\u2028"];</script>')
    assert json.loads(page[page.index("= ") + 2:page.index(";</script>")]) == ["</script>", "<!--", "&", "\u2028"]
    with pytest.raises(KeyError, match="missing: \\['b'\\]"):
        render("{{a}}{{b}}", a=1)
    with pytest.raises(KeyError, match="not in the template: \\['c'\\]"):
        render("{{a}}", a=1, c=2)


def test_every_page_template_is_filled_by_render_alone():
    """The templates use `{{field}}` only, and nothing but curate/pages.py escapes HTML or fills a
    template: a new page goes through `curate.pages.render`."""
    from conventions import sources

    root = Path(__file__).parent.parent
    for template in (root / "pairclean").rglob("*.html"):
        text = template.read_text()
        assert re.findall(r"\{\{(\w+)\}\}", text), template
        assert not re.search(r"\$\w+|__[A-Z]+__", text), template
    files = sources(root)
    others = [path for path, source in files.items() if path != "pairclean/curate/pages.py"
              and re.search(r"\bhtml\.escape\(|\bTemplate\(|\.replace\(\"__", source)]
    assert others == []
