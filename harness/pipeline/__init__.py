"""The pipeline every command runs: engine sessions, the baseline store, noise, metrics, thresholds, verdicts,
reports."""
