"""Inception-v4 (Szegedy et al. 2016, "Inception-v4, Inception-ResNet and the Impact of Residual Connections").

Layer for layer the model of timm's `inception_v4` / Cadene's `inceptionv4` (ported from TF-slim), so it has
the same 42,679,816 parameters at 1000 classes. Every convolution is a BasicConv: Conv2d(bias=False) +
BatchNorm2d(eps=0.001) + ReLU, named "<unit>.conv", "<unit>.bn", "<unit>.relu". "k" below is the kernel, "s2"
stride 2, "v" no padding ("valid"), otherwise padding keeps the size; 1x7 means (1, 7) with padding (0, 3).

    stem.conv1 32 3x3 s2 v, stem.conv2 32 3x3 v, stem.conv3 64 3x3                      299 -> 147 x 147 x 64
    stem.mixed3a  concat(branch0.pool MaxPool 3 s2, branch1.0 96 3x3 s2 v)                    73 x 73 x 160
    stem.mixed4a  concat(branch0: 64 1x1, 96 3x3 v; branch1: 64 1x1, 64 1x7, 64 7x1, 96 3x3 v) 71 x 71 x 192
    stem.mixed5a  concat(branch0.0 192 3x3 s2 v, branch1.pool MaxPool 3 s2)                   35 x 35 x 384
    inception_a1..4  concat(96 1x1 | 64 1x1, 96 3x3 | 64 1x1, 96 3x3, 96 3x3 |
                            AvgPool 3 s1 p1 (count_include_pad=False), 96 1x1)                35 x 35 x 384
    reduction_a      concat(384 3x3 s2 v | 192 1x1, 224 3x3, 256 3x3 s2 v | MaxPool 3 s2)     17 x 17 x 1024
    inception_b1..7  concat(384 1x1 | 192 1x1, 224 1x7, 256 7x1 |
                            192 1x1, 192 7x1, 224 1x7, 224 7x1, 256 1x7 | AvgPool, 128 1x1)   17 x 17 x 1024
    reduction_b      concat(192 1x1, 192 3x3 s2 v | 256 1x1, 256 1x7, 320 7x1, 320 3x3 s2 v |
                            MaxPool 3 s2)                                                      8 x 8 x 1536
    inception_c1..3  concat(256 1x1 | 384 1x1 -> (256 1x3, 256 3x1) |
                            384 1x1, 448 3x1, 512 1x3 -> (256 1x3, 256 3x1) | AvgPool, 256 1x1)  8 x 8 x 1536
    avgpool GlobalAvgPool, [dropout], fc Linear(num_classes)

Branch b's units are "<block>.branch{b}.{i}" (i counts from 0 along the branch, as in timm's nn.Sequential,
so the 1x1 conv after an average pool "<block>.branch3.pool" is "<block>.branch3.1");
the forks of inception_c are "branch1.1a/1b" and "branch2.3a/3b", joined by "branch1.concat" and
"branch2.concat"; each block ends with "<block>.concat". The smallest image is 75x75 (reduction_b gives 1x1).
"""
from __future__ import annotations

from minidl.core.errors import OptionError
from minidl.layers import AvgPool2d, BatchNorm2d, Concat, Conv2d, Dropout, GlobalAvgPool, Linear, MaxPool2d, ReLU

from .common import finish, new_network

MIN_IMAGE_SIZE = 75
BN_EPS = 0.001


def _conv(h, out_channels: int, kernel, name: str, stride: int = 1, padding=0):
    """BasicConv: Conv2d(bias=False) + BatchNorm2d(eps=0.001) + ReLU."""
    h = Conv2d(out_channels, kernel, stride=stride, padding=padding, bias=False, name=f"{name}.conv")(h)
    h = BatchNorm2d(eps=BN_EPS, name=f"{name}.bn")(h)
    return ReLU(name=f"{name}.relu")(h)


def _seq(h, name: str, units):
    """A branch: units (out_channels, kernel, stride, padding) applied in order, named "<name>.<i>"."""
    for i, (c, k, s, p) in enumerate(units):
        h = _conv(h, c, k, f"{name}.{i}", stride=s, padding=p)
    return h


# Kernel/padding shorthands: same-size factorized 7x7 and 3x3 convolutions.
K17, P17, K71, P71 = (1, 7), (0, 3), (7, 1), (3, 0)
K13, P13, K31, P31 = (1, 3), (0, 1), (3, 1), (1, 0)


def _avgpool_branch(h, name: str, out_channels: int):
    t = AvgPool2d(3, stride=1, padding=1, count_include_pad=False, name=f"{name}.pool")(h)
    return _conv(t, out_channels, 1, f"{name}.1")  # timm: branch3 = Sequential(pool, conv)


