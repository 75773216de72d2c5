"""The networks: what a learner trains and what its memory stores.

- `reduced_resnet`: the paper's reduced ResNet18 (nf=20), trained whole from random weights.
- `lite0`: EfficientNet-Lite0 with its ImageNet weights, split at a cut; `frozen_runtime` runs its
  frozen part in onnxruntime.
- `backbone`: the two behind one interface (`make_backbone`): what the memory keeps (pixels or
  latents) and what trains.

Imports nothing else of `learner`.
"""
