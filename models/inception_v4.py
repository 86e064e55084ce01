"""Inception-v4 (Szegedy et al. 2016, "Inception-v4, Inception-ResNet and the Impact of Residual Connections").

Layer for layer timm's `inception_v4` (ported from TF-slim): 42,679,816 parameters at 1000 classes, units named
as timm's nn.Sequential indexes them ("<block>.branch{b}.{i}", then ".conv", ".bn", ".relu"; inception_c's forks
"branch1.1a/1b", "branch2.3a/3b"). The smallest image is 75x75 (reduction_b gives 1x1).
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


# (kernel, padding) of the size-keeping factorized 7x7 and 3x3 convolutions
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
    """Inception-v4; `drop_rate` > 0 adds dropout before fc (the paper: 0.2)."""
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
