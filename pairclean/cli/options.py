"""Command-line options that mean the same in every command, defined once.

A command declares `device: options.Device = "auto"`; the help text (and the flag's spelling) lives
here, so `score`, `bench`, `train` and `corrupt` cannot drift apart. The dataset options (pair
kind, format, split, image root, which member or column holds each side of a pair, label
template, `pipe:` permission) come as one bundle, stacked on a command by a plain decorator as
sqlite-utils stacks its `output_options`: a command decorated with `@dataset_options` takes `ctx:
typer.Context` and reads what was given as one `DatasetOptions` with `dataset_given(ctx)`, which
opens the dataset (`open(source)`); typer builds the options from their declaration
(`borrowed_options`), and the command's own signature is never rewritten. `flag_for` is how the
CLI words the library's config fields.
"""

from __future__ import annotations

import os

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import List, Optional

import typer
from typing_extensions import Annotated

# Config fields whose command-line flag is not their name with dashes.
FLAGS = {"rules": "--rule", "layout": "--embedding-layout", "left_field": "--left-emb-field",
         "right_field": "--right-emb-field"}


def flag_for(field: str) -> str:
    """The command-line flag of a config field: the library says `batch_size`, the CLI `--batch-size`."""
    return FLAGS.get(field) or "--" + field.replace("_", "-")


Source = Annotated[List[str], typer.Argument(
    metavar="SHARDS", help="Shards: directory, glob, brace pattern, list file, Parquet files, or a manifest YAML; "
                            "img2dataset, Hugging Face datasets and DataComp layouts are recognised.")]
Pair = Annotated[Optional[str], typer.Option(help="Pair kind: image-text, text-text, image-label, image-image.")]
AllowPipe = Annotated[bool, typer.Option(help="Allow `pipe:` shard URLs, which run shell commands.")]
AllowOtherDataset = Annotated[bool, typer.Option(
    "--allow-other-dataset", help="Use the scores (or embeddings) with data whose files differ from the ones they "
                                  "recorded: another download or copy, or files changed since scoring (each row must "
                                  "still be the pair its key names).")]
Device = Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:1 ...")]
Precision = Annotated[str, typer.Option(
    help="fp32, bf16 (autocast), fp16 (CUDA only), or auto (bf16/fp16 on CUDA, bf16 on CPUs with native bf16, else fp32).")]
Pretrained = Annotated[Optional[str], typer.Option(
    help="Pretrained tag, local checkpoint path, or 'none' (random init). Default: the model's own weights "
         "(openai for an open_clip architecture, the repository's for hf-hub:ORG/REPO).", show_default=False)]
Backend = Annotated[str, typer.Option(
    help="Encoder backend: open_clip (images and text), sentence-transformers (text-text pairs), or auto "
         "(from the model name; a name open_clip does not know is a sentence-transformers model on text pairs).")]
Decode = Annotated[str, typer.Option(
    help="fast (JPEG draft decode at model size, torch's resize: within 2 grey levels of the model's own), exact "
         "(the model's own preprocessing: PIL's full decode and resize), or the CUDA device's part (CPU workers otherwise): "
         "gpu (torchvision nvJPEG), nvimgcodec or dali (NVIDIA's libraries: pip install 'pairclean[gpu]'), or "
         "gpu-resize (the workers decode as fast does, the device resizes and crops).")]
Workers = Annotated[str, typer.Option(
    help="DataLoader workers decoding and tokenising: a number, or auto (on a CUDA device every usable core but two, "
         "shared among a node's ranks, 6 at most where a device decoder takes every JPEG; elsewhere 2; a resumed "
         "training run keeps its number).")]


def file_named(value: Path | str | None) -> Path | str | None:
    """An option that names a file to write (a path, or an object-store URL): refused, before
    anything runs, when it has no file name (`--out ''`, `--out .`, `--out ..`, `s3://bucket/`: a
    directory; a named directory is the output guard's to refuse, saying which input it would contain)."""
    name = value.name if isinstance(value, Path) else os.path.basename(str(value))
    if value is not None and name in ("", ".", ".."):
        raise typer.BadParameter(f"names no file ({str(value)!r} is a directory): give the file to write, "
                                 "e.g. scores.parquet")
    return value


