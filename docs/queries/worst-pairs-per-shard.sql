-- The 3 lowest-similarity pairs of every shard: mismatches often cluster by source.
SELECT shard, "index", key, sim, p_clean, weight
FROM scores
WHERE sim IS NOT NULL
QUALIFY row_number() OVER (PARTITION BY shard ORDER BY sim, "index") <= 3
ORDER BY shard, sim;
