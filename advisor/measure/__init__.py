"""`servegate bench`: SLO benchmark harness (datasets, arrivals, targets, metrics)."""