def workers_given(text: str) -> int | None:
    """--workers as the config takes it: auto -> None (the run decides: `backends.device_jpeg.auto_workers`),
    else a whole number >= 0."""
    from pairclean.config import Declared, at_least, parse_value

    return None if text.strip().lower() == "auto" else parse_value(text, Declared(int, at_least(0)), "workers")


CpuDecodeShare = Annotated[float, typer.Option(
    help="With a device decoder (--decode gpu, nvimgcodec, dali): the share of the JPEGs, 0-1, that the CPU workers "
         "decode instead (the GPU still resizes them), picked by each file's content so a file always takes the same "
         "way; where the device's decoder is the bound and cores are idle. Pinned by a run (the two ways' pixels "
         "differ slightly).")]
Compile = Annotated[bool, typer.Option("--compile", help="torch.compile the model: one shape a tower, CUDA graphs on CUDA (first batches slower; eager if compiling fails).")]
BetaMode = Annotated[str, typer.Option(help="random-inputs, shuffled, or fixed.")]
BetaK = Annotated[int, typer.Option(help="K random inputs per side for --beta-mode random-inputs.")]
BetaCache = Annotated[bool, typer.Option(help="Reuse a random-inputs beta computed before for the same weights, K and seed.")]
JsonOut = Annotated[Optional[Path], typer.Option("--json", help="Also write the result as JSON.")]

# How the dataset is read: its format (detected from the files), a split, where image paths start.
InputFormat = Annotated[Optional[str], typer.Option(
    help="Input format (default: detected from the files): webdataset, parquet, img2dataset-webdataset, "
         "img2dataset-parquet, datacomp-shards, hf-parquet.")]
Split = Annotated[Optional[str], typer.Option(help="Hugging Face datasets layouts: read this split only (default: all).")]
ImageRoot = Annotated[Optional[str], typer.Option(
    help="Where relative image paths start (default: the Parquet file's folder; a Hugging Face dataset's root).")]
# Which member (tar) or column (Parquet) holds each side of a pair: DatasetSpec.fields overrides.
ImageField = Annotated[Optional[str], typer.Option(help="Image member extensions (';'-separated) or Parquet image column.")]
ImagePathField = Annotated[Optional[str], typer.Option(help="Parquet column of image paths relative to --image-root.")]
TextField = Annotated[Optional[str], typer.Option(help="Caption member extension or Parquet column.")]
JsonTextKey = Annotated[Optional[str], typer.Option(help="Caption key inside a json member.")]
KeyField = Annotated[Optional[str], typer.Option(help="Key: Parquet column; tar: __key__ or a key of the json member (uid).")]
Text2Field = Annotated[Optional[str], typer.Option(help="text-text pairs: second text member or Parquet column.")]
Image2Field = Annotated[Optional[str], typer.Option(
    help="image-image pairs: second image member extensions or Parquet bytes column.")]
Image2PathField = Annotated[Optional[str], typer.Option(help="image-image pairs: Parquet column of second-image paths.")]
LabelField = Annotated[Optional[str], typer.Option(help="image-label pairs: label member or Parquet column.")]
LabelTemplate = Annotated[Optional[str], typer.Option(
    help='image-label pairs: the sentence a label becomes (default "This is a picture of {label}.").')]


@dataclass
class DatasetOptions:
    """What a command was told about its dataset: the pair kind, its format, split and image root,
    which member or column holds each side of a pair (`fields`: DatasetSpec.fields attributes given
    on the command line), the label template, and whether `pipe:` URLs may run."""

    pair: str | None = None
    fields: dict[str, str] = field(default_factory=dict)
    label_template: str | None = None
    allow_pipe: bool = False
    format: str | None = None
    split: str | None = None
    image_root: str | None = None

    def given_fields(self):
        from pairclean.data.spec import Fields

        return Fields(**self.fields) if self.fields else None

    def options(self, pair: str | None = None) -> dict:
        """These options as `reopen_dataset` / the report's and audit's `dataset_options` take them."""
        return {"pair": pair or self.pair, "allow_pipe": self.allow_pipe, "label_template": self.label_template,
                "format": self.format, "split": self.split, "image_root": self.image_root}

    def open(self, source: list[str], pair: str | None = None):
        """The dataset `source` names, with these options applied (`pair` overrides the option)."""
        from pairclean.data.dataset import open_dataset

        return open_dataset(source, pair=pair or self.pair, fields=self.given_fields(), allow_pipe=self.allow_pipe,
                            label_template=self.label_template, format=self.format, split=self.split,
                            image_root=self.image_root)

    def reopen(self, record, source: list[str] | None = None, pair: str | None = None):
        """The dataset a scores file recorded (`data.record.DatasetRecord`, or `source`, read with the
        recorded mapping), these options applied; None when there is neither."""
        from pairclean.data.dataset import reopen_dataset

        if not source and not record:
            return None
        return reopen_dataset(record, source or None, self.given_fields(), **self.options(pair))


