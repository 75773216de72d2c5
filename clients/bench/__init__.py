"""The experiment programs: the benchmark (run, table, sweep, speed), the load, torture, soak and
smoke programs against a live service, and what they share (results, resumable runs, a service on
loopback). What a user imports lives one level up: `clients.api` and `clients.onnx_client`."""
