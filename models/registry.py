"""The model registry: one name per model (plus aliases), each with its own defaults, and `build_model`."""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import minidl as dl
from minidl.data.text import MASKED, NEXT_TOKEN

from .alexnet import alexnet
from .bert import BERT_CONFIGS, bert
from .densenet import DENSENET_CONFIGS, densenet
from .gpt2 import GPT2_CONFIGS, gpt2
from .inception_v4 import inception_v4
from .lenet import lenet
from .resnet import CIFAR_DEPTHS_EXAMPLES, IMAGENET_BLOCKS, cifar_blocks_per_stage, imagenet_blocks, resnet
from .vgg import VGG_CONFIGS, vgg

#: the options only sequence models take
SEQUENCE_OPTIONS = ("size", "layers", "heads", "width", "seq", "keep_scores")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A registry entry: the builder, the arguments an alias pins, and the defaults of the free arguments."""

    builder: Callable[..., dl.Network]
    description: str
    fixed: dict[str, Any] = field(default_factory=dict)  # pinned by the alias (e.g. depth=16 for "vgg16")
    takes_depth: bool = False
    image_size: int = 224
    num_classes: int = 1000
    in_channels: int = 3
    batch: int = 32
    objective: str | None = None  # a sequence model's (next-token, masked); None: images

    @property
    def sequence(self) -> bool:
        """Reads token sequences: no image options; num_classes is its vocabulary."""
        return self.objective is not None


def _registry() -> dict[str, ModelSpec]:
    m: dict[str, ModelSpec] = {
        "lenet": ModelSpec(lenet, "LeNet-5 style CNN for 28x28 MNIST / 8x8 digits", image_size=28,
                           num_classes=10, in_channels=1, batch=64),
        "alexnet": ModelSpec(alexnet, "torchvision AlexNet (64-192-384-256-256, 61.1M params)"),
        "alexnet_lrn": ModelSpec(alexnet, "Krizhevsky-style AlexNet with LRN after conv1/conv2 (SuperNeurons')",
                                 fixed={"variant": "lrn"}),
        "vgg": ModelSpec(vgg, "VGG without BN (torchvision configs; depth 11/13/16/19)", takes_depth=True),
        "resnet": ModelSpec(resnet, "ResNet: ImageNet (18/34 basic, other depths bottleneck, 2500 = "
                                    "SuperNeurons') or CIFAR (depth 6n+2) when image_size <= 64", takes_depth=True),
        "densenet": ModelSpec(densenet, "DenseNet-BC (torchvision configs; variant='tiny' for tests)",
                              takes_depth=True),
        "inception_v4": ModelSpec(inception_v4, "Inception-v4 (Szegedy et al. 2016), 299x299", image_size=299),
    }
    for d in sorted(VGG_CONFIGS):
        what = "vDNN's VGG-416, as Harmony builds it" if d == 416 else "torchvision"
        m[f"vgg{d}"] = ModelSpec(vgg, f"VGG-{d} ({what}, no BN)", fixed={"depth": d})
        m[f"vgg{d}_bn"] = ModelSpec(vgg, f"VGG-{d} with BatchNorm (torchvision)",
                                    fixed={"depth": d, "batch_norm": True})
    for d in sorted(IMAGENET_BLOCKS):
        kind, blocks = IMAGENET_BLOCKS[d]
        what = "SuperNeurons' ResNet-2500 (2498 weighted layers)" if d == 2500 else f"ImageNet ResNet-{d}"
        m[f"resnet{d}"] = ModelSpec(resnet, f"{what}, {kind} blocks {blocks}",
                                    fixed={"depth": d, "variant": "imagenet"})
    for d in CIFAR_DEPTHS_EXAMPLES:
        m[f"resnet{d}"] = ModelSpec(resnet, f"CIFAR ResNet-{d} (n={(d - 2) // 6})",
                                    fixed={"depth": d, "variant": "cifar"}, image_size=32, num_classes=10)
    for d in sorted(DENSENET_CONFIGS):
        m[f"densenet{d}"] = ModelSpec(densenet, f"DenseNet-{d} (torchvision)", fixed={"depth": d})
    m["gpt2"] = ModelSpec(gpt2, "GPT-2 (size small/medium/large/xl, or any layers/heads/width; seq tokens)",
                          batch=8, objective=NEXT_TOKEN)
    for size, (layers, heads, width) in GPT2_CONFIGS.items():
        m[f"gpt2_{size}"] = ModelSpec(gpt2, f"GPT-2 {size} ({layers} layers, {heads} heads, width {width})",
                                      fixed={"size": size}, batch=8, objective=NEXT_TOKEN)
    m["bert"] = ModelSpec(bert, "BERT with its masked-LM head (size base/large/96, or any layers/heads/width)",
                          batch=8, objective=MASKED)
    for size, (layers, heads, width) in BERT_CONFIGS.items():
        key, what = ("bert96", "Harmony's BERT-96 (BERT-large") if size == "96" else (f"bert_{size}", f"BERT-{size} (")
        m[key] = ModelSpec(bert, f"{what}{layers} layers, {heads} heads, width {width}), masked-LM head",
                           fixed={"size": size}, batch=8, objective=MASKED)
    m["densenet_tiny"] = ModelSpec(densenet, "a small DenseNet for tests (2 blocks of 2 layers, growth 8)",
                                   fixed={"variant": "tiny"}, image_size=32, num_classes=10)
    return m


MODELS: dict[str, ModelSpec] = _registry()


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def model_names() -> list[str]:
    """Registered names in natural order (resnet18 before resnet101)."""
    return sorted(MODELS, key=_natural_key)


def canonical_model(name: str) -> str | None:
    """The registry key for `name`, ignoring case, '-' and '_' ("ResNet-50", "inceptionv4"); None if unknown."""
    if not isinstance(name, str):
        return None
    squash = {k.replace("_", ""): k for k in MODELS}
    return squash.get(name.lower().replace("-", "").replace("_", ""))


def _resnet_is_cifar_only(depth: int) -> bool:
    """True when `depth` is a valid CIFAR ResNet depth (6n+2) but no ImageNet ResNet (e.g. 20, 32)."""
    try:
        imagenet_blocks(depth)
    except ValueError:
        try:
            cifar_blocks_per_stage(depth)
            return True
        except ValueError:
            return False
    return False


def build_model(name: str, depth: int | None = None, batch: int | None = None, image_size: int | None = None,
                num_classes: int | None = None, in_channels: int | None = None, **kw) -> dl.Network:
    """Build the registered model `name`; arguments left at None take the model's defaults (a depth only a CIFAR
    ResNet has, e.g. 20, means 32x32 and 10 classes); extra keywords go to the builder."""
    key = canonical_model(name)
    if key is None:
        raise dl.OptionError(f"unknown model {name!r}; available: {', '.join(model_names())}")
    given = dict(depth=depth, batch=batch, image_size=image_size, num_classes=num_classes, in_channels=in_channels,
                 **kw)
    net = _build(name, key, depth, batch, image_size, num_classes, in_channels, kw)
    options = {k: v for k, v in given.items() if v is not None}
    if all(_plain(v) for v in options.values()):   # a checkpoint keeps it as JSON
        net.recipe = {"model": key, "options": options}
    return net


def _plain(v) -> bool:
    """A value JSON gives back as it was: a string, a number, a bool, or a list of those."""
    if isinstance(v, list):
        return all(_plain(e) for e in v)
    return isinstance(v, (str, int, float, bool))


def _build(name: str, key: str, depth, batch, image_size, num_classes, in_channels, kw: dict) -> dl.Network:
    spec = MODELS[key]
    args: dict[str, Any] = dict(kw)
    for k, v in spec.fixed.items():
        given = depth if k == "depth" else args.get(k)
        if given is not None and given != v:
            raise dl.OptionError(f"model {name!r} fixes {k}={v!r}, got {k}={given!r}; use the generic name "
                             f"'{spec.builder.__name__}' to choose {k}")
        args[k] = v
    if not spec.sequence and any(k in args for k in SEQUENCE_OPTIONS):
        k = next(k for k in SEQUENCE_OPTIONS if k in args)
        raise dl.OptionError(f"model {name!r} has no {k} option (got {k}={args[k]!r}): it belongs to the sequence "
                             f"models, gpt2 and bert")
    if spec.sequence:
        return _build_sequence(name, spec, args, depth, batch, image_size, num_classes, in_channels)
    if "depth" not in spec.fixed and depth is not None:
        if not spec.takes_depth:
            raise dl.OptionError(f"model {name!r} has no depth option (got depth={depth})")
        args["depth"] = depth
    size, classes = spec.image_size, spec.num_classes
    if key == "resnet":
        d = args.get("depth", inspect.signature(resnet).parameters["depth"].default)
        if args.get("variant") == "cifar" or (args.get("variant") is None and _resnet_is_cifar_only(d)):
            size, classes = 32, 10
    args["batch"] = spec.batch if batch is None else batch
    args["image_size"] = size if image_size is None else image_size
    args["num_classes"] = classes if num_classes is None else num_classes
    args["in_channels"] = spec.in_channels if in_channels is None else in_channels
    return spec.builder(**args)


def _build_sequence(name: str, spec: ModelSpec, args: dict, depth, batch, image_size, num_classes,
                    in_channels) -> dl.Network:
    """A sequence model, its vocabulary `num_classes`; image options are refused by name."""
    for opt, v in (("depth", depth), ("image_size", image_size), ("in_channels", in_channels)):
        if v is not None:
            raise dl.OptionError(f"model {name!r} reads token sequences: it has no {opt} option (got {opt}={v}); "
                                 f"it takes size, layers, heads, width and seq")
    args["batch"] = spec.batch if batch is None else batch
    if num_classes is not None:
        args["vocab"] = num_classes
    return spec.builder(**args)


def is_sequence_model(name: str) -> bool:
    """True for a registered model that reads token sequences; False otherwise, unknown names included."""
    return model_objective(name) is not None


def model_objective(name: str) -> str | None:
    """"next-token" (gpt2) or "masked" (bert); None for an image model or an unknown name."""
    key = canonical_model(name)
    return None if key is None else MODELS[key].objective


def describe_models() -> str:
    """One line per registered name, for `--help` texts and error messages."""
    return "\n".join(f"{k:<14} {MODELS[k].description}" for k in model_names())