# -- options a command stacks on with a decorator -------------------------------------------------

STACKED = "__pairclean_options__"  # a command function's stacked option providers (`cli.app.Command` adds them)


def borrowed_options(declaration, meta_key: str) -> list:
    """The options `declaration` declares the typer way (its parameters' annotations and defaults),
    built once by typer itself, for another command: each option's value goes to
    ctx.meta[meta_key][its name], never to the command function (so no signature is rewritten)."""
    def store(ctx, param, value):
        ctx.meta.setdefault(meta_key, {})[param.name] = value
        return value

    holder = typer.Typer(add_completion=False)
    holder.command()(declaration)
    params = list(typer.main.get_command(holder).params)
    for param in params:
        param.expose_value, param.callback = False, store
    return params


def stack(provider):
    """A decorator adding the options `provider()` builds to a command, as `@click.option` stacks
    one (sqlite-utils' `output_options`): `@app.command(...)` above it, the function unchanged."""
    def decorate(command):
        command.__dict__.setdefault(STACKED, []).append(provider)
        return command

    return decorate


DATASET_GIVEN = "pairclean_dataset_options"  # ctx.meta key: {option name: value}
# option name -> the `Fields` attribute it sets (the other options are DatasetOptions attributes)
FIELD_OPTIONS = {"image_field": "image", "image_path_field": "image_path", "text_field": "text",
                 "json_text_key": "json_text_key", "key_field": "key", "text2_field": "text2",
                 "image2_field": "image2", "image2_path_field": "image2_path", "label_field": "label"}


def _dataset_declaration(
    pair: Pair = None, input_format: InputFormat = None, split: Split = None, image_root: ImageRoot = None,
    image_field: ImageField = None, image_path_field: ImagePathField = None, text_field: TextField = None,
    json_text_key: JsonTextKey = None, key_field: KeyField = None, text2_field: Text2Field = None,
    image2_field: Image2Field = None, image2_path_field: Image2PathField = None, label_field: LabelField = None,
    label_template: LabelTemplate = None, allow_pipe: AllowPipe = False,
) -> None:
    """The dataset options, in the order the help lists them (never called: `dataset_options` borrows them)."""


@lru_cache(maxsize=1)
def _dataset_parameters() -> tuple:
    return tuple(borrowed_options(_dataset_declaration, DATASET_GIVEN))


dataset_options = stack(_dataset_parameters)
dataset_options.__doc__ = """Stack the dataset options on a command: --pair, --input-format, --split,
--image-root, the nine --*-field options, --label-template and --allow-pipe. The command takes
`ctx: typer.Context` and reads them with `dataset_given(ctx)`."""


def dataset_given(ctx) -> DatasetOptions:
    """What the command line said about the dataset (the options of `@dataset_options`)."""
    given = ctx.meta.get(DATASET_GIVEN, {})
    fields = {attribute: given[name] for name, attribute in FIELD_OPTIONS.items() if given.get(name) is not None}
    return DatasetOptions(given.get("pair"), fields, given.get("label_template"), bool(given.get("allow_pipe")),
                          given.get("input_format"), given.get("split"), given.get("image_root"))


Attach = Annotated[Optional[List[str]], typer.Option(
    "--attach", help="NAME=FILE: a read-only table the SQL may read, e.g. img2dataset's metadata "
                     "(meta='out/*.parquet') or a key list (.txt, .npy); repeatable. No other file is readable.")]
