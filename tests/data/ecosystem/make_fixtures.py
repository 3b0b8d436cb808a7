"""Regenerate the ecosystem fixtures: files written by the real tools (img2dataset, Hugging Face
`datasets`, clip-retrieval) and a DataComp pool laid out as their code writes it.

Each tool runs in its own virtual environment (clip-retrieval pins numpy<2, pyarrow<16 and
open_clip<3, which would break pairclean's own environment):

    python -m venv /work/venvs/img2dataset    && /work/venvs/img2dataset/bin/pip install img2dataset
    python -m venv /work/venvs/datasets       && /work/venvs/datasets/bin/pip install datasets pillow
    python -m venv /work/venvs/clip-retrieval && /work/venvs/clip-retrieval/bin/pip install clip-retrieval

then, from the repository root (any Python; each step re-runs this file with its tool's interpreter):

    python tests/data/ecosystem/make_fixtures.py --venvs /work/venvs             # every tool
    python tests/data/ecosystem/make_fixtures.py --venvs /work/venvs img2dataset  # one tool

Steps and the interpreter each runs under:
  img2dataset     venvs/img2dataset     the real `img2dataset` CLI against images served on 127.0.0.1
  hf-datasets     venvs/datasets        `datasets.Dataset.to_parquet` with an Image feature, hub file names
  clip-retrieval  venvs/clip-retrieval  the real `clip-retrieval inference` on img2dataset's webdataset output
  datacomp        --torch-python, then venvs/img2dataset: CLIP-architecture embeddings -> metadata .parquet +
                  .npz, then `img2dataset` on that metadata exactly as datacomp's download_upstream.py calls it

Sources: the 16 COCO images and captions in tests/data/coco-mini (first caption of each image).
Nothing here is byte-reproducible (tar mtimes, ports in URLs, timings in the stats files); the
layouts, columns, keys and statuses are. PROVENANCE.md in each tool's folder records the versions
and commands of the committed run.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
COCO = REPO / "tests" / "data" / "coco-mini"
STEPS = ("img2dataset", "hf-datasets", "clip-retrieval", "datacomp")
VENV_OF = {"img2dataset": "img2dataset", "hf-datasets": "datasets", "clip-retrieval": "clip-retrieval"}


def coco_pairs() -> list[dict]:
    """(image file, first caption, COCO id) of the 16 committed COCO images, in pairs.jsonl order."""
    pairs = []
    for line in (COCO / "pairs.jsonl").read_text().splitlines():
        row = json.loads(line)
        pairs.append({"path": COCO / row["image"], "caption": row["captions"][0], "image_id": row["image_id"]})
    return pairs


def run(cmd: list[str], cwd: Path | None = None, log: list | None = None) -> None:
    """Run a tool's command, echo it, keep it for PROVENANCE.md."""
    print("+", " ".join(cmd), flush=True)
    if log is not None:
        log.append(cmd)
    env = dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    subprocess.run(cmd, cwd=cwd, check=True, env=env)


def pip_version(python: str, package: str) -> str:
    out = subprocess.run([python, "-m", "pip", "show", package], capture_output=True, text=True, check=True).stdout
    return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Version:"))


def fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


# -- a local web server with good, missing, broken and hanging URLs ----------------------------------


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # img2dataset's own logs say what happened
        pass


