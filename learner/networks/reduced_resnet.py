"""The reduced ResNet18 of the paper (nf=20), split into feature extractor and head.

The latent space of ASER is the feature extractor's output (`features`), the input of the
linear classifier. The head can grow when a class never seen before arrives.

>>> import torch
>>> net = ReducedResNet18(num_classes=10)
>>> sum(p.numel() for p in net.parameters())
1094750
>>> net.features(torch.zeros(2, 3, 32, 32)).shape
torch.Size([2, 160])
>>> net.grow(12)
>>> net(torch.zeros(1, 3, 32, 32)).shape
torch.Size([1, 12])
"""

from __future__ import annotations

from copy import deepcopy

import torch
from torch import nn
from torch.nn import functional as F


def scale_pixels(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels [n, 3, H, W] -> float model input in [0, 1] (the reference's ToTensor)."""
    return images.float() / 255


def _conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = _conv3x3(in_planes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ReducedResNet18(nn.Module):
    """ResNet18 with 20 base filters (GEM/MIR/ASER's "reduced ResNet18").

    Inputs are float images in [0, 1], shape [n, 3, H, W]. The final 4x4 average pooling
    follows the reference: 32x32 inputs give a 160-d latent space, 84x84 inputs 640-d.
    """

    def __init__(self, num_classes: int, nf: int = 20, input_size: int = 32):
        super().__init__()
        self.nf = nf
        self.input_size = input_size
        self.conv1 = _conv3x3(3, nf)
        self.bn1 = nn.BatchNorm2d(nf)
        layers, in_planes = [], nf
        for mult, stride in ((1, 1), (2, 2), (4, 2), (8, 2)):
            layers += [BasicBlock(in_planes, nf * mult, stride), BasicBlock(nf * mult, nf * mult)]
            in_planes = nf * mult
        self.layers = nn.Sequential(*layers)
        self.feature_dim = nf * 8 * self._pooled_side(input_size) ** 2
        self.head = nn.Linear(self.feature_dim, num_classes)

    @staticmethod
    def _pooled_side(size: int) -> int:
        for _ in range(3):  # three stride-2 stages, each rounding up like the convolution
            size = (size + 1) // 2
        return size // 4

    @property
    def num_classes(self) -> int:
        return self.head.out_features

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """f_ext: images [n, 3, H, W] -> latent vectors [n, h]."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        return F.avg_pool2d(out, 4).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def grow(self, num_classes: int) -> None:
        """Widen the head to `num_classes` outputs, keeping the rows already learned."""
        old = self.head
        if num_classes <= old.out_features:
            return
        new = nn.Linear(old.in_features, num_classes, device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            new.weight[: old.out_features] = old.weight
            new.bias[: old.out_features] = old.bias
        self.head = new


def _fold(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv followed by eval-mode BatchNorm as one conv with bias: W*s, beta - mu*s, s = gamma/sqrt(var+eps)."""
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    return conv.weight * scale.view(-1, 1, 1, 1), bn.bias - bn.running_mean * scale


def _fusable(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's fused conv + bias + add + ReLU kernels: CPU only; bf16 where the CPU has it."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@torch.no_grad()
def recompute_bn(net: ReducedResNet18, images: torch.Tensor, to_input, chunk: int = 256) -> ReducedResNet18:
    """A copy of `net` in eval mode whose BatchNorm running statistics are recomputed on uint8
    `images` (`to_input` makes the model's input of them): one train-mode forward pass without
    gradients, statistics averaged over equal chunks of at most `chunk` images (SWA's
    `torch.optim.swa_utils.update_bn`). Under a moving average of the weights the averaged
    statistics belong to no single set of weights; these belong to the averaged ones. `net` is
    untouched.

    >>> net = ReducedResNet18(3).eval()
    >>> images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    >>> fresh = recompute_bn(net, images, scale_pixels)
    >>> expected = net.conv1(scale_pixels(images)).mean((0, 2, 3))  # one chunk: its exact mean
    >>> torch.allclose(fresh.bn1.running_mean, expected, atol=1e-5), fresh.training
    (True, False)
    """
    copy = deepcopy(net)
    copy.requires_grad_(False)
    n_chunks = max(1, -(-images.shape[0] // chunk))
    with torch.no_grad():
        torch.optim.swa_utils.update_bn((to_input(part) for part in images.tensor_split(n_chunks)), copy)
    return copy.eval()


def fold_batchnorm(net: ReducedResNet18, dtype: torch.dtype | None = None):
    """f_ext in eval mode with every BatchNorm folded into its convolution.

    Equal to `net.eval(); net.features(x)` up to float rounding, and cheaper: no normalisation
    passes, and on CPU each convolution runs with its bias, residual add and ReLU fused into
    one oneDNN kernel (exact: the same arithmetic in one pass over memory). `dtype` (e.g.
    bfloat16) runs the convolutions in that precision; features come back as float32. The
    weights are folded once here (new tensors); call again after the weights change.

    >>> net = ReducedResNet18(10).eval()
    >>> x = torch.rand(4, 3, 32, 32)
    >>> torch.allclose(fold_batchnorm(net)(x), net.features(x), atol=1e-5)
    True
    """
    dtype = dtype or torch.float32
    device = net.conv1.weight.device

    def folded(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
        w, b = _fold(conv, bn)
        return w.to(dtype).contiguous(memory_format=torch.channels_last), b.to(dtype)

    stem = folded(net.conv1, net.bn1)
    blocks = []
    for b in net.layers:
        short = folded(b.shortcut[0], b.shortcut[1]) if len(b.shortcut) else None
        blocks.append((b.conv1.stride[0], folded(b.conv1, b.bn1), folded(b.conv2, b.bn2), short))

    if _fusable(device, dtype):
        conv_relu = torch.ops.mkldnn._convolution_pointwise
        conv_add_relu_ = torch.ops.mkldnn._convolution_pointwise_.binary  # writes into its first argument

        def body(x: torch.Tensor) -> torch.Tensor:
            out = conv_relu(x, *stem, [1, 1], [1, 1], [1, 1], 1, "relu", [], "")
            for stride, (w1, b1), (w2, b2), short in blocks:
                h = conv_relu(out, w1, b1, [1, 1], [stride, stride], [1, 1], 1, "relu", [], "")
                # the block's input is not needed after h: the identity shortcut takes the result in place
                res = F.conv2d(out, short[0], short[1], stride=stride) if short is not None else out
                out = conv_add_relu_(res, h, w2, b2, [1, 1], [1, 1], [1, 1], 1, "add", None, "relu", [], None)
            return out
    else:
        def body(x: torch.Tensor) -> torch.Tensor:
            out = F.relu_(F.conv2d(x, *stem, padding=1))
            for stride, (w1, b1), (w2, b2), short in blocks:
                h = F.relu_(F.conv2d(out, w1, b1, stride=stride, padding=1))
                h = F.conv2d(h, w2, b2, padding=1)
                res = F.conv2d(out, short[0], short[1], stride=stride) if short is not None else out
                out = F.relu_(h.add_(res))
            return out

    def features(x: torch.Tensor) -> torch.Tensor:
        out = body(x.to(dtype).contiguous(memory_format=torch.channels_last))
        return F.avg_pool2d(out, 4).flatten(1).float()

    return features
