"""The in-process benchmark under the paper's protocol (`benchmark run`), and what it writes and reads.

- `protocol`: one run (the tasks' stream, each sample once, the accuracy matrix, the result record); `realtime`:
  the stream that does not wait (`--stream-rate`); `via_service`: the same stream through a running service.
- `latents`: a dataset through a frozen backbone, once; `resume`: a run longer than its process.
- `sweep`: every combination of a grid, resumable; `tables` and `plots`: what the results become.
- `reference`: the offline references; `young`: a young service's first tasks; `unknowns`: "none of these".

Imports the top-level `results` and `machine` only.
"""
