"""Regenerate the ecosystem fixtures: files written by the real tools (img2dataset, Hugging Face
`datasets`, clip-retrieval) and a DataComp pool laid out as their code writes it.

Each tool runs in its own virtual environment (clip-retrieval pins numpy<2, pyarrow<16 and
open_clip<3, which would break pairclean's own environment):

    python -m venv /work/venvs/img2dataset    && /work/venvs/img2dataset/bin/pip install img2dataset
    python -m venv /work/venvs/datasets       && /work/venvs/datasets/bin/pip install datasets pillow
    python -m venv /work/venvs/clip-retrieval && /work/venvs/clip-retrieval/bin/pip install clip-retrieval "setuptools<81"
    python -m venv /work/venvs/datacomp-resharder && /work/venvs/datacomp-resharder/bin/pip install \
        img2dataset webdataset==0.2.31 pysimdjson cloudpathlib          # only for --resharder

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
STEPS = ("img2dataset", "hf-datasets", "clip-retrieval", "datacomp")  # clip-retrieval reads img2dataset's output
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


def write_provenance(path: Path, tool: str, versions: list[tuple[str, str]], commands: list, notes: str,
                     cwd: str = "this folder") -> None:
    lines = [f"# {tool} fixture", "", "Written by the real tool; regenerate with (from the repository root)", "",
             f"    python tests/data/ecosystem/make_fixtures.py --venvs /work/venvs {path.parent.name}", "",
             "Versions: " + ", ".join(f"{name} {version}" for name, version in versions) +
             f" (Python {sys.version.split()[0]}).", "", f"Commands the script ran (working directory: {cwd}):", ""]
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


# -- clip-retrieval -----------------------------------------------------------------------------------------

CLIP_RETRIEVAL_WRAPPER = """\
import sys
import open_clip
if __name__ == "__main__":  # the DataLoader's worker processes re-import this file
    open_clip.add_model_config(sys.argv.pop(1))  # pairclean's own model configs: pairclean-toy
    from clip_retrieval.cli import main
    sys.argv[0] = "clip-retrieval"
    main()
"""


def step_clip_retrieval(work: Path) -> None:
    """The real `clip-retrieval inference` on img2dataset's webdataset fixture. clip-retrieval loads
    models through all_clip, whose `open_clip:ARCH/CHECKPOINT` form hands CHECKPOINT to
    open_clip.create_model_and_transforms(pretrained=...), which takes a local file: so the model is
    pairclean's `pairclean-toy` architecture (config registered with open_clip.add_model_config by a
    three-line wrapper around clip-retrieval's CLI) with seeded random weights saved to a local file.
    No hub is reachable here; the layout, dtype and normalisation are clip-retrieval's own."""
    import open_clip
    import torch

    out = HERE / "clip-retrieval"
    if out.exists():
        shutil.rmtree(out)
    configs = REPO / "pairclean" / "backends" / "model_configs"
    open_clip.add_model_config(configs)
    torch.manual_seed(0)
    model = open_clip.create_model("pairclean-toy", pretrained=None)
    checkpoint = work / "pairclean-toy-seed0.pt"
    torch.save(model.state_dict(), checkpoint)
    wrapper = work / "clip_retrieval_with_pairclean_configs.py"
    wrapper.write_text(CLIP_RETRIEVAL_WRAPPER)
    shards = HERE / "img2dataset" / "webdataset"
    cmd = [sys.executable, str(wrapper), str(configs), "inference",
           "--input_dataset", f"{shards}/{{00000..00001}}.tar", "--input_format", "webdataset",
           "--output_folder", str(out), "--enable_metadata", "True", "--enable_wandb", "False",
           "--clip_model", f"open_clip:pairclean-toy/{checkpoint}", "--use_jit", "False",
           "--batch_size", "4", "--num_prepro_workers", "1", "--write_batch_size", "7",
           "--wds_number_file_per_input_file", "7"]
    commands: list = []
    run(cmd, cwd=REPO, log=commands)
    commands[-1] = ["python", "clip_retrieval_with_pairclean_configs.py", "pairclean/backends/model_configs",
                    *[c.replace(str(REPO) + "/", "").replace(str(work) + "/", "") for c in cmd[3:]]]
    write_provenance(out / "PROVENANCE.md", "clip-retrieval", [
        ("clip-retrieval", pip_version(sys.executable, "clip-retrieval")), ("all_clip", pip_version(sys.executable, "all_clip")),
        ("open_clip_torch", open_clip.__version__), ("torch", torch.__version__),
        ("numpy", pip_version(sys.executable, "numpy")), ("pyarrow", pip_version(sys.executable, "pyarrow"))],
        commands, CLIP_RETRIEVAL_NOTES + "\nThe wrapper (`clip_retrieval_with_pairclean_configs.py`):\n\n" +
        "".join("    " + line + "\n" for line in CLIP_RETRIEVAL_WRAPPER.splitlines()), cwd="the repository root")


