"""FastAPI + uvicorn around one learner, by role:

- `storage/`: what is kept on disk (the ingest log, checkpoints, snapshots, the latent store) and the domain errors;
- `learning/`: the learner's loop and its concerns (the worker, serving, the online score, the lag bound);
- `web/`: the HTTP face (`web.app.create_app`, the routers, input validation, the dashboard);
- here: the two programs (`python -m service`, `python -m service.replica`: the inference replica) and what every
  layer reads (`settings`, `metrics`).

Each folder imports only the ones below it (storage < learning < web), as `tests/test_imports.py` checks.
"""

__version__ = "0.3.0"
