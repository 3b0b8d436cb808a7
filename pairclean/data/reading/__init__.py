"""Reading stored pairs, as small stages that compose (webdataset's tariterators.py is the model):

    inputs.py    a name -> a readable stream: local files and `pipe:` commands through
                 webdataset's gopen, any other URL through fsspec; Parquet files opened likewise
    tar.py       a tar shard -> its members (one member-skip rule) -> samples (one grouping rule)
                 -> RawPairs; the same members and samples copied as stored (filter, corrupt) or
                 listed by size from the headers alone (counts, keys, filter's dry run)
    parquet.py   a Parquet file -> its row groups (the units) -> rows -> RawPairs
    values.py    one stored value -> one side of a pair: text decoded and cut, image bytes from a
                 member, a column, a Hugging Face Image struct or a path under the dataset root

Each stage yields what it read and, last, a `spec.UnitFailure` when its input broke (a truncated
tar, a vanished file, an unreadable Parquet): the rows before the break are kept, and the caller's
error policy decides (like webdataset's `handler=`). The input formats (`data.formats`) compose
these stages; nothing here knows a format.
"""