CLIP_RETRIEVAL_NOTES = """\
Input: tests/data/ecosystem/img2dataset/webdataset/{00000..00001}.tar (12 successful downloads).
Model: `pairclean-toy` (pairclean/backends/model_configs/pairclean-toy.json, 64-d embeddings) with
random weights from `torch.manual_seed(0)`, saved to `pairclean-toy-seed0.pt` and loaded by
clip-retrieval through all_clip's `open_clip:ARCH/CHECKPOINT` (all_clip/open_clip.py
`load_open_clip`: CHECKPOINT goes to open_clip's `pretrained=`, which accepts a local file). Real
CLIP weights would need the model hub, which is not reachable here; the files' layout, dtype and
normalisation are what clip-retrieval's own mapper and writer produce
(clip_retrieval/clip_inference/mapper.py: `features /= norm`, `.to(torch.float16)`;
writer.py `OutputSink`: `img_emb/img_emb_{N}.npy`, `text_emb/text_emb_{N}.npy`,
`metadata/metadata_{N}.parquet`, N zero-padded to the digits of the partition count).
`--wds_number_file_per_input_file 7 --write_batch_size 7`: clip-retrieval estimates 2 x 7 samples
and writes 2 partitions, one per tar.
The venv also needs `pip install "setuptools<81"`: clip-retrieval 2.45.0 pulls clip-anytorch, whose
clip/clip.py imports `pkg_resources`, gone from the setuptools (84.2.1) pip installs today.
"""


# -- DataComp ---------------------------------------------------------------------------------------------
# The pool is 16 rows: the 16 COCO images with their first captions. Their metadata `.parquet` and
# `.npz` hold every pool row (DataComp computed them when every image was online); 12 images are
# served, the other 4 URLs fail (404 x2, an HTML page, a server that never answers), so the shards
# img2dataset downloads hold 12 samples, like a real pool where part of the web has gone.

DATACOMP_NAME = "4d2f6a0c9e1b7d35a8c04f1e6b92d7c3"  # the hub names metadata files by a 32-hex hash
DATACOMP_DIMS = {"b32": ("ViT-B-32", 512), "l14": ("ViT-L-14", 768)}


def datacomp_uid(pair: dict) -> str:
    """A 128-bit id as 32 lower-case hex digits, DataComp's `uid` format (how they derive theirs is not
    published; here: MD5 of the COCO image id, so the fixture's uids are stable)."""
    import hashlib

    return hashlib.md5(f"coco-{pair['image_id']}".encode()).hexdigest()


