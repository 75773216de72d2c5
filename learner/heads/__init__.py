"""What answers a prediction: the served weights and the heads on top of them.

- `serving`: the served weights (the moving average of `ema`, or its copy corrected on the
  memory), their features, the served head, predictions.
- `streaming_lda` (streaming LDA on the frozen features), `ncm` (nearest class mean on the memory),
  `bias_correction` (a logit bias fitted on the memory): the heads besides the trained one.
- `head_choice`: which head answers each class, as the stream measures it; `held_back`: the samples
  no head trains on that it may measure on instead.
- `calibration`: probabilities that mean what they say, and "none of these"; `recent_features`: the latest
  trained samples of each class, scored out of sample for its threshold.

Imports `learner.networks` only.
"""
