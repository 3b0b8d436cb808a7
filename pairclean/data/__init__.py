"""Dataset access, the only code that opens a shard: the spec (plain data), reading stages, the input
formats, the `Dataset` that binds a spec to its format, copying a dataset, precomputed embeddings,
decoding and writing datasets. Ground first: spec < reading < formats < patterns, manifest <
dataset < rewriting, embeddings (no import cycle: tests/test_layers.py)."""
