"""The learner's loop and its concerns, apart from HTTP.

- `runtime`: the parts of one running service (database, ingest log, worker, prediction batcher), opened at start-up.
- `lineage`: which learner a data directory holds, answered once at start-up (`LearnerSpec`).
- `worker`: the one thread that drains the ingest log; beside it `serving` (what readers see), `batching` (predictions
  that arrive together share one pass), `snapshot_schedule`, `quarantine`, `forgetting`, `lag_bound`,
  `checkpointing` (when to persist) and `online` (the test-then-train score and its history).

Imports `service.storage` and the top-level `settings` and `metrics`.
"""
