"""Command-line options that mean the same in every command, defined once.

A command declares `pair: options.Pair = None`; the help text (and the flag's spelling) lives
here, so `score`, `bench`, `train` and `corrupt` cannot drift apart. The dataset options (which
member or column holds each side of a pair) come with `dataset()`, which applies them.
"""

from __future__ import annotations

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
    help="Shards: directory, glob, brace pattern, list file, Parquet files, or a manifest YAML.")]
Pair = Annotated[Optional[str], typer.Option(help="Pair kind: image-text, text-text, image-label, image-image.")]
AllowPipe = Annotated[bool, typer.Option(help="Allow `pipe:` shard URLs, which run shell commands.")]
Device = Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:1 ...")]
Precision = Annotated[str, typer.Option(
    help="fp32, bf16 (autocast), fp16 (CUDA only), or auto (bf16/fp16 on CUDA, bf16 on CPUs with native bf16, else fp32).")]
Pretrained = Annotated[str, typer.Option(help="Pretrained tag, local checkpoint path, or 'none' (random init).")]
Backend = Annotated[str, typer.Option(
    help="Encoder backend: open_clip (images and text) or sentence-transformers (text-text pairs).")]
Decode = Annotated[str, typer.Option(
    help="fast (JPEG draft decode at model size), exact, or gpu (JPEGs decoded on the CUDA device; CPU workers otherwise).")]
Compile = Annotated[bool, typer.Option("--compile", help="torch.compile the model (first batches slower; eager if compiling fails).")]
BetaMode = Annotated[str, typer.Option(help="random-inputs, shuffled, or fixed.")]
BetaK = Annotated[int, typer.Option(help="K random inputs per side for --beta-mode random-inputs.")]
BetaCache = Annotated[bool, typer.Option(help="Reuse a random-inputs beta computed before for the same weights, K and seed.")]
JsonOut = Annotated[Optional[Path], typer.Option("--json", help="Also write the result as JSON.")]

# Which member (tar) or column (Parquet) holds each side of a pair: DatasetSpec.fields overrides.
ImageField = Annotated[Optional[str], typer.Option(help="Image member extensions (';'-separated) or Parquet bytes column.")]
ImagePathField = Annotated[Optional[str], typer.Option(help="Parquet column of image paths relative to the file.")]
TextField = Annotated[Optional[str], typer.Option(help="Caption member extension or Parquet column.")]
JsonTextKey = Annotated[Optional[str], typer.Option(help="Caption key inside a json member.")]
KeyField = Annotated[Optional[str], typer.Option(help="Parquet id column.")]
Text2Field = Annotated[Optional[str], typer.Option(help="text-text pairs: second text member or Parquet column.")]
Image2Field = Annotated[Optional[str], typer.Option(
    help="image-image pairs: second image member extensions or Parquet bytes column.")]
Image2PathField = Annotated[Optional[str], typer.Option(help="image-image pairs: Parquet column of second-image paths.")]
LabelField = Annotated[Optional[str], typer.Option(help="image-label pairs: label member or Parquet column.")]
LabelTemplate = Annotated[Optional[str], typer.Option(
    help='image-label pairs: the sentence a label becomes (default "This is a picture of {label}.").')]


def dataset(source: list[str], pair: str | None = None, allow_pipe: bool = False, label_template: str | None = None,
            **fields: str | None):
    """The DatasetSpec of `source` with the field options given on the command line applied
    (`image=`, `image_path=`, `text=`, `json_text_key=`, `key=`, `text2=`, `image2=`, `image2_path=`, `label=`)."""
    from pairclean.data.manifest import Fields, open_dataset

    spec = open_dataset(source, pair=pair, allow_pipe=allow_pipe, label_template=label_template)
    given = {name: value for name, value in fields.items() if value is not None}
    if given:
        spec.fields = Fields(**{**spec.fields.__dict__, **given})
    return spec
