"""Consumers of a scores file: query, filter / re-shard, report."""
