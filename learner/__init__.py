"""ASER and the baselines of "Online Class-Incremental Continual Learning with Adversarial
Shapley Value" (Shim, Mai et al., AAAI 2021), as an online, one-batch-at-a-time learner.

The names below load their modules (and torch) on first use, so that torch-free modules of
the package (`learner.formats.snapshot`) can be imported without torch.
"""

from importlib import import_module

_HOMES = {
    "ContinualLearner": ".methods.base",
    "ReplayBuffer": ".memory.buffer",
    "ReducedResNet18": ".networks.reduced_resnet",
    "knn_shapley": ".memory.shapley",
    "make_learner": ".methods.registry",
    "METHODS": ".methods.registry",
    "PAPER_SETTINGS": ".methods.registry",
    "average_accuracy": ".metrics",
    "average_forgetting": ".metrics",
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'learner' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name], __name__), name)
