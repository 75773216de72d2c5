"""What a learner trains and what its memory stores: the backbone.

- `scratch`: the paper's reduced ResNet18, trained whole from random weights; the memory keeps
  the raw uint8 pixels (the research protocol).
- `lite0`: EfficientNet-Lite0's ImageNet weights (`learner.networks.lite0`), frozen below a cut; the
  memory keeps the frozen part's output at the cut (latent replay), so a replayed sample costs
  only the trainable top. `encode` runs the frozen part once per incoming image.

Every learner talks to its backbone through the same few verbs (`make_model`, `encode`,
`to_input`, `features`), so memory policies, objectives and the serving average compose with
either unchanged: to them a stored sample is a tensor of `stored_shape`.

>>> import torch
>>> scratch = ScratchBackbone((3, 32, 32))
>>> scratch.stored_shape, scratch.stored_dtype
((3, 32, 32), torch.uint8)
>>> lite = PretrainedBackbone(input_size=96, cut=POOLED, latent_bits=8)
>>> stored = lite.encode(torch.zeros(2, 3, 32, 32, dtype=torch.uint8))
>>> stored.shape, stored.dtype, lite.slot_bytes
(torch.Size([2, 1280]), torch.uint8, 1280)
>>> top = lite.make_model(num_classes=3, seed=0)
>>> top(lite.to_input(stored)).shape
torch.Size([2, 3])
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from .frozen_runtime import FrozenGraphs, TopGraph
from .lite0 import FEATURE_DIM, NUM_BLOCKS, POOLED, load_lite0
from .reduced_resnet import ReducedResNet18, fold_batchnorm, scale_pixels

BACKBONES = ("scratch", "lite0")
POOLED_RANGE = 6.0  # the pooled features follow ReLU6: [0, 6], so 8 bits quantise them on a fixed grid


class ScratchBackbone:
    """The reduced ResNet18 from random weights; stored samples are the images themselves."""
    name = "scratch"
    trains_bn = True

    def __init__(self, image_shape: tuple[int, int, int], channels_last: bool = False):
        self.image_shape = tuple(image_shape)
        self.stored_shape, self.stored_dtype = self.image_shape, torch.uint8
        self.channels_last = channels_last

    @property
    def slot_bytes(self) -> int:
        return int(torch.tensor(self.stored_shape).prod())

    @property
    def input_size(self) -> int:
        return self.image_shape[1]

    def make_model(self, num_classes: int, seed: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return ReducedResNet18(num_classes, input_size=self.image_shape[1])

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8 or images.dim() != 4 or tuple(images.shape[1:]) != self.image_shape:
            raise ValueError(f"expected uint8 images [b, {', '.join(map(str, self.image_shape))}], "
                             f"got {images.dtype} {tuple(images.shape)}")
        return images

    def to_input(self, stored: torch.Tensor) -> torch.Tensor:
        x = scale_pixels(stored)
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def features(self, net: nn.Module, dtype: torch.dtype | None = None):
        """Eval-mode f_ext of `net`, BatchNorm folded (`learner.networks.reduced_resnet.fold_batchnorm`)."""
        return fold_batchnorm(net, dtype)

    def pixel_module(self, net: nn.Module) -> nn.Module:
        """uint8 pixels -> `net`'s features, as one module (what an ONNX snapshot holds)."""
        return ScaledPixelFeatures(net)

    def release_buffers(self) -> None:
        """Nothing to give back: the pixels are the stored form, no runtime keeps buffers between runs."""

    channels = None  # the stored form is pixels: no latent's channels for "none of these" to read

    def channel_means(self, stored: torch.Tensor) -> None:
        return None

    def identity(self) -> dict:
        return {"backbone": self.name}


