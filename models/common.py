"""What every model builder shares; beneath both the builders and the registry."""
from __future__ import annotations

import minidl as dl
from minidl.layers import Conv2d, Linear, SoftmaxCrossEntropy, args


def check_positive(model: str, **values: int) -> None:
    """Each value an integer >= 1 (a float or bool refused, never truncated)."""
    for key, v in values.items():
        args.integer(model, None, key, v, 1)


def transformer_size(model: str, configs: dict[str, tuple[int, int, int]], size: str, layers, heads,
                     width) -> tuple[int, int, int]:
    """(layers, heads, width) of the named size, each overridden where given; the heads must divide the width."""
    if size not in configs:
        raise dl.OptionError(f"model '{model}': unknown size {size!r}; choose one of {', '.join(configs)}")
    base = configs[size]
    layers, heads, width = (base[0] if layers is None else layers, base[1] if heads is None else heads,
                            base[2] if width is None else width)
    check_positive(model, layers=layers, heads=heads, width=width)
    if width % heads:
        raise dl.OptionError(f"model '{model}': width {width} is not a multiple of heads={heads} (each head "
                             f"takes width / heads channels)")
    return layers, heads, width


def new_network(name: str, batch: int, in_channels: int, image_size: int, num_classes: int, dtype):
    """A fresh Network with the image input "data" (N, C, H, W) and the int64 input "label" (N,)."""
    check_positive(name, batch=batch, in_channels=in_channels, image_size=image_size, num_classes=num_classes)
    net = dl.Network(name, dtype=dtype)
    x = net.input((batch, in_channels, image_size, image_size), name="data")
    y = net.input((batch,), dtype="int64", name="label")
    return net, x, y


def finish(net: dl.Network, logits, label) -> dl.Network:
    """Attach the softmax cross-entropy loss ("loss") to the logits and return the network."""
    net.set_loss(SoftmaxCrossEntropy(name="loss")(logits, label))
    return net


def weighted_layers(net: dl.Network, include_shortcuts: bool = True) -> int:
    """Convolution and linear layers, without the "*.downsample.conv" projections unless `include_shortcuts`."""
    return sum(1 for n in net.layer_nodes if isinstance(n.layer, (Conv2d, Linear))
               and (include_shortcuts or ".downsample." not in n.name))
