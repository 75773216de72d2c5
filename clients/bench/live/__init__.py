"""Programs that drive a real service over HTTP, as devices would.

- `local_service`: a service (or replica) as a child process on loopback: start, wait, stop, SIGKILL.
- `client_stream`: a real client's view of a Split stream; `first_use`: the README's first photos.
- `load`, `soak`, `torture`: throughput and latency, weeks in minutes, concurrent use under SIGKILLs.
- `smoke`: a deployed learner and its replicas checked through their APIs alone.

Imports `stream` and the top-level `results` and `machine`.
"""
