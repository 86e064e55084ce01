"""ResNet (He et al. 2015), ImageNet and CIFAR flavours, at any depth the block rules allow.

ImageNet (default when image_size > 64): torchvision's v1.5 (a bottleneck's stride on its 3x3), layers named as
torchvision's ("layer{i}.{j}.conv1", ".downsample.conv"); 25,557,032 parameters for ResNet-50 at 1000 classes.
Depth counts the main path's weighted layers (not the projections). Beside `IMAGENET_BLOCKS`, any d >= 35 with
(d - 2) % 3 == 0 is bottleneck (3, 4, (d - 2)/3 - 10, 3); `blocks=` names SuperNeurons' (6, 32, k, 6) family.
CIFAR (image_size <= 64): depth 6n + 2, stages of 16, 32, 64; the shape-changing shortcuts are projections
("option B": minidl has no zero-padding layer), so ResNet-20 has 272,474 parameters (the paper's 269,722).
"""
from __future__ import annotations

from dataclasses import dataclass

from minidl.core.errors import OptionError
from minidl.layers import Add, BatchNorm2d, Conv2d, GlobalAvgPool, Linear, MaxPool2d, ReLU

from .common import finish, new_network

VARIANTS = (None, "imagenet", "cifar")

IMAGENET_BLOCKS: dict[int, tuple[str, tuple[int, int, int, int]]] = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
    200: ("bottleneck", (3, 24, 36, 3)),
    2500: ("bottleneck", (6, 32, 788, 6)),  # SuperNeurons' ResNet-2500: 2498 weighted layers
    1026: ("basic", (128, 128, 128, 128)),  # Harmony's (after Chen et al.): 801,800,232 parameters
}
CIFAR_DEPTHS_EXAMPLES = (20, 32, 44, 56, 110, 1202)


@dataclass(frozen=True, slots=True)
class ResNetConfig:
    kind: str  # "basic" or "bottleneck"
    blocks: tuple[int, ...]  # blocks per stage
    widths: tuple[int, ...]  # planes per stage (a bottleneck outputs 4x)
    strides: tuple[int, ...]
    stem: str  # "imagenet" (7x7/2 + maxpool) or "cifar" (3x3)

    @property
    def expansion(self) -> int:
        return 4 if self.kind == "bottleneck" else 1

    @property
    def depth(self) -> int:
        """Weighted layers on the main path: the stem conv, the block convs, fc."""
        per_block = 3 if self.kind == "bottleneck" else 2
        return per_block * sum(self.blocks) + 2


