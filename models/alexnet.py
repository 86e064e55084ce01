"""AlexNet: torchvision's single-tower version, and the original Krizhevsky-style one with LRN.

torchvision's: 61,100,840 parameters at 1000 classes. Its AdaptiveAvgPool2d((6, 6)) is the identity where pool5 is
6x6 (224, 227: no layer) and an AvgPool2d where pool5 is a multiple of 6; other sizes are refused (no layer has
its overlapping windows). `variant="lrn"`: Krizhevsky et al. 2012 (SuperNeurons' AlexNet), LRN "norm1", "norm2"
after relu1 and relu2.
"""
from __future__ import annotations

from minidl.core.errors import OptionError
from minidl.layers import LRN, AvgPool2d, Conv2d, Dropout, Linear, MaxPool2d, ReLU

from .common import finish, new_network

VARIANTS = (None, "torchvision", "lrn")
# the paper's alpha 1e-4 per element is 5e-4 in torch's LRN, which divides alpha by size
LRN_ARGS = dict(size=5, alpha=5e-4, beta=0.75, k=2.0)


def feature_size(image_size: int) -> int:
    """Side of pool5's output for a square image_size (0 when the image is too small)."""
    s = (image_size + 2 * 2 - 11) // 4 + 1
    for _ in range(3):
        s = (s - 3) // 2 + 1 if s >= 3 else 0
    return max(s, 0)


def _nearest_working_sizes(image_size: int) -> str:
    """The nearest working image sizes below and above, as ranges ("223-254" at 100): runs of 32 every 192."""
    def run_around(s: int) -> str:
        lo, hi = s, s
        while lo > 1 and feature_size(lo - 1) == feature_size(s):
            lo -= 1
        while feature_size(hi + 1) == feature_size(s):
            hi += 1
        return f"{lo}-{hi}"

    works = lambda s: feature_size(s) > 0 and feature_size(s) % 6 == 0
    below = next((s for s in range(image_size - 1, 0, -1) if works(s)), None)
    above = next(s for s in range(image_size + 1, image_size + 6 * 32 + 33) if works(s))
    return ", ".join(run_around(s) for s in (below, above) if s is not None)


def alexnet(batch: int = 32, image_size: int = 224, num_classes: int = 1000, in_channels: int = 3,
            dtype="float32", variant: str | None = None, dropout: float = 0.5):
    """torchvision's AlexNet (`variant=None` or "torchvision") or the LRN one (`variant="lrn"`)."""
    if variant not in VARIANTS:
        raise OptionError(f"alexnet: unknown variant {variant!r}; choose one of {VARIANTS}")
    lrn = variant == "lrn"
    net, x, y = new_network("alexnet_lrn" if lrn else "alexnet", batch, in_channels, image_size, num_classes,
                            dtype)
    fs = feature_size(image_size)
    if fs == 0 or fs % 6:
        raise OptionError(f"alexnet: image_size {image_size} gives a {fs}x{fs} feature map; torchvision's 6x6 "
                          f"adaptive average pooling is only expressible for a positive multiple of 6 (224 and "
                          f"227 give 6x6); nearest sizes that work: {_nearest_working_sizes(image_size)}")
    specs = [  # name, out_channels, kernel, stride, padding, pool after
        ("conv1", 64, 11, 4, 2, True),
        ("conv2", 192, 5, 1, 2, True),
        ("conv3", 384, 3, 1, 1, False),
        ("conv4", 256, 3, 1, 1, False),
        ("conv5", 256, 3, 1, 1, True),
    ]
    h = x
    for i, (name, c, k, s, p, pool) in enumerate(specs, start=1):
        h = ReLU(name=f"relu{i}")(Conv2d(c, k, stride=s, padding=p, name=name)(h))
        if lrn and i <= 2:
            h = LRN(**LRN_ARGS, name=f"norm{i}")(h)
        if pool:
            h = MaxPool2d(3, stride=2, name=f"pool{i}")(h)
    if fs != 6:
        h = AvgPool2d(fs // 6, name="avgpool")(h)
    for i in (6, 7):
        if dropout > 0:
            h = Dropout(dropout, name=f"drop{i}")(h)
        h = ReLU(name=f"relu{i}")(Linear(4096, name=f"fc{i}")(h))
    return finish(net, Linear(num_classes, name="fc8")(h), y)
