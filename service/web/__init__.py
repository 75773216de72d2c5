"""The HTTP face of the service.

- `app`: `create_app`, the routers over one `service.learning.runtime.Runtime`; `routers/`: one per concern, the
  request bodies, the tokens and the mapping of domain errors to status codes.
- `inputs`: validation of what clients send; `guard`: the Host and Origin checks before any route; `server`: what
  uvicorn needs besides the app; `static/`: the dashboard's page, script and style.

Imports `service.learning`, `service.storage` and the top-level `settings` and `metrics`.
"""
