"""VGG (Simonyan & Zisserman 2014), torchvision's configurations A/B/D/E = VGG-11/13/16/19, and vDNN's VGG-416.

torchvision's AdaptiveAvgPool2d((7, 7)) is the identity at 224 (no layer), an AvgPool2d where pool5 is a multiple
of 7, refused otherwise. VGG-16 has 138,357,544 parameters, VGG-416 577,894,184; `batch_norm=True` is
torchvision's vgg*_bn (the convolution bias kept).
"""
from __future__ import annotations

from minidl.core.errors import OptionError
from minidl.layers import AvgPool2d, BatchNorm2d, Conv2d, Dropout, Linear, MaxPool2d, ReLU

from .common import finish, new_network

# output channels of each stage's 3x3 convolutions
VGG_CONFIGS: dict[int, tuple[tuple[int, ...], ...]] = {
    11: ((64,), (128,), (256, 256), (512, 512), (512, 512)),                            # A
    13: ((64, 64), (128, 128), (256, 256), (512, 512), (512, 512)),                     # B
    16: ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512)),      # D
    19: ((64, 64), (128, 128), (256,) * 4, (512,) * 4, (512,) * 4),                     # E
    # vDNN's VGG-416 (Rhu et al. 2016) as Harmony builds it: D with 80 more convolutions a stage
    416: ((64,) * 82, (128,) * 82, (256,) * 83, (512,) * 83, (512,) * 83),
}


def vgg(depth: int = 16, batch: int = 32, image_size: int = 224, num_classes: int = 1000, in_channels: int = 3,
        dtype="float32", variant: str | None = None, batch_norm: bool = False, dropout: float = 0.5):
    """VGG-`depth` (11, 13, 16 or 19). `variant="bn"` is the same as `batch_norm=True`."""
    if variant not in (None, "bn"):
        raise OptionError(f"vgg: unknown variant {variant!r}; choose None or 'bn'")
    batch_norm = batch_norm or variant == "bn"
    if depth not in VGG_CONFIGS:
        raise OptionError(f"vgg: depth must be one of {sorted(VGG_CONFIGS)}, got {depth!r}")
    net, x, y = new_network(f"vgg{depth}" + ("_bn" if batch_norm else ""), batch, in_channels, image_size,
                            num_classes, dtype)
    fs = image_size
    for _ in range(5):
        fs //= 2
    if fs == 0 or fs % 7:
        raise OptionError(f"vgg: image_size {image_size} gives a {fs}x{fs} feature map after the 5 poolings; "
                          f"torchvision's 7x7 adaptive average pooling is only expressible for a positive "
                          f"multiple of 7 (224 gives 7x7; image_size must lie in [224k, 224k + 31] for k >= 1)")
    h = x
    for s, widths in enumerate(VGG_CONFIGS[depth], start=1):
        for i, c in enumerate(widths, start=1):
            h = Conv2d(c, 3, padding=1, name=f"conv{s}_{i}")(h)
            if batch_norm:
                h = BatchNorm2d(name=f"bn{s}_{i}")(h)
            h = ReLU(name=f"relu{s}_{i}")(h)
        h = MaxPool2d(2, stride=2, name=f"pool{s}")(h)
    if fs != 7:
        h = AvgPool2d(fs // 7, name="avgpool")(h)
    for i in (6, 7):
        h = ReLU(name=f"relu{i}")(Linear(4096, name=f"fc{i}")(h))
        if dropout > 0:
            h = Dropout(dropout, name=f"drop{i}")(h)
    return finish(net, Linear(num_classes, name="fc8")(h), y)
