-- 20 equal-width bins of cosine similarity, drawn as text bars.
WITH bounds AS (SELECT min(sim) AS lo, max(sim) AS hi FROM scores),
binned AS (
    SELECT least(floor((sim - lo) / ((hi - lo) / 20)), 19)::INTEGER AS bin, count(*) AS pairs
    FROM scores, bounds
    WHERE sim IS NOT NULL
    GROUP BY bin
)
SELECT bin,
       round(lo + bin * (hi - lo) / 20, 4) AS sim_from,
       round(lo + (bin + 1) * (hi - lo) / 20, 4) AS sim_to,
       pairs,
       bar(pairs, 0, max(pairs) OVER (), 30) AS histogram
FROM binned, bounds
ORDER BY bin;