@contextlib.contextmanager
def image_server(root: Path):
    """`python -m http.server`'s handler on 127.0.0.1 serving `root`, plus a port that accepts
    connections and never answers (a download that times out). Yields (base URL, hanging base URL,
    refused base URL)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(16)  # the kernel completes the handshake; nothing ever reads or writes
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
    try:
        yield (f"http://127.0.0.1:{server.server_address[1]}", f"http://127.0.0.1:{hang.getsockname()[1]}",
               f"http://127.0.0.1:{closed.getsockname()[1]}")
    finally:
        server.shutdown()
        hang.close()
        closed.close()


def serve_dir(work: Path, pairs: list[dict]) -> Path:
    """The served folder: the COCO JPEGs, and one `.jpg` that is an HTML page."""
    root = fresh(work / "www")
    for p in pairs:
        shutil.copy(p["path"], root / p["path"].name)
    (root / "not-an-image.jpg").write_text("<html><body>This page moved.</body></html>\n")
    return root


def url_rows(pairs: list[dict], base: str, hang: str, refused: str, good: int = 12) -> list[dict]:
    """`good` downloadable images with their captions, interleaved with 3 URLs that 404, one HTML
    page named .jpg, one that never answers and one whose port refuses connections."""
    rows = [{"url": f"{base}/{p['path'].name}", "caption": p["caption"], "image_id": p["image_id"]} for p in pairs[:good]]
    bad = [
        {"url": f"{base}/missing-1.jpg", "caption": "A photo that was deleted from the site.", "image_id": -1},
        {"url": f"{base}/not-an-image.jpg", "caption": "A web page served instead of an image.", "image_id": -2},
        {"url": f"{hang}/slow.jpg", "caption": "A server that never answers.", "image_id": -3},
        {"url": f"{base}/missing-2.jpg", "caption": "Another photo that is gone.", "image_id": -4},
        {"url": f"{refused}/refused.jpg", "caption": "A host that refuses the connection.", "image_id": -5},
        {"url": f"{base}/missing-3.jpg", "caption": "A third missing photo.", "image_id": -6},
    ]
    for i, row in enumerate(bad):  # spread the failures over both shards of 10
        rows.insert(2 + 3 * i, row)
    return rows


IMG2DATASET_ARGS = ["--image_size", "64", "--resize_mode", "border", "--processes_count", "1", "--thread_count", "4",
                    "--number_sample_per_shard", "10", "--timeout", "2", "--retries", "0", "--enable_wandb", "False"]


def step_img2dataset(work: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = fresh(HERE / "img2dataset")
    pairs = coco_pairs()
    commands: list = []
    img2dataset = str(Path(sys.executable).parent / "img2dataset")
    with image_server(serve_dir(work, pairs)) as (base, hang, refused):
        rows = url_rows(pairs, base, hang, refused)
        pq.write_table(pa.Table.from_pylist(rows), out / "urls.parquet")
        (out / "urls.csv").write_text("url,caption,image_id\n" + "".join(
            f'{r["url"]},"{r["caption"]}",{r["image_id"]}\n' for r in rows))
        for fmt in ("webdataset", "parquet"):
            run([img2dataset, "--url_list", "urls.parquet", "--input_format", "parquet", "--url_col", "url",
                 "--caption_col", "caption", "--save_additional_columns", "['image_id']", "--output_format", fmt,
                 "--output_folder", fmt, *IMG2DATASET_ARGS], cwd=out, log=commands)
    write_provenance(out / "PROVENANCE.md", "img2dataset", [("img2dataset", pip_version(sys.executable, "img2dataset")),
                     ("webdataset", pip_version(sys.executable, "webdataset")),
                     ("pyarrow", pip_version(sys.executable, "pyarrow"))], commands, IMG2DATASET_NOTES)


IMG2DATASET_NOTES = """\
Input: `urls.parquet` (the same rows as `urls.csv`): 18 URLs on 127.0.0.1 with a caption and the
COCO `image_id` (negative for the bad URLs). 12 are COCO JPEGs from tests/data/coco-mini served by
Python's `http.server` handler; 3 answer 404; `not-an-image.jpg` is an HTML page; one points at a
port that accepts the connection and never answers (`--timeout 2`); one at a port that refuses it.
The ports were picked free at run time, so the URLs in the files hold whatever ports that run got.

Outputs, kept exactly as img2dataset wrote them:
- `webdataset/`: `0000{0,1}.tar` (members `KEY.jpg`, `KEY.txt`, `KEY.json` for each successful
  download only), beside each tar `0000N.parquet` (one row per input URL, failures included: the
  json fields without the image) and `0000N_stats.json`.
- `parquet/`: `0000{0,1}.parquet` (one row per input URL: `jpg` bytes or null, `txt`, and the same
  metadata columns) and `0000N_stats.json`.
