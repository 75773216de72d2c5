"""ASER and the baselines of "Online Class-Incremental Continual Learning with Adversarial
Shapley Value" (Shim, Mai et al., AAAI 2021), as an online, one-batch-at-a-time learner."""

from .base import ContinualLearner
from .buffer import ReplayBuffer
from .metrics import average_accuracy, average_forgetting
from .methods import METHODS, PAPER_SETTINGS, make_learner
from .model import ReducedResNet18
from .shapley import knn_shapley

__all__ = [
    "ContinualLearner",
    "ReplayBuffer",
    "ReducedResNet18",
    "knn_shapley",
    "make_learner",
    "METHODS",
    "PAPER_SETTINGS",
    "average_accuracy",
    "average_forgetting",
]
