"""What things cost, measured into `results/` with the command that produced the numbers.

- `speed`: the learner's hot paths; `awake_cost` and `sleep_cost`: the learner and the service awake beside a
  sleeping configuration; `service_cost`: a camera photo through the service; `cli_cost`: `aser add` against it.
- `image_costs`: what one hostile image costs the input rule; `int8_frozen`, `int8_snapshot`: the int8 variants.

Imports `stream`, `live` and the top-level `results`, `machine` and `benchmark`.
"""