"""


def write_provenance(path: Path, tool: str, versions: list[tuple[str, str]], commands: list, notes: str) -> None:
    lines = [f"# {tool} fixture", "", "Written by the real tool; regenerate with (from the repository root)", "",
             f"    python tests/data/ecosystem/make_fixtures.py --venvs /work/venvs {path.parent.name}", "",
             "Versions: " + ", ".join(f"{name} {version}" for name, version in versions) +
             f" (Python {sys.version.split()[0]}).", "", "Commands the script ran (working directory: this folder):", ""]
    for cmd in commands:
        lines.append("    " + " ".join(_shell_quote(str(c)) for c in cmd).replace(str(Path(sys.executable).parent) + "/", ""))
    lines += ["", notes]
    path.write_text("\n".join(lines))


def _shell_quote(text: str) -> str:
    import shlex

    if "'" in text and '"' not in text and "$" not in text:
        return f'"{text}"'
    return shlex.quote(text)


# -- Hugging Face datasets -----------------------------------------------------------------------------


def small_jpegs(work: Path, pairs: list[dict], side: int = 96) -> list[Path]:
    """The COCO images re-encoded at most `side` pixels wide (the fixture stays small)."""
    from PIL import Image as PILImage

    folder = fresh(work / "small")
    out = []
    for p in pairs:
        with PILImage.open(p["path"]) as im:
            im = im.convert("RGB")
            im.thumbnail((side, side))
            im.save(folder / p["path"].name, quality=90)
        out.append(folder / p["path"].name)
    return out


def hub_card(features, splits: dict) -> str:
    """The dataset card push_to_hub writes: `configs` (data_files per split) and `dataset_info`."""
    from datasets.info import DatasetInfo, DatasetInfosDict
    from datasets.splits import SplitDict, SplitInfo
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCardData

    card = DatasetCardData()
    MetadataConfigs({"default": {"data_files": [{"split": s, "path": f"data/{s}-*"} for s in splits]}}
                    ).to_dataset_card_data(card)
    split_dict = SplitDict()
    for name, ds in splits.items():
        split_dict.add(SplitInfo(name=name, num_examples=len(ds)))
    DatasetInfosDict({"default": DatasetInfo(features=features, splits=split_dict)}).to_dataset_card_data(card)
    return f"---\n{card.to_yaml()}\n---\n"


def step_hf_datasets(work: Path) -> None:
    import datasets
    from datasets import Dataset, Features, Image, Value
    from datasets.table import embed_table_storage

    out = fresh(HERE / "hf-datasets")
    pairs = coco_pairs()
    jpegs = small_jpegs(work, pairs)
    features = Features({"image": Image(), "text": Value("string"), "id": Value("int64")})
    full = Dataset.from_dict({"image": [str(j) for j in jpegs], "text": [p["caption"] for p in pairs],
                              "id": [p["image_id"] for p in pairs]}, features=features)
    splits = {"train": full.select(range(12)), "test": full.select(range(12, 16))}
    shards = {"train": 2, "test": 1}
    # hub/: what push_to_hub uploads (arrow_dataset.py `_push_parquet_shards_to_hub_single`): each
    # contiguous shard with its image files embedded (embed_table_storage), written with to_parquet
    # under data/{split}-{index:05d}-of-{num_shards:05d}.parquet, and a README.md card.
    hub = out / "hub"
    for split, ds in splits.items():
        for index in range(shards[split]):
            shard = ds.shard(num_shards=shards[split], index=index, contiguous=True)
            shard = shard.with_format("arrow").map(embed_table_storage, batched=True, keep_in_memory=True)
            target = hub / "data" / f"{split}-{index:05d}-of-{shards[split]:05d}.parquet"
            target.parent.mkdir(parents=True, exist_ok=True)
            shard.to_parquet(str(target))
    (hub / "README.md").write_text(hub_card(features, splits))
    # path-only/: the Image feature holding relative paths (bytes null), as Dataset.to_parquet writes
    # a dataset whose images were given as paths; the images live under the dataset root.
    root = out / "path-only"
    (root / "images").mkdir(parents=True)
    for j in jpegs:
        shutil.copy(j, root / "images" / j.name)
    relative = Dataset.from_dict({"image": [f"images/{j.name}" for j in jpegs], "text": [p["caption"] for p in pairs],
                                  "id": [p["image_id"] for p in pairs]}, features=features)
    (root / "data").mkdir()
    here = os.getcwd()
    os.chdir(root)  # to_parquet reads the files' sizes to size row groups: relative to the dataset root
    try:
        relative.to_parquet("data/train-00000-of-00001.parquet")
    finally:
        os.chdir(here)
    commands = [["Dataset.from_dict(..., features=Features({'image': Image(), 'text': Value('string'), 'id': Value('int64')}))"],
                ["shard.with_format('arrow').map(embed_table_storage, batched=True).to_parquet('hub/data/{split}-{i:05d}-of-{n:05d}.parquet')"],
                ["Dataset.from_dict({'image': ['images/NAME.jpg', ...], ...}, features=...).to_parquet('path-only/data/train-00000-of-00001.parquet')"]]
    write_provenance(out / "PROVENANCE.md", "Hugging Face datasets", [("datasets", datasets.__version__),
                     ("pyarrow", pip_version(sys.executable, "pyarrow")), ("pillow", pip_version(sys.executable, "pillow"))],
                     commands, HF_NOTES)


HF_NOTES = """\
Calls into the `datasets` library (not a CLI); the script's `step_hf_datasets` is the exact code.
Images: the 16 COCO JPEGs of tests/data/coco-mini re-encoded at most 96 px (PIL thumbnail, quality
90) to keep the fixture small; `text` is each image's first COCO caption, `id` its COCO image id.

