"""VGG (Simonyan & Zisserman 2014), torchvision's configurations A/B/D/E = VGG-11/13/16/19, and vDNN's VGG-416.

Stage s (1..5) has the configuration's 3x3 convolutions (padding 1, with bias), named "conv{s}_{i}", each
followed by "relu{s}_{i}" (with `batch_norm=True`: "bn{s}_{i}" between them), and ends with the 2x2 max-pool
"pool{s}". The classifier is torchvision's: fc6 Linear(4096) relu6 drop6, fc7 Linear(4096) relu7 drop7,
fc8 Linear(num_classes); fc6 reads (N, 512, 7, 7) directly (Linear flattens).

torchvision's AdaptiveAvgPool2d((7, 7)) before the classifier is the identity at 224x224 (pool5 is 7x7), so
no layer is emitted; when pool5 is a multiple of 7 it is a plain AvgPool2d named "avgpool"; other sizes are
rejected. Parameters at 1000 classes: VGG-11 132,863,336, VGG-13 133,047,848, VGG-16 138,357,544,
VGG-19 143,667,240, VGG-416 577,894,184 (vDNN's deep VGG, which Harmony trains: configuration D with 80 more
3x3 convolutions per stage, its classifier unchanged). `batch_norm=True` follows torchvision's vgg*_bn exactly,
which keeps the convolution bias (VGG-11-BN 132,868,840, VGG-16-BN 138,365,992).
"""
from __future__ import annotations

from minidl.core.errors import OptionError
from minidl.layers import AvgPool2d, BatchNorm2d, Conv2d, Dropout, Linear, MaxPool2d, ReLU

from .common import finish, new_network

# Output channels of the 3x3 convolutions of each of the 5 stages (each stage ends with a 2x2 max-pool).
VGG_CONFIGS: dict[int, tuple[tuple[int, ...], ...]] = {
    11: ((64,), (128,), (256, 256), (512, 512), (512, 512)),                            # A
    13: ((64, 64), (128, 128), (256, 256), (512, 512), (512, 512)),                     # B
    16: ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512)),      # D
    19: ((64, 64), (128, 128), (256,) * 4, (512,) * 4, (512,) * 4),                     # E
    # vDNN's VGG-416 (Rhu et al. 2016) as Harmony's scripts build it: configuration D with 80 more
    # convolutions in every stage (82 + 82 + 83 + 83 + 83 = 413 convolutions, plus the three fc layers)
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