def _stem(x):
    h = _conv(x, 32, 3, "stem.conv1", stride=2)
    h = _conv(h, 32, 3, "stem.conv2")
    h = _conv(h, 64, 3, "stem.conv3", padding=1)
    b = "stem.mixed3a"
    h = Concat(name=f"{b}.concat")(MaxPool2d(3, stride=2, name=f"{b}.branch0.pool")(h),
                                   _conv(h, 96, 3, f"{b}.branch1.0", stride=2))
    b = "stem.mixed4a"
    h = Concat(name=f"{b}.concat")(
        _seq(h, f"{b}.branch0", [(64, 1, 1, 0), (96, 3, 1, 0)]),
        _seq(h, f"{b}.branch1", [(64, 1, 1, 0), (64, K17, 1, P17), (64, K71, 1, P71), (96, 3, 1, 0)]))
    b = "stem.mixed5a"
    return Concat(name=f"{b}.concat")(_conv(h, 192, 3, f"{b}.branch0.0", stride=2),
                                      MaxPool2d(3, stride=2, name=f"{b}.branch1.pool")(h))


def _inception_a(h, b: str):
    return Concat(name=f"{b}.concat")(
        _conv(h, 96, 1, f"{b}.branch0.0"),
        _seq(h, f"{b}.branch1", [(64, 1, 1, 0), (96, 3, 1, 1)]),
        _seq(h, f"{b}.branch2", [(64, 1, 1, 0), (96, 3, 1, 1), (96, 3, 1, 1)]),
        _avgpool_branch(h, f"{b}.branch3", 96))


def _reduction_a(h, b: str):
    return Concat(name=f"{b}.concat")(
        _conv(h, 384, 3, f"{b}.branch0.0", stride=2),
        _seq(h, f"{b}.branch1", [(192, 1, 1, 0), (224, 3, 1, 1), (256, 3, 2, 0)]),
        MaxPool2d(3, stride=2, name=f"{b}.branch2.pool")(h))


def _inception_b(h, b: str):
    return Concat(name=f"{b}.concat")(
        _conv(h, 384, 1, f"{b}.branch0.0"),
        _seq(h, f"{b}.branch1", [(192, 1, 1, 0), (224, K17, 1, P17), (256, K71, 1, P71)]),
        _seq(h, f"{b}.branch2", [(192, 1, 1, 0), (192, K71, 1, P71), (224, K17, 1, P17), (224, K71, 1, P71),
                                 (256, K17, 1, P17)]),
        _avgpool_branch(h, f"{b}.branch3", 128))


def _reduction_b(h, b: str):
    return Concat(name=f"{b}.concat")(
        _seq(h, f"{b}.branch0", [(192, 1, 1, 0), (192, 3, 2, 0)]),
        _seq(h, f"{b}.branch1", [(256, 1, 1, 0), (256, K17, 1, P17), (320, K71, 1, P71), (320, 3, 2, 0)]),
        MaxPool2d(3, stride=2, name=f"{b}.branch2.pool")(h))


def _inception_c(h, b: str):
    t1 = _conv(h, 384, 1, f"{b}.branch1.0")
    t1 = Concat(name=f"{b}.branch1.concat")(_conv(t1, 256, K13, f"{b}.branch1.1a", padding=P13),
                                            _conv(t1, 256, K31, f"{b}.branch1.1b", padding=P31))
    t2 = _seq(h, f"{b}.branch2", [(384, 1, 1, 0), (448, K31, 1, P31), (512, K13, 1, P13)])
    t2 = Concat(name=f"{b}.branch2.concat")(_conv(t2, 256, K13, f"{b}.branch2.3a", padding=P13),
                                            _conv(t2, 256, K31, f"{b}.branch2.3b", padding=P31))
    return Concat(name=f"{b}.concat")(_conv(h, 256, 1, f"{b}.branch0.0"), t1, t2,
                                      _avgpool_branch(h, f"{b}.branch3", 256))


def inception_v4(batch: int = 32, image_size: int = 299, num_classes: int = 1000, in_channels: int = 3,
                 dtype="float32", variant: str | None = None, drop_rate: float = 0.0):
    """Inception-v4 (see the module docstring). `drop_rate` > 0 adds dropout before fc (the paper: 0.2)."""
    if variant is not None:
        raise OptionError(f"inception_v4: unknown variant {variant!r} (it has none)")
    net, x, y = new_network("inception_v4", batch, in_channels, image_size, num_classes, dtype)
    if image_size < MIN_IMAGE_SIZE:
        raise OptionError(f"inception_v4: image_size must be at least {MIN_IMAGE_SIZE} (299 is the design "
                          f"size), got {image_size}")
    h = _stem(x)
    for i in range(1, 5):
        h = _inception_a(h, f"inception_a{i}")
    h = _reduction_a(h, "reduction_a")
    for i in range(1, 8):
        h = _inception_b(h, f"inception_b{i}")
    h = _reduction_b(h, "reduction_b")
    for i in range(1, 4):
        h = _inception_c(h, f"inception_c{i}")
    h = GlobalAvgPool(name="avgpool")(h)
    if drop_rate > 0:
        h = Dropout(drop_rate, name="dropout")(h)
    return finish(net, Linear(num_classes, name="fc")(h), y)