- `hub/`: the layout `Dataset.push_to_hub` uploads, produced with the same calls it makes
  (datasets/arrow_dataset.py `_push_parquet_shards_to_hub_single`): split `train` (12 rows) in 2
  contiguous shards `data/train-00000-of-00002.parquet`, `data/train-00001-of-00002.parquet`, split
  `test` (4 rows) in `data/test-00000-of-00001.parquet`; image files embedded by
  `embed_table_storage` (struct `image` = {bytes: JPEG bytes, path: file name}); `README.md` is the
  card's YAML (`configs` with `data_files` per split, `dataset_info` with the features).
- `path-only/`: the same 16 rows written by `Dataset.to_parquet` without embedding:
  `image` = {bytes: null, path: "images/NAME.jpg"}, a path relative to the dataset root
  (`path-only/`), not to the Parquet file (`path-only/data/`). The JPEGs are in `path-only/images/`.
"""


# -- driver -------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("steps", nargs="*", help=f"any of {', '.join(STEPS)} (default: all)")
    parser.add_argument("--venvs", default="/work/venvs", help="folder holding one venv per tool")
    parser.add_argument("--torch-python", default=sys.executable,
                        help="interpreter with torch and open_clip for DataComp's embeddings (default: this one)")
    parser.add_argument("--step", help=argparse.SUPPRESS)  # internal: run one step in this interpreter
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args()
    work = Path(args.work or os.environ.get("TMPDIR", "/tmp")) / "pairclean-ecosystem-work"
    work.mkdir(parents=True, exist_ok=True)
    if args.step:
        globals()["step_" + args.step.replace("-", "_")](work)
        return
    unknown = sorted(set(args.steps) - set(STEPS))
    if unknown:
        parser.error(f"unknown step(s) {unknown}; choose from {', '.join(STEPS)}")
    for step in args.steps or STEPS:
        if step == "datacomp":
            subprocess.run([args.torch_python, __file__, "--step", "datacomp-embeddings", "--work", str(work)], check=True)
            python = str(Path(args.venvs) / "img2dataset" / "bin" / "python")
            subprocess.run([python, __file__, "--step", "datacomp-shards", "--work", str(work)], check=True)
            continue
        python = str(Path(args.venvs) / VENV_OF[step] / "bin" / "python")
        subprocess.run([python, __file__, "--step", step, "--work", str(work)], check=True)


if __name__ == "__main__":
    main()
