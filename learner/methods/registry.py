"""Every method of the paper, built from the parts, with the paper's hyperparameters.

>>> learner = make_learner("aser-mu", num_classes=10, mem_size=1000)
>>> learner.name, learner.update_policy.k, learner.update_policy.per_class
('replay[knn-sv+asv-mu]', 3, 9)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory.balanced import VICTIM_RULES, ClassBalancedUpdate
from ..memory.balanced import update_name as balanced_name
from ..memory.retrieval import ASVRetrieval, DistRetrieval, MIRRetrieval, OldClassesBy, RandomRetrieval, WithinClassesBy
from ..memory.update import GSSGreedyUpdate, KNNShapleyUpdate, ReservoirUpdate
from .agem import AGEM
from .augment import make_augment
from .base import ContinualLearner
from .ewc import EWCpp
from .finetune import FineTune
from .objective import ReplayObjective
from .replay import ReplayLearner
from .stream_head import StreamHeadLearner


@dataclass(frozen=True)
class PaperSettings:
    """Table 11 of the appendix: (K, N_c) for ASER and ASER_mu, GSS's S, MIR's C."""

    aser: tuple[int, int]
    aser_mu: tuple[int, int]
    gss_batches: int
    mir_subsample: int


PAPER_SETTINGS = {
    "cifar10": PaperSettings(aser=(3, 90), aser_mu=(3, 90), gss_batches=10, mir_subsample=50),
    "cifar100": PaperSettings(aser=(1, 350), aser_mu=(3, 150), gss_batches=10, mir_subsample=50),
    "mini-imagenet": PaperSettings(aser=(7, 200), aser_mu=(3, 250), gss_batches=20, mir_subsample=100),
}

# method -> (update, retrieval); "asv" / "asv-mu" take ASER's / ASER_mu's K and N_c
REPLAY_METHODS = {
    "er": ("reservoir", "random"),
    "mir": ("reservoir", "mir"),
    "gss": ("gss", "random"),
    "aser": ("knn-sv", "asv"),
    "aser-mu": ("knn-sv", "asv-mu"),
    "sv-upd": ("knn-sv", "random"),
    "asv-ret": ("reservoir", "asv"),
    "asv-mu-ret": ("reservoir", "asv-mu"),
    "dist": ("knn-sv", "dist"),
    "dist-mu": ("knn-sv", "dist-mu"),
    # a class-balanced memory (`learner.memory.balanced`): CBRS, and KNN-SV deciding within the class
    "cbrs": ("cb-random", "random"),
    "cb-sv": ("cb-value", "random"),
    "cb-sv-duel": ("cb-duel", "random"),
    "cb-sv-compete": ("cb-compete", "random"),
    "cb-diverse": ("cb-diverse", "random"),
    "cb-aser": ("cb-duel", "asv"),
    "cb-aser-mu": ("cb-duel", "asv-mu"),
    "cb-aser-mu-old": ("cb-duel", "asv-mu-old"),
    "cb-aser-mu-within": ("cb-duel", "asv-mu-within"),
    "cbrs-aser-mu": ("cb-random", "asv-mu"),
}
# A policy's lean form, for a learner behind its stream (`observe(..., lean=True)`, `learner.catch_up`):
# those that run a feature or gradient pass of their own give way to the one that needs none, so a lean
# step of ASER's memory costs what ER's step costs (3.8x less on one CPU thread, the cost model in
# results/realtime/cost-model.json). The others are their own lean form.
LEAN_POLICIES = {"knn-sv": "reservoir", "asv": "random", "asv-mu": "random", "asv-mu-old": "random",
                 "asv-mu-within": "random", "dist": "random",
                 "dist-mu": "random", "mir": "random",
                 **{balanced_name(rule): balanced_name("random") for rule in VICTIM_RULES if rule != "random"}}
# the policies K or N_c shape (`shapley_settings`)
VALUED_POLICIES = {"knn-sv", "asv", "asv-mu", "asv-mu-old", "asv-mu-within", "dist", "dist-mu",
                   *(balanced_name(r) for r in ("value", "duel", "compete"))}
# no memory, no training: a streaming head on the pretrained backbone's frozen features (`learner.methods.stream_head`)
STREAM_HEAD_METHODS = {"slda": "slda", "slda-oas": "slda-oas", "slda-plain": "slda-plain", "class-means": "ncm",
                       "class-means-plain": "ncm-plain"}
OTHER_METHODS = ("agem", "ewc", "finetune", "iid-online", "iid-offline", *STREAM_HEAD_METHODS)
METHODS = tuple(REPLAY_METHODS) + OTHER_METHODS
IID_EPOCHS = {"iid-online": 1, "iid-offline": 5}


def lean_method(method: str) -> str:
    """The method whose step is `method`'s lean step (its policies' lean forms).

    >>> lean_method("sv-upd"), lean_method("aser-mu"), lean_method("gss"), lean_method("ewc"), lean_method("cb-aser")
    ('er', 'er', 'gss', 'ewc', 'cbrs')
    """
    if method not in REPLAY_METHODS:
        return method
    pair = tuple(LEAN_POLICIES.get(p, p) for p in REPLAY_METHODS[method])
    return next(m for m, policies in REPLAY_METHODS.items() if policies == pair)


def uses_shapley_settings(method: str) -> bool:
    """Whether K or N_c shape `method`'s memory policies (a result records them only then).

    >>> uses_shapley_settings("cb-aser"), uses_shapley_settings("cbrs"), uses_shapley_settings("ewc")
    (True, False, False)
    """
    return bool(set(REPLAY_METHODS.get(method, ())) & VALUED_POLICIES)


def shapley_settings(method: str, dataset: str, k: int | None, n_candidates: int | None) -> tuple[int, int]:
    """K and N_c: explicit values win, else the paper's for the dataset (ASER_mu's for
    sv-upd, dist and dist-mu, whose table row the paper does not give)."""
    paper = PAPER_SETTINGS.get(dataset, PAPER_SETTINGS["cifar10"])
    default = paper.aser if method in ("aser", "asv-ret", "cb-aser") else paper.aser_mu
    return (k or default[0], n_candidates or default[1])


def make_learner(method: str, num_classes: int, mem_size: int = 1000, dataset: str = "cifar10",
                 k: int | None = None, n_candidates: int | None = None, replay_batch: int = 10,
                 exclude_current_task: bool = False, mir_subsample: int | None = None,
                 gss_batches: int | None = None, ewc_lambda: float = 100.0,
                 per_class: int | None = None, loss: str = "ce", step: str = "joint", iterations: int = 1,
                 augment: bool | str = False, distill: float = 0.0, feature_max_age: int = 100,
                 **kwargs) -> ContinualLearner:
    """Build `method` for a stream with `num_classes` classes (the head's initial width).

    `loss` (ce | ace) and `step` (joint | separate) choose the replay methods' objective
    (`learner.methods.objective`); `iterations` (SGD steps per incoming batch) and `augment` (True or
    "crop-flip": crop + flip of every training batch; "strong": `learner.methods.augment.StrongAugment`) are
    the replay methods' repeated augmented rehearsal (`learner.methods.replay`); `distill` weighs the moving
    average's distillation term (`learner.methods.objective`; needs `ema_decay`). `feature_max_age`: the
    class-balanced KNN-SV rules, and ASV retrieval on them (cb-aser, cb-aser-mu, cb-aser-mu-old,
    cb-aser-mu-within), value the memory on cached features at most this many optimizer steps old
    (`learner.memory.balanced`). kwargs go to the learner (lr, device, seed, image_shape, channels_last,
    autocast_dtype, latent_dtype, compile, ema_decay, serving_bn, serving_bias, backbone, serving_head,
    trained_head_from, choose_head, head_prior, train_every, optimizer, head_lr, sleep, sleep_store, calibrate,
    false_alarm, frozen_values).
    N_c follows the reference: S_sub and the retrieval candidates take N_c / num_classes
    samples of each class (or `per_class`, for a stream whose class count is unknown); the
    update draws N_c random memory candidates.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    paper = PAPER_SETTINGS.get(dataset, PAPER_SETTINGS["cifar10"])
    objective = ReplayObjective(loss, step, distill)
    if method not in REPLAY_METHODS and objective != ReplayObjective():
        raise ValueError(f"--loss, --step and --distill apply to the replay methods ({', '.join(REPLAY_METHODS)}), "
                         f"not {method}")
    if distill and not kwargs.get("ema_decay"):
        raise ValueError("--distill needs a moving average to teach (--ema)")
    if method not in REPLAY_METHODS and (iterations != 1 or augment):
        raise ValueError(f"--iterations and --augment apply to the replay methods, not {method}")
    backbone = kwargs.get("backbone")
    if backbone is not None and backbone.name != "scratch" and augment:
        raise ValueError("--augment crops and flips images; a pretrained backbone's memory holds latents")
    if method in STREAM_HEAD_METHODS:
        if backbone is None or backbone.name == "scratch":
            raise ValueError(f"{method} reads frozen features: it needs a pretrained backbone")
        return StreamHeadLearner(num_classes, serving_head=STREAM_HEAD_METHODS[method], **kwargs)
    if method in ("finetune", "iid-online", "iid-offline"):
        return FineTune(num_classes, **kwargs)
    if method == "ewc":
        return EWCpp(num_classes, ewc_lambda=ewc_lambda, **kwargs)
    if method == "agem":
        return AGEM(num_classes, mem_size=mem_size, replay_batch=replay_batch, **kwargs)

    k, n_candidates = shapley_settings(method, dataset, k, n_candidates)
    per_class = per_class or max(1, n_candidates // max(num_classes, 1))
    update_name, retrieval_name = REPLAY_METHODS[method]
    updates = {
        "reservoir": lambda: ReservoirUpdate(),
        "gss": lambda: GSSGreedyUpdate(n_batches=gss_batches or paper.gss_batches),
        "knn-sv": lambda: KNNShapleyUpdate(k=k, per_class=per_class, n_candidates=n_candidates),
        **{balanced_name(rule): (lambda rule=rule: ClassBalancedUpdate(rule, k=k, max_age=feature_max_age))
           for rule in VICTIM_RULES},
    }
    # on a class-balanced memory ASV reads the feature cache the update keeps (at most
    # feature_max_age steps old); on the paper's memory it computes fresh features, as the paper does
    asv_age = feature_max_age if update_name.startswith("cb-") else 0
    retrievals = {
        "random": lambda: RandomRetrieval(),
        "mir": lambda: MIRRetrieval(n_subsample=mir_subsample or paper.mir_subsample),
        "asv": lambda: ASVRetrieval(k=k, per_class=per_class, mean=False, max_age=asv_age),
        "asv-mu": lambda: ASVRetrieval(k=k, per_class=per_class, mean=True, max_age=asv_age),
        "asv-mu-old": lambda: OldClassesBy(ASVRetrieval(k=k, per_class=per_class, mean=True, max_age=asv_age)),
        "asv-mu-within": lambda: WithinClassesBy(ASVRetrieval(k=k, per_class=per_class, mean=True, max_age=asv_age)),
        "dist": lambda: DistRetrieval(per_class=per_class, mean=False),
        "dist-mu": lambda: DistRetrieval(per_class=per_class, mean=True),
    }
    update, retrieval = updates[update_name](), retrievals[retrieval_name]()
    lean_update = updates[LEAN_POLICIES[update_name]]() if update_name in LEAN_POLICIES else update
    if isinstance(update, ClassBalancedUpdate):
        lean_update = update.lean_form()
    lean_retrieval = retrievals[LEAN_POLICIES[retrieval_name]]() if retrieval_name in LEAN_POLICIES else retrieval
    augmenter = make_augment(augment, seed=kwargs.get("seed", 0) + 1)  # its own stream of draws
    return ReplayLearner(num_classes, update, retrieval, mem_size=mem_size, replay_batch=replay_batch,
                         exclude_current_task=exclude_current_task, objective=objective, iterations=iterations,
                         augment=augmenter, lean_policies=(lean_update, lean_retrieval), **kwargs)
