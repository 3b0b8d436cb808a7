"""Copying a dataset in its own shape (filter's kept samples, corrupt's changed captions), one
`Rewriter` per format that can be copied (`base.py`: the protocol and its registry):

    tar.py          WebDataset tar shards: members byte for byte
    parquet.py      Parquet files (Hugging Face datasets' too): rows re-packed into row groups
    img2dataset.py  img2dataset output: the sidecars and stats beside each file written
"""

from pairclean.data.rewriting.base import (Decisions, KeptRows, NextCaption, Rewriter, Written, rewriter_for,
                                           rewrites)
from pairclean.data.rewriting import tar, parquet, img2dataset  # noqa: F401,E402  (they register)

__all__ = ["Decisions", "KeptRows", "NextCaption", "Rewriter", "Written", "rewriter_for", "rewrites"]
