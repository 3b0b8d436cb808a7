"""Input formats: one class per way pairs (or their embeddings) are stored, found by a registry.

    webdataset              tar shards                           (formats/webdataset.py)
    parquet                 Parquet files, one row per pair      (formats/parquet.py)
    img2dataset-webdataset  img2dataset's tars + sidecars        (formats/img2dataset.py)
    datacomp-shards         the same, keyed by DataComp's uid    (formats/img2dataset.py)
    img2dataset-parquet     img2dataset's Parquet output         (formats/img2dataset.py)
    hf-parquet              Hugging Face `datasets` Parquet      (formats/hf.py)
    clip-retrieval, numpy, parquet-embeddings, datacomp-npz     precomputed embeddings (formats/embeddings.py)

`detect` asks each pair format, most specific first, whether a list of files is its layout; a
`DatasetSpec` names its format and `spec.input_format` is the object that reads it. Nothing
outside `data/` branches on a format's name (tests/test_formats.py holds that).
"""

from pairclean.data.formats.base import (REGISTRY, Claim, Decisions, InputFormat, KeptRows, Written, detect,
                                         directory_files, format_named, format_names, register_format)
from pairclean.data.formats import webdataset, parquet, img2dataset, hf, embeddings  # noqa: F401,E402  (they register)

__all__ = ["REGISTRY", "Claim", "Decisions", "InputFormat", "KeptRows", "Written", "detect", "directory_files",
           "format_named", "format_names", "register_format"]
