"""Precomputed embeddings, a source of their own beside the datasets of pairs:

    layouts.py   the layouts (clip-retrieval, numpy, parquet-embeddings, datacomp-npz): one
                 contract, one registry, and `open_embeddings`, which returns an immutable source
    source.py    `EmbeddingSource`: what was opened (arrays or files, fields, dimension, the pairs
                 they describe), its units and batches
    batches.py   rows as readers get them: `EmbeddingBatch`, in memory or read block by block
    npy.py       .npy data (files, or members of an uncompressed .npz) read in place
    saved.py     clip-retrieval's layout as `score --save-embeddings` writes it, and its provenance.json
"""

from pairclean.data.embeddings.batches import BLOCK_ROWS, ArrayRows, EmbeddingBatch, NpyRows
from pairclean.data.embeddings.layouts import LAYOUTS, EmbeddingLayout, open_embeddings
from pairclean.data.embeddings.npy import NpyFiles, NpyPair
from pairclean.data.embeddings.saved import (SAVED_PROVENANCE, UNFINISHED, SavedBeta, SavedBlock, SavedEmbeddings,
                                             read_saved_provenance, write_embedding_block, write_embeddings)
from pairclean.data.embeddings.source import EmbeddingSource

__all__ = ["BLOCK_ROWS", "LAYOUTS", "SAVED_PROVENANCE", "UNFINISHED", "SavedBeta", "SavedBlock", "SavedEmbeddings",
           "ArrayRows", "EmbeddingBatch", "EmbeddingLayout",
           "EmbeddingSource", "NpyFiles", "NpyPair", "NpyRows", "open_embeddings", "read_saved_provenance",
           "write_embedding_block", "write_embeddings"]
