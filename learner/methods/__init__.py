"""The methods: one `observe` step per incoming batch, one method a file.

- `base`: the common frame (`ContinualLearner`: a model, its optimizer (plain SGD or Adam), growing classes from
  `classes`, and what it serves); `registry`: every method of the paper as a combination of parts,
  with the paper's hyperparameters (`make_learner`, `METHODS`).
- `replay`: experience replay with a memory update and a retrieval policy (ER, MIR, GSS, ASER and
  the rest); `objective` the loss and step form a replay step minimises; `augment` its batch
  augmentation.
- `agem`, `ewc`, `finetune`, `stream_head` (a streaming head alone on the frozen features): the
  other methods.

Imports `learner.networks`, `learner.memory` and `learner.heads`.
"""
