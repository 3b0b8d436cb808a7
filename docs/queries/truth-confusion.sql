-- Needs --truth: precision and recall of each rule against the ground-truth `noisy` labels.
SELECT rule,
       count(*) FILTER (WHERE flagged) AS flagged,
       count(*) FILTER (WHERE flagged AND noisy) AS true_positives,
       round(count(*) FILTER (WHERE flagged AND noisy) / nullif(count(*) FILTER (WHERE flagged), 0), 4) AS precision,
       round(count(*) FILTER (WHERE flagged AND noisy) / nullif(count(*) FILTER (WHERE noisy), 0), 4) AS recall
FROM (
    SELECT 'beta rule (s - beta <= 0)' AS rule, osa_noisy AS flagged, noisy FROM labeled WHERE sim IS NOT NULL
    UNION ALL
    SELECT 'GMM (p_clean < 0.5)', gmm_noisy, noisy FROM labeled WHERE sim IS NOT NULL
)
GROUP BY rule
ORDER BY rule;