def step_datacomp_embeddings(work: Path) -> None:
    """DataComp's .npz: per metadata row, CLIP image and text embeddings of ViT-B/32 (`b32_*`, 512-d)
    and ViT-L/14 (`l14_*`, 768-d), L2-normalised, float16; the metadata's clip_*_similarity_score is
    their dot product. No hub here, so the two architectures are built by open_clip with seeded
    random weights: the layout, widths, dtype and normalisation are DataComp's, the values are not."""
    import hashlib

    import numpy as np
    import open_clip
    import torch
    from PIL import Image as PILImage

    pairs = coco_pairs()
    arrays, scores = {}, {}
    for short, (arch, dim) in DATACOMP_DIMS.items():
        torch.manual_seed(0)
        model, _, preprocess = open_clip.create_model_and_transforms(arch, pretrained=None)
        tokenizer = open_clip.get_tokenizer(arch)
        model.eval()
        with torch.no_grad():
            images = torch.stack([preprocess(PILImage.open(p["path"]).convert("RGB")) for p in pairs])
            img = torch.nn.functional.normalize(model.encode_image(images).float(), dim=-1)
            txt = torch.nn.functional.normalize(model.encode_text(tokenizer([p["caption"] for p in pairs])).float(), dim=-1)
        assert img.shape[1] == dim
        arrays[f"{short}_img"] = img.numpy().astype(np.float16)
        arrays[f"{short}_txt"] = txt.numpy().astype(np.float16)
        # the published scores sit on the float16 grid (e.g. 0.233643): the dot of the stored vectors
        dot = (arrays[f"{short}_img"].astype(np.float32) * arrays[f"{short}_txt"].astype(np.float32)).sum(1)
        scores[f"clip_{short}_similarity_score"] = dot.astype(np.float16).astype(np.float32)
        del model
    pool = []
    for i, p in enumerate(pairs):
        data = p["path"].read_bytes()
        with PILImage.open(p["path"]) as im:
            width, height = im.size
        pool.append({"uid": datacomp_uid(p), "file": p["path"].name, "text": p["caption"], "original_width": width,
                     "original_height": height, **{k: float(v[i]) for k, v in scores.items()},
                     "face_bboxes": [[0.25, 0.25, 0.5, 0.5]] if i == 5 else [],
                     "sha256": hashlib.sha256(data).hexdigest()})
    folder = fresh(work / "datacomp-embeddings")
    np.savez(folder / f"{DATACOMP_NAME}.npz", **arrays)
    (folder / "pool.json").write_text(json.dumps(pool, indent=1))
    (folder / "versions.json").write_text(json.dumps({"torch": torch.__version__, "open_clip_torch": open_clip.__version__,
                                                      "numpy": np.__version__}))


def step_datacomp_shards(work: Path) -> None:
    os.environ.update(NO_ALBUMENTATIONS_UPDATE="1", WANDB_MODE="disabled")
    import img2dataset
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = fresh(HERE / "datacomp")
    pool = json.loads((work / "datacomp-embeddings" / "pool.json").read_text())
    pairs = coco_pairs()
    failing = {12: "missing-1.jpg", 13: "not-an-image.jpg", 14: None, 15: "missing-2.jpg"}  # row -> served name
    metadata_dir = out / "metadata"
    metadata_dir.mkdir()
    shutil.copy(work / "datacomp-embeddings" / f"{DATACOMP_NAME}.npz", metadata_dir / f"{DATACOMP_NAME}.npz")
    with image_server(serve_dir(work, pairs[:12])) as (base, hang, _refused):
        rows = []
        for i, row in enumerate(pool):
            name = row["file"] if i not in failing else failing[i]
            url = f"{hang}/{row['file']}" if i in failing and name is None else f"{base}/{name}"
            rows.append({"uid": row["uid"], "url": url, "text": row["text"], "original_width": row["original_width"],
                         "original_height": row["original_height"],
                         "clip_b32_similarity_score": row["clip_b32_similarity_score"],
                         "clip_l14_similarity_score": row["clip_l14_similarity_score"],
                         "face_bboxes": row["face_bboxes"], "sha256": row["sha256"]})
        schema = pa.schema([("uid", pa.string()), ("url", pa.string()), ("text", pa.string()),
                            ("original_width", pa.int64()), ("original_height", pa.int64()),
                            ("clip_b32_similarity_score", pa.float32()), ("clip_l14_similarity_score", pa.float32()),
                            ("face_bboxes", pa.list_(pa.list_(pa.float64()))), ("sha256", pa.string())])
        pq.write_table(pa.Table.from_pylist(rows, schema), metadata_dir / f"{DATACOMP_NAME}.parquet")
        shard_dir = out / "shards"
        shard_dir.mkdir()
        # download_upstream.py's call (lines 218-238 at 4a8df19), with a small image size, one process,
        # 10 samples per shard (theirs: 10000), no retries and a 2 s timeout so the hanging URL ends.
        kwargs = {"url_list": str(metadata_dir), "image_size": 64, "output_folder": str(shard_dir),
                  "processes_count": 1, "thread_count": 4, "resize_mode": "keep_ratio_largest",
                  "resize_only_if_bigger": True, "encode_format": "jpg", "output_format": "webdataset",
                  "input_format": "parquet", "url_col": "url", "caption_col": "text", "bbox_col": "face_bboxes",
                  "save_additional_columns": ["uid"], "number_sample_per_shard": 10, "oom_shard_count": 8,
                  "retries": 0, "timeout": 2, "enable_wandb": False}
        img2dataset.download(**kwargs)
    # a subset file as their README and baselines write it: structured u8,u8 (uid's high and low 64
    # bits), sorted; here the pool rows whose B/32 score is at or above the median
    table = pq.read_table(metadata_dir / f"{DATACOMP_NAME}.parquet")
    scores = np.array(table.column("clip_b32_similarity_score").to_pylist())
    uids = [u for u, s in zip(table.column("uid").to_pylist(), scores) if s >= np.median(scores)]
    subset = np.array([(int(uid[:16], 16), int(uid[16:32], 16)) for uid in uids], np.dtype("u8,u8"))
    subset.sort()
    (out / "subset").mkdir()
    np.save(out / "subset" / "b32_top_half.npy", subset)
    commands = [["img2dataset.download(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()
                 if k not in ("url_list", "output_folder")) + ", url_list='metadata', output_folder='shards')"]]
    versions = json.loads((work / "datacomp-embeddings" / "versions.json").read_text())
    write_provenance(out / "PROVENANCE.md", "DataComp", [("img2dataset", pip_version(sys.executable, "img2dataset")),
                     *versions.items()], commands, DATACOMP_NOTES)


