"""The scores file contract and what reads it: schema, metadata, decision rules, truth metrics."""
