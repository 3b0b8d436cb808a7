"""Dataset access: manifests, the one reader that turns shards into rows, decoding, dataset writers."""
