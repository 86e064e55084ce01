"""DenseNet-BC (Huang et al. 2017), torchvision's layout and names (without "features."); 7,978,856 parameters
for DenseNet-121 at 1000 classes. A dense layer's "cat" joins its input and conv2: chained two-input concats build
torchvision's tensors. Depth is 2 * sum(blocks) + len(blocks) + 1.
"""
from __future__ import annotations

from dataclasses import dataclass

from minidl.core.errors import OptionError
from minidl.layers import AvgPool2d, BatchNorm2d, Concat, Conv2d, Dropout, GlobalAvgPool, Linear, MaxPool2d, ReLU, args

from .common import check_positive, finish, new_network


@dataclass(frozen=True, slots=True)
class DenseNetConfig:
    growth: int
    blocks: tuple[int, ...]
    init_features: int

    @property
    def depth(self) -> int:
        return 2 * sum(self.blocks) + len(self.blocks) + 1


DENSENET_CONFIGS: dict[int, DenseNetConfig] = {
    121: DenseNetConfig(32, (6, 12, 24, 16), 64),
    161: DenseNetConfig(48, (6, 12, 36, 24), 96),
    169: DenseNetConfig(32, (6, 12, 32, 32), 64),
    201: DenseNetConfig(32, (6, 12, 48, 32), 64),
}
TINY = DenseNetConfig(8, (2, 2), 16)


def densenet(depth: int | None = None, batch: int = 32, image_size: int = 224, num_classes: int = 1000,
             in_channels: int = 3, dtype="float32", variant: str | None = None, *,
             blocks: tuple[int, ...] | None = None, growth: int | None = None, init_features: int | None = None,
             bn_size: int = 4, compression: float = 0.5, drop_rate: float = 0.0):
    """DenseNet-`depth` (None: 121), `variant="tiny"`, or a custom net of `blocks` (growth 32, init 64 unless
    given); `drop_rate` > 0 adds dropout after each dense layer's conv2."""
    if variant not in (None, "tiny"):
        raise OptionError(f"densenet: unknown variant {variant!r}; choose None or 'tiny'")
    if variant == "tiny":
        if blocks is not None:
            raise OptionError("densenet: variant='tiny' fixes blocks=(2, 2); pass blocks without the variant")
        base = TINY
    elif blocks is not None:
        blocks = args.shape("densenet", None, "blocks", blocks)  # integers >= 1, never truncated
        base = DenseNetConfig(32, blocks, 64)
    elif depth is None or depth in DENSENET_CONFIGS:
        depth = 121 if depth is None else depth
        base = DENSENET_CONFIGS[depth]
    else:
        raise OptionError(f"densenet: depth must be one of {sorted(DENSENET_CONFIGS)} (or give blocks=..., or "
                          f"variant='tiny'), got {depth!r}")
    cfg = DenseNetConfig(base.growth if growth is None else growth, base.blocks,
                         base.init_features if init_features is None else init_features)
    if not cfg.blocks:
        raise OptionError("densenet: blocks must name at least one dense block")
    check_positive("densenet", growth=cfg.growth, init_features=cfg.init_features, bn_size=bn_size,
                   **{f"blocks[{i}]": b for i, b in enumerate(cfg.blocks)})
    if depth is not None and depth != cfg.depth:
        raise OptionError(f"densenet: blocks {cfg.blocks} give depth {cfg.depth} "
                          f"(2 * sum(blocks) + len(blocks) + 1), not {depth}")
    compression = args.real("densenet", None, "compression", compression, 0.0, 1.0, lo_open=True)
    drop_rate = args.real("densenet", None, "drop_rate", drop_rate, 0.0, 1.0, hi_open=True)
    name = f"densenet{cfg.depth}" if cfg in DENSENET_CONFIGS.values() else f"densenet{cfg.depth}_custom"
    net, x, y = new_network("densenet_tiny" if cfg == TINY else name, batch, in_channels, image_size, num_classes,
                            dtype)

    h = Conv2d(cfg.init_features, 7, stride=2, padding=3, bias=False, name="conv0")(x)
    h = ReLU(name="relu0")(BatchNorm2d(name="norm0")(h))
    h = MaxPool2d(3, stride=2, padding=1, name="pool0")(h)
    for b, n_layers in enumerate(cfg.blocks, start=1):
        for li in range(1, n_layers + 1):
            p = f"denseblock{b}.denselayer{li}."
            t = ReLU(name=p + "relu1")(BatchNorm2d(name=p + "norm1")(h))
            t = Conv2d(bn_size * cfg.growth, 1, bias=False, name=p + "conv1")(t)
            t = ReLU(name=p + "relu2")(BatchNorm2d(name=p + "norm2")(t))
            t = Conv2d(cfg.growth, 3, padding=1, bias=False, name=p + "conv2")(t)
            if drop_rate > 0:
                t = Dropout(drop_rate, name=p + "dropout")(t)
            h = Concat(name=p + "cat")(h, t)
        if b < len(cfg.blocks):
            p = f"transition{b}."
            t = ReLU(name=p + "relu")(BatchNorm2d(name=p + "norm")(h))
            t = Conv2d(int(h.shape[1] * compression), 1, bias=False, name=p + "conv")(t)
            h = AvgPool2d(2, stride=2, name=p + "pool")(t)
    h = ReLU(name="relu5")(BatchNorm2d(name="norm5")(h))
    h = GlobalAvgPool(name="avgpool")(h)
    return finish(net, Linear(num_classes, name="classifier")(h), y)
