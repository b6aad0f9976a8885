"""lpdiff harness: model catalog, adapters, prompt sets, runs, baseline store, metrics and verdicts."""