def step_datacomp_reshard(work: Path) -> None:
    """DataComp's own resharder.py (github:mlfoundations/datacomp, copied to the scratch folder by the
    driver) on the fixture's shards with the subset file: what their filtering track's output looks
    like. It imports `wds.writer.gopen.Pipe`, gone from webdataset after 0.2.31 (their pin), hence
    its own venv."""
    out = HERE / "datacomp"
    fresh(out / "resharded")  # the resharder empties its output folder but does not create it
    cmd = [sys.executable, str(work / "resharder.py"), "-i", "shards", "-o", "resharded", "-s", "subset/b32_top_half.npy",
           "-j", "1", "--shard-size", "4"]
    run(cmd, cwd=out)
    versions = ", ".join(f"{name} {pip_version(sys.executable, name)}" for name in ("webdataset", "pysimdjson", "cloudpathlib"))
    with open(out / "PROVENANCE.md", "a") as fh:
        fh.write(f"\n## resharded/\n\nWritten by DataComp's `resharder.py` ({DATACOMP_COMMIT}), in its own venv "
                 f"({versions}; Python {sys.version.split()[0]}):\n\n    python resharder.py {' '.join(cmd[2:])}\n\n"
                 "It keeps the samples whose json `uid` is in the subset, renames them `{uid}-{j}`, writes "
                 "`{:08d}.tar` + `{:08d}_stats.json` ({\"successes\": n}), copies the subset to `sample_ids.npy` "
                 "and its arguments and counts to `meta.json`.\n")


