"""What the service keeps on disk, and the domain errors it refuses with.

- `db`: the one SQLite database and its discipline across threads; `durable`: files whole or absent after a crash.
- `store`: the ingest log (every acknowledged sample, in arrival order); `retention`: its disk kept bounded.
- `checkpoints`: the learner's lineage (weights, memory, `trained_upto`); `snapshots`: the ONNX snapshots;
  `latent_store`: a sleep's compressed latents.
- `errors`: what storage and the worker refuse (no HTTP here; `service.web.routers.errors` maps them to statuses).

Imports nothing of the service but the package's version.
"""
