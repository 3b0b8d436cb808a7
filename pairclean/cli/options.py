"""Command-line options that mean the same in every command, defined once.

A command declares `device: options.Device = "auto"`; the help text (and the flag's spelling) lives
here, so `score`, `bench`, `train` and `corrupt` cannot drift apart. The dataset options (pair
kind, which member or column holds each side of a pair, label template, `pipe:` permission) come
as one bundle: a command decorated with `@with_dataset` declares `dataset: DatasetOptions` and
builds its DatasetSpec with `dataset.spec(source)`. `flag_for` is how the CLI words the library's
config fields.
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import dataclass, field
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
    help="fast (JPEG draft decode at model size), exact, or a decoder on the CUDA device (CPU workers otherwise): "
         "gpu (torchvision nvJPEG), nvimgcodec or dali (NVIDIA's libraries: pip install 'pairclean[gpu]').")]
Compile = Annotated[bool, typer.Option("--compile", help="torch.compile the model (first batches slower; eager if compiling fails).")]
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

# The dataset options, in the order the help lists them: parameter -> (type, default, Fields attribute).
DATASET_OPTIONS = {
    "pair": (Pair, None, None), "input_format": (InputFormat, None, None), "split": (Split, None, None),
    "image_root": (ImageRoot, None, None), "image_field": (ImageField, None, "image"),
    "image_path_field": (ImagePathField, None, "image_path"), "text_field": (TextField, None, "text"),
    "json_text_key": (JsonTextKey, None, "json_text_key"), "key_field": (KeyField, None, "key"),
    "text2_field": (Text2Field, None, "text2"), "image2_field": (Image2Field, None, "image2"),
    "image2_path_field": (Image2PathField, None, "image2_path"), "label_field": (LabelField, None, "label"),
    "label_template": (LabelTemplate, None, None), "allow_pipe": (AllowPipe, False, None),
}


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
        from pairclean.data.manifest import Fields

        return Fields(**self.fields) if self.fields else None

    def options(self, pair: str | None = None) -> dict:
        """These options as `reopen_dataset` / the report's and audit's `dataset_options` take them."""
        return {"pair": pair or self.pair, "allow_pipe": self.allow_pipe, "label_template": self.label_template,
                "format": self.format, "split": self.split, "image_root": self.image_root}

    def spec(self, source: list[str], pair: str | None = None):
        """The DatasetSpec of `source` with these options applied (`pair` overrides the option)."""
        from pairclean.data.manifest import open_dataset

        return open_dataset(source, pair=pair or self.pair, fields=self.given_fields(), allow_pipe=self.allow_pipe,
                            label_template=self.label_template, format=self.format, split=self.split,
                            image_root=self.image_root)

    def reopen(self, record, source: list[str] | None = None, pair: str | None = None):
        """The dataset a scores file recorded (`data.record.DatasetRecord`, or `source`, read with the
        recorded mapping), these options applied; None when there is neither."""
        from pairclean.data.manifest import reopen_dataset

        if not source and not record:
            return None
        return reopen_dataset(record, source or None, self.given_fields(), **self.options(pair))


Attach = Annotated[Optional[List[str]], typer.Option(
    "--attach", help="NAME=FILE: a read-only table the SQL may read, e.g. img2dataset's metadata "
                     "(meta='out/*.parquet') or a key list (.txt, .npy); repeatable. No other file is readable.")]


GIVEN = DatasetOptions()  # the default a command writes for `dataset`: @with_dataset fills it from the command line


def with_dataset(command):
    """Give a command the dataset options, declared here once: its parameter `dataset:
    DatasetOptions` stands on the command line for --pair, the nine --*-field options,
    --label-template and --allow-pipe, and receives them as one object."""
    hints = typing.get_type_hints(command, include_extras=True)
    signature = inspect.signature(command)
    parameters = []
    for parameter in signature.parameters.values():
        if parameter.name == "dataset":
            parameters += [inspect.Parameter(name, parameter.kind, default=default, annotation=kind)
                           for name, (kind, default, _) in DATASET_OPTIONS.items()]
        else:
            parameters.append(parameter.replace(annotation=hints[parameter.name]))

    @functools.wraps(command)
    def run(**given):
        options = {name: given.pop(name) for name in DATASET_OPTIONS}
        fields = {attribute: options[name] for name, (_, _, attribute) in DATASET_OPTIONS.items()
                  if attribute is not None and options[name] is not None}
        dataset = DatasetOptions(options["pair"], fields, options["label_template"], options["allow_pipe"],
                                 options["input_format"], options["split"], options["image_root"])
        return command(**given, dataset=dataset)

    run.__signature__ = signature.replace(parameters=parameters)
    run.__annotations__ = {p.name: p.annotation for p in parameters}
    return run