DATACOMP_COMMIT = "mlfoundations/datacomp@4a8df1992566ef8334773f7152e1855b1f716162"
DATACOMP_NOTES = """\
Follows DataComp's code at """ + DATACOMP_COMMIT + """:

- `metadata/HASH.parquet` + `metadata/HASH.npz`: the pool metadata as download_upstream.py fetches
  it from the hub (lines 168-187: `allow_patterns="*.parquet"`, and `*.npz` with `--download_npz`,
  both into `metadata/`, one `.npz` beside each `.parquet` with the same stem). Parquet columns
  and types as the hub's datacomp_small files: `uid` string (32 hex digits, 128 bits), `url`,
  `text`, `original_width` int64, `original_height` int64, `clip_b32_similarity_score` float32,
  `clip_l14_similarity_score` float32, `face_bboxes` list<list<float64>>, `sha256` string.
  The `.npz` holds `b32_img`, `b32_txt` (N x 512), `l14_img`, `l14_txt` (N x 768), row i = parquet
  row i (baselines/apply_filter.py lines 146-166 read `df` and `np.load(f)["l14_img"]` by the same
  `path_root`, and mask both with one boolean index). Float16 and L2-normalised: the README's disk
  table (small pool: 75 GB of npz for 12.8M samples = 2 bytes x 2,560 floats + a dedup vector per
  sample) and scores on the float16 grid; DataComp's writer of these files is not public, so these
  two facts are inferred, not read from code. Real files also hold a `dedup` array (read by
  datachain's DataComp/LAION example) whose width is not documented: the fixture leaves it out.
  The embeddings are from the ViT-B-32 and ViT-L-14 architectures built by open_clip with
  `torch.manual_seed(0)` random weights (no hub here): layout and dtype are DataComp's, values not.
  `clip_*_similarity_score` = the float16 dot product of the stored vectors, stored as float32.
- `shards/`: img2dataset run by the call in download_upstream.py (lines 218-238): `input_format=
  "parquet"`, `url_col="url"`, `caption_col="text"`, `bbox_col="face_bboxes"`,
  `save_additional_columns=["uid"]`, `oom_shard_count=8` (so `00000000.tar`), `resize_mode=
  "keep_ratio_largest"`, `encode_format="jpg"`, `output_format="webdataset"`; changed for size and
  speed: `image_size=64` (512), `number_sample_per_shard=10` (10000), `processes_count=1`,
  `thread_count=4`, `retries=0` (2), `timeout=2`. The json member carries `uid` and `face_bboxes`.
  16 pool rows, 12 downloaded; 4 fail (2 x 404, an HTML page, a server that never answers), so the
  `.npz` has 16 rows and the shards 12 samples.
- `subset/b32_top_half.npy`: a subset file as the README ("Selecting samples in the filtering
  track") and baselines write it: `np.dtype("u8,u8")` structured array of (high 64 bits, low 64
  bits) of each uid, sorted, `np.save`d; here the 8 pool rows whose B/32 score is >= the median
  (some of them failed downloads, as in a real subset). resharder.py `load_subset` (lines 661-673)
  asserts `dtype == np.dtype("u8,u8")` for .npy, else reads the file as a raw memmap of that dtype;
  `process_example` (lines 913-958) parses `uid` from each sample's json with
  `divmod(int(uid, 16), 2**64)` and looks it up with `np.searchsorted`.
"""


# -- driver -------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("steps", nargs="*", help=f"any of {', '.join(STEPS)} (default: all)")
    parser.add_argument("--venvs", default="/work/venvs", help="folder holding one venv per tool")
    parser.add_argument("--torch-python", default=sys.executable,
                        help="interpreter with torch and open_clip for DataComp's embeddings (default: this one)")
    parser.add_argument("--resharder", help="datacomp's resharder.py (from github:mlfoundations/datacomp): also run it "
                        "on the DataComp shards with the subset file, in venvs/datacomp-resharder (img2dataset, webdataset==0.2.31, "
                        "pysimdjson, cloudpathlib)")
    parser.add_argument("--step", help=argparse.SUPPRESS)  # internal: run one step in this interpreter
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args()
    if args.step:
        globals()["step_" + args.step.replace("-", "_")](Path(args.work))
        return
    work = Path(args.work or os.environ.get("TMPDIR", "/tmp")) / "pairclean-ecosystem-work"
    work.mkdir(parents=True, exist_ok=True)
    unknown = sorted(set(args.steps) - set(STEPS))
    if unknown:
        parser.error(f"unknown step(s) {unknown}; choose from {', '.join(STEPS)}")
    for step in args.steps or STEPS:
        if step == "datacomp":
            subprocess.run([args.torch_python, __file__, "--step", "datacomp-embeddings", "--work", str(work)], check=True)
            python = str(Path(args.venvs) / "img2dataset" / "bin" / "python")
            subprocess.run([python, __file__, "--step", "datacomp-shards", "--work", str(work)], check=True)
            if args.resharder:
                shutil.copy(args.resharder, work / "resharder.py")
                python = str(Path(args.venvs) / "datacomp-resharder" / "bin" / "python")
                subprocess.run([python, __file__, "--step", "datacomp-reshard", "--work", str(work)], check=True)
            continue
        python = str(Path(args.venvs) / VENV_OF[step] / "bin" / "python")
        subprocess.run([python, __file__, "--step", step, "--work", str(work)], check=True)


if __name__ == "__main__":
    main()
