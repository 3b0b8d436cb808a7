"""Input formats: one class per way pairs are stored, found by a registry.

    webdataset              tar shards                           (formats/webdataset.py)
    parquet                 Parquet files, one row per pair      (formats/parquet.py)
    img2dataset-webdataset  img2dataset's tars + sidecars        (formats/img2dataset.py)
    datacomp-shards         the same, keyed by DataComp's uid    (formats/img2dataset.py)
    img2dataset-parquet     img2dataset's Parquet output         (formats/img2dataset.py)
    hf-parquet              Hugging Face `datasets` Parquet      (formats/hf.py)

`detect` asks each format, most specific first, whether a list of files is its layout; a
`DatasetSpec` names its format and `data.dataset.Dataset` binds it to the object that reads it.
Precomputed embeddings are another contract, with their own registry (`data.embeddings`).
Nothing outside `data/` branches on a format's name (tests/test_formats.py holds that).
"""

from pairclean.data.formats.base import (REGISTRY, Claim, InputFormat, detect, directory_files, format_named,
                                         register_format)
from pairclean.data.formats import webdataset, parquet, img2dataset, hf  # noqa: F401,E402  (they register)

__all__ = ["REGISTRY", "Claim", "InputFormat", "detect", "directory_files", "format_named", "register_format"]
