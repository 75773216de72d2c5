"""The experiment programs, by role (what a user imports lives one level up: `clients.api`, `clients.onnx_client`):

- `benchmark`: the one command line (`python -m clients.bench.benchmark run | table | sweep | speed | plot`);
  `results` (result files, naming, paired comparisons) and `machine` (the device, the machine's name) every
  program shares.
- `stream/`: the in-process benchmark under the paper's protocol and what it writes: the stream and its
  evaluation, real time, the stream through a service, latents, resumable runs, sweeps, tables, plots, the offline
  references, young classes, unknowns.
- `live/`: the programs that drive a real service as devices would: a service on loopback, a client's stream,
  first use, load, soak, torture, the smoke test of a deployment.
- `cost/`: what things cost: the learner's hot paths, awake and asleep, a camera photo through the service, the
  command line, hostile images, the int8 variants.

Each folder imports only the ones before it in that list (stream < live < cost), as `tests/test_imports.py` checks.
"""