def imagenet_blocks(depth: int) -> tuple[str, tuple[int, int, int, int]]:
    """(block kind, blocks per stage) of an ImageNet ResNet of `depth`."""
    if isinstance(depth, bool) or not isinstance(depth, int):
        raise OptionError(f"resnet: depth must be an integer, got {depth!r}")
    if depth in IMAGENET_BLOCKS:
        return IMAGENET_BLOCKS[depth]
    if depth >= 35 and (depth - 2) % 3 == 0:
        return "bottleneck", (3, 4, (depth - 2) // 3 - 10, 3)
    raise OptionError(f"resnet: no ImageNet ResNet has depth {depth}: use 18 or 34 (basic blocks), 50, 101, 152, "
                      f"200, 2500 (SuperNeurons' (6, 32, 788, 6)), or any depth d >= 35 with (d - 2) divisible by "
                      f"3 (bottleneck blocks (3, 4, (d - 2)/3 - 10, 3)); a CIFAR ResNet (variant='cifar' or "
                      f"image_size <= 64) takes depth 6n + 2")


def cifar_blocks_per_stage(depth: int) -> int:
    """n of a CIFAR ResNet of depth 6n + 2."""
    if isinstance(depth, bool) or not isinstance(depth, int):
        raise OptionError(f"resnet: depth must be an integer, got {depth!r}")
    if depth < 8 or (depth - 2) % 6:
        raise OptionError(f"resnet: a CIFAR ResNet has depth 6n + 2 with n >= 1 (8, 14, 20, 32, 44, 56, 110, "
                          f"1202, ...), got {depth}; for an ImageNet ResNet on small images pass "
                          f"variant='imagenet'")
    return (depth - 2) // 6


def resnet_config(depth: int, variant: str) -> ResNetConfig:
    if variant == "cifar":
        n = cifar_blocks_per_stage(depth)
        return ResNetConfig("basic", (n, n, n), (16, 32, 64), (1, 2, 2), "cifar")
    kind, blocks = imagenet_blocks(depth)
    return ResNetConfig(kind, blocks, (64, 128, 256, 512), (1, 2, 2, 2), "imagenet")


def _bottleneck_blocks(blocks, depth: int, variant: str) -> ResNetConfig:
    """The ImageNet bottleneck configuration of `blocks`, which must agree with a depth given."""
    if variant != "imagenet" or len(blocks) != 4 or not all(isinstance(n, int) and n >= 1 for n in blocks):
        raise OptionError(f"resnet: blocks must be four positive integers of an ImageNet (bottleneck) ResNet, got "
                          f"blocks={tuple(blocks)!r} with variant={variant!r}")
    cfg = ResNetConfig("bottleneck", tuple(blocks), (64, 128, 256, 512), (1, 2, 2, 2), "imagenet")
    if depth not in (50, cfg.depth):   # 50: the default depth, i.e. not given
        raise OptionError(f"resnet: blocks {tuple(blocks)} make depth {cfg.depth}, not the depth={depth} given")
    return cfg


def _conv_bn(h, out_channels: int, kernel: int, stride: int, prefix: str, conv: str, bn: str):
    h = Conv2d(out_channels, kernel, stride=stride, padding=kernel // 2, bias=False, name=f"{prefix}{conv}")(h)
    return BatchNorm2d(name=f"{prefix}{bn}")(h)


def _block(h, cfg: ResNetConfig, planes: int, stride: int, name: str):
    in_channels = h.shape[1]
    out_channels = planes * cfg.expansion
    p = name + "."
    if cfg.kind == "basic":
        r = ReLU(name=p + "relu1")(_conv_bn(h, planes, 3, stride, p, "conv1", "bn1"))
        r = _conv_bn(r, planes, 3, 1, p, "conv2", "bn2")
    else:
        r = ReLU(name=p + "relu1")(_conv_bn(h, planes, 1, 1, p, "conv1", "bn1"))
        r = ReLU(name=p + "relu2")(_conv_bn(r, planes, 3, stride, p, "conv2", "bn2"))
        r = _conv_bn(r, out_channels, 1, 1, p, "conv3", "bn3")
    if stride != 1 or in_channels != out_channels:
        h = _conv_bn(h, out_channels, 1, stride, p, "downsample.conv", "downsample.bn")
    return ReLU(name=p + "relu")(Add(name=p + "add")(r, h))


def resnet(depth: int = 50, batch: int = 32, image_size: int = 224, num_classes: int = 1000, in_channels: int = 3,
           dtype="float32", variant: str | None = None, blocks: tuple[int, ...] | None = None):
    """ResNet-`depth`; `variant` None follows the image size: resnet(50, image_size=32) is the CIFAR ResNet-50."""
    if variant not in VARIANTS:
        raise OptionError(f"resnet: unknown variant {variant!r}; choose one of {VARIANTS}")
    if variant is None:
        variant = "cifar" if isinstance(image_size, int) and image_size <= 64 else "imagenet"
    cfg = resnet_config(depth, variant) if blocks is None else _bottleneck_blocks(blocks, depth, variant)
    depth = cfg.depth if blocks is not None else depth
    name = f"resnet{depth}" + ("_cifar" if variant == "cifar" else "")
    net, x, y = new_network(name, batch, in_channels, image_size, num_classes, dtype)
    if cfg.stem == "imagenet":
        h = ReLU(name="relu")(_conv_bn(x, 64, 7, 2, "", "conv1", "bn1"))
        h = MaxPool2d(3, stride=2, padding=1, name="maxpool")(h)
    else:
        h = ReLU(name="relu")(_conv_bn(x, 16, 3, 1, "", "conv1", "bn1"))
    for i, (n, planes, stride) in enumerate(zip(cfg.blocks, cfg.widths, cfg.strides), start=1):
        for j in range(n):
            h = _block(h, cfg, planes, stride if j == 0 else 1, f"layer{i}.{j}")
    h = GlobalAvgPool(name="avgpool")(h)
    return finish(net, Linear(num_classes, name="fc")(h), y)
