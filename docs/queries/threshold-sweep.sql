-- How many pairs a `--where "p_clean >= T"` filter keeps, for T from 0.1 to 0.9.
SELECT t AS p_clean_at_least,
       count(*) FILTER (WHERE p_clean >= t) AS kept,
       round(count(*) FILTER (WHERE p_clean >= t) / count(*), 4) AS share_kept
FROM scores, (SELECT unnest(range(1, 10)) / 10 AS t)
GROUP BY t
ORDER BY t;