class ScaledPixelFeatures(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.net.features(scale_pixels(pixels))


class RunningStandardize(nn.Module):
    """(f - mean) / std, each feature by statistics of every batch the top trained on: cumulative until they
    have seen 1 / MOMENTUM samples, then moving. Lite0's pooled features follow ReLU6 (a large common mean, scales
    far apart), which makes plain SGD on a linear head above them ill-conditioned; standardised, they did not lift
    the cut-11 top on Split EuroSAT (docs/results/adapting.md), so it is an option. The statistics move in train
    mode only, without gradients; an evaluation reads them.

    >>> f = torch.tensor([[1.0, 10.0], [3.0, 30.0]])
    >>> standardize = RunningStandardize(2).train()
    >>> standardize(f).round(decimals=4).tolist()
    [[-1.0, -1.0], [1.0, 1.0]]
    """

    MOMENTUM = 1e-3

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        if self.training and f.shape[0] > 1:
            self._update(f.detach().float())
        return (f - self.mean) * torch.rsqrt(self.var + 1e-5)

    @torch.no_grad()
    def _update(self, f: torch.Tensor) -> None:
        share = max(f.shape[0] / (int(self.seen) + f.shape[0]), self.MOMENTUM)
        delta = f.mean(0) - self.mean
        # the variance of the mixture: old (1 - share), new (share), their means delta apart
        self.var.mul_(1 - share).add_(share * f.var(0, unbiased=False) + share * (1 - share) * delta**2)
        self.mean.add_(share * delta)
        self.seen += f.shape[0]


class LatentTop(nn.Module):
    """The trainable part above the cut: Lite0's blocks from the cut, its head convolution, the
    pooling, and a linear head that grows with the classes. BatchNorm keeps the pretrained
    statistics: `train()` leaves every BatchNorm in eval mode (its scale and shift still train).
    `standardize`: the pooled features reach the head standardised (`RunningStandardize`)."""

    def __init__(self, frozen, cut: int, num_classes: int, standardize: bool = False):
        super().__init__()
        self.cut = cut
        self.blocks = copy.deepcopy(frozen.blocks[cut:NUM_BLOCKS]) if cut < POOLED else nn.ModuleList()
        self.conv_head = copy.deepcopy(frozen.head) if cut <= NUM_BLOCKS else nn.Identity()
        self.blocks.requires_grad_(True)
        self.conv_head.requires_grad_(True)
        self.head = nn.Linear(FEATURE_DIM, num_classes)
        self.feature_dim = FEATURE_DIM
        self.standardize = RunningStandardize(FEATURE_DIM) if standardize else nn.Identity()

    def train(self, mode: bool = True):
        super().train(mode)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        return self

    @property
    def num_classes(self) -> int:
        return self.head.out_features

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if self.cut == POOLED:
            return x
        for block in self.blocks:
            x = block(x)
        return self.standardize(self.conv_head(x).mean((2, 3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    grow = ReducedResNet18.grow


@dataclass
class PretrainedBackbone:
    """EfficientNet-Lite0's ImageNet weights, frozen below `cut` (a block index, or `POOLED`: only
    the linear head trains); latents stored in fp16 (`latent_bits` 16) or, pooled, 8 bits; `standardize`: a
    top above the pooled cut feeds its head standardised features (`RunningStandardize`)."""
    input_size: int = 128
    cut: int = POOLED
    latent_bits: int = 16
    standardize: bool = False
    name = "lite0"
    trains_bn = False

    def __post_init__(self):
        if not 0 <= self.cut <= POOLED:
            raise ValueError(f"the cut must be a block index 0..{NUM_BLOCKS} or {POOLED} (pooled), got {self.cut}")
        if self.latent_bits not in (8, 16) or (self.latent_bits == 8 and self.cut != POOLED):
            raise ValueError("latents are stored in 16 bits, or in 8 at the pooled cut (ReLU6's fixed range)")
        if self.standardize and self.cut == POOLED:  # there the streaming heads read the top's (identity) features
            raise ValueError("standardize applies to a top above the pooled cut: choose a cut below it")
        self.frozen = load_lite0(self.input_size)
        self.graphs = FrozenGraphs(self.frozen, self.cut)  # the frozen part in onnxruntime, on the CPU
        self.stored_shape = self.frozen.latent_shape(self.cut)
        self.stored_dtype = torch.uint8 if self.latent_bits == 8 else torch.float16
        self.channels_last = False

    @property
    def slot_bytes(self) -> int:
        return int(torch.tensor(self.stored_shape).prod()) * self.latent_bits // 8

    def make_model(self, num_classes: int, seed: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return LatentTop(self.frozen, self.cut, num_classes, self.standardize)

    def is_stored(self, x: torch.Tensor) -> bool:
        return x.dtype == self.stored_dtype and tuple(x.shape[1:]) == self.stored_shape

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images [b, 3, H, W] (any size: resized to `input_size`) -> stored latents; latents
        already stored pass through."""
        return self._encode(images, features=False)[0]

    def encode_with_features(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`encode`, and the frozen network's pooled features of the stored latents (what the
        streaming heads read), from one pass."""
        return self._encode(images, features=True)

    @torch.no_grad()
    def _encode(self, images: torch.Tensor, features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.is_stored(images):
            return images, self.frozen_features(images) if features else None
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"expected uint8 images [b, 3, H, W] or stored latents {self.stored_shape}, "
                             f"got {images.dtype} {tuple(images.shape)}")
        if images.device.type != "cpu" or not images.shape[0]:  # a GPU keeps its own
            self.frozen.to(images.device)
            stored = self.quantise(self.frozen.lower(images, self.cut))
            return stored, self.frozen_features(stored) if features else None
        latent, above = self.graphs.lower(images, features)
        stored = self.quantise(latent)
        if features and above is None:  # at the pooled cut the features are the stored latent itself
            above = dequantise(stored, self.latent_bits)
        return stored, above

    def quantise(self, latent: torch.Tensor) -> torch.Tensor:
        return quantise(latent, self.latent_bits)

    def to_input(self, x: torch.Tensor) -> torch.Tensor:
        """Stored latents (or images, encoded first) -> the top's float input."""
        return dequantise(self.encode(x), self.latent_bits)

    def features(self, net: nn.Module, dtype: torch.dtype | None = None, runtime: bool = False):
        """Eval-mode pooled features of the top `net` (its BatchNorm is always in eval mode): of a
        copy where the top has weights above the pooled cut, so later steps do not reach them; `runtime`: that copy
        in onnxruntime (`TopGraph`: float latents on the CPU, for weights that hold a while)."""
        if self.cut == POOLED:
            return net.features  # the identity: nothing a step changes
        top = copy.deepcopy(net).eval().requires_grad_(False)
        return TopGraph(top, self.frozen.latent_shape(self.cut)) if runtime else top.features

    def pixel_module(self, net: nn.Module | None, frozen_too: bool = False, channels_too: bool = False) -> nn.Module:
        """uint8 pixels -> the features `net` (a top) reads from the stored latents, or with no
        `net` the frozen network's own pooled features (what the streaming heads read), as one module;
        `frozen_too`: both, (the top's, the frozen network's), from one pass of the frozen part; `channels_too`:
        the stored latent's `channel_means` after them."""
        return LatentPixelFeatures(self.frozen, self.cut, self.latent_bits, net, frozen_too, channels_too)

    def release_buffers(self) -> None:
        """What the frozen part's runtime keeps between runs, back to the system (`FrozenGraphs.release_buffers`)."""
        self.graphs.release_buffers()

    @property
    def channels(self) -> int | None:
        """The stored latent's channels where it is a map (below the pooled cut; at the default cut 11, block 11's
        112 input channels): "none of these" reads their means beside the frozen features
        (`learner.heads.calibration`); None at the pooled cut."""
        return self.stored_shape[0] if len(self.stored_shape) == 3 else None

    def channel_means(self, stored: torch.Tensor) -> torch.Tensor | None:
        """The stored latents' means over their positions [n, channels] (None at the pooled cut)."""
        return None if self.channels is None else dequantise(stored, self.latent_bits).mean((2, 3))

    @torch.no_grad()
    def frozen_features(self, stored: torch.Tensor) -> torch.Tensor:
        """The frozen network's pooled features of stored latents (what the streaming heads see)."""
        x = self.to_input(stored)
        if x.device.type == "cpu" and x.shape[0]:
            return self.graphs.upper(x)
        self.frozen.to(x.device)
        return self.frozen.upper(x, self.cut)

    def identity(self) -> dict:
        return {"backbone": self.name, "input_size": self.input_size, "cut": self.cut,
                "latent_bits": self.latent_bits, "weights_sha256": self.frozen.weights_sha256,
                **({"standardize": True} if self.standardize else {})}


def quantise(latent: torch.Tensor, bits: int) -> torch.Tensor:
    """A latent as the memory stores it: fp16, or at 8 bits on ReLU6's fixed grid."""
    if bits == 8:
        return (latent.clamp(0.0, POOLED_RANGE) * (255 / POOLED_RANGE)).round().to(torch.uint8)
    return latent.to(torch.float16)


def dequantise(stored: torch.Tensor, bits: int) -> torch.Tensor:
    return stored.float() * (POOLED_RANGE / 255) if bits == 8 else stored.float()


class LatentPixelFeatures(nn.Module):
    """uint8 pixels -> the frozen part -> the latent as stored (its rounding too) -> the top's
    features (or the frozen network's): the path a stored sample takes, from pixels."""

    def __init__(self, frozen, cut: int, latent_bits: int, top: nn.Module | None, frozen_too: bool = False,
                 channels_too: bool = False):
        super().__init__()
        self.frozen, self.cut, self.latent_bits, self.top, self.frozen_too = frozen, cut, latent_bits, top, frozen_too
        self.channels_too = channels_too

    def forward(self, pixels: torch.Tensor):
        x = dequantise(quantise(self.frozen.lower(pixels, self.cut), self.latent_bits), self.latent_bits)
        if self.top is None:
            out = self.frozen.upper(x, self.cut)
        else:
            out = (self.top.features(x), self.frozen.upper(x, self.cut)) if self.frozen_too else self.top.features(x)
        if not self.channels_too:
            return out
        return (*(out if isinstance(out, tuple) else (out,)), x.mean((2, 3)))


def make_backbone(name: str, image_shape: tuple[int, int, int] = (3, 32, 32), input_size: int = 128,
                  cut: int = POOLED, latent_bits: int = 16, channels_last: bool = False, standardize: bool = False):
    if name == "scratch":
        return ScratchBackbone(image_shape, channels_last)
    if name == "lite0":
        return PretrainedBackbone(input_size, cut, latent_bits, standardize)
    raise ValueError(f"unknown backbone {name!r}; choose one of {', '.join(BACKBONES)}")


def backbone_of(identity: dict, image_shape: tuple[int, int, int]):
    """The backbone an `identity()` names (what a checkpoint or a snapshot job records)."""
    if identity.get("backbone", "scratch") == "scratch":
        return ScratchBackbone(image_shape)
    return PretrainedBackbone(identity["input_size"], identity["cut"], identity["latent_bits"],
                              identity.get("standardize", False))
