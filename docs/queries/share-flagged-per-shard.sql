-- Share of scored pairs each rule flags, per shard, worst shard first.
SELECT shard,
       count(*) AS pairs,
       count(error) AS errors,
       round(avg(osa_noisy::INT) FILTER (WHERE sim IS NOT NULL), 4) AS share_flagged_beta,
       round(avg(gmm_noisy::INT) FILTER (WHERE sim IS NOT NULL), 4) AS share_flagged_gmm,
       round(avg(weight) FILTER (WHERE sim IS NOT NULL), 5) AS mean_weight
FROM scores
GROUP BY shard
ORDER BY share_flagged_gmm DESC, shard;
