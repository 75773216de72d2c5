"""The replay memory and what decides who stays in it and who is replayed.

- `buffer`: the memory M itself (fixed capacity, preallocated, a feature cache per slot); `latent`
  the features of its slots.
- `policy`: the two swappable halves of a replay method, MemoryUpdate and MemoryRetrieval.
- `update` (reservoir, KNN-SV, GSS), `balanced` (CBRS admission, a victim rule within the class),
  `retrieval` (random, MIR, ASV / ASV_mu, Dist): the policies; `shapley` the exact KNN Shapley
  values (equations 3-4) they share; `sampling` the random subsets they draw.

Imports `learner.networks` only.
"""
