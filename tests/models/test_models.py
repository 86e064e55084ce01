"""The model zoo: exact parameter counts against torchvision/timm, shapes, names, depth rules, the registry.

Building a graph allocates no arrays, so the big models are built here at full size.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import pathlib
import sys
import time

import pytest

import minidl as dl
from minidl.layers import BatchNorm2d, Conv2d


def _import_models():
    """`minidl.models` once installed (setuptools maps it onto ./models); in a source checkout without an
    install, load ./models under that name the same way."""
    try:
        return importlib.import_module("minidl.models")
    except ModuleNotFoundError:
        root = pathlib.Path(__file__).resolve().parents[2] / "models"
        spec = importlib.util.spec_from_file_location("minidl.models", root / "__init__.py",
                                                      submodule_search_locations=[str(root)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["minidl.models"] = mod
        spec.loader.exec_module(mod)
        dl.models = mod
        return mod


M = _import_models()
from minidl.models import alexnet, build_model, densenet, inception_v4, lenet, resnet, vgg, weighted_layers  # noqa: E402

# torchvision / timm counts (1000 classes) and our own documented ones.
PARAMS = {
    "alexnet": 61_100_840,
    "alexnet_lrn": 61_100_840,
    "vgg11": 132_863_336,
    "vgg13": 133_047_848,
    "vgg16": 138_357_544,
    "vgg19": 143_667_240,
    "vgg11_bn": 132_868_840,
    "vgg16_bn": 138_365_992,
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
    "densenet121": 7_978_856,
    "densenet161": 28_681_000,
    "densenet169": 14_149_480,
    "densenet201": 20_013_928,
    "inception_v4": 42_679_816,
    # 10 classes: CIFAR ResNet with projection shortcuts (option B); LeNet-5 at 28x28, 1 channel.
    "resnet20": 272_474,
    "resnet56": 855_770,
    "lenet": 61_706,
}


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_parameter_counts(name):
    net = build_model(name, batch=2)
    assert net.num_params() == PARAMS[name]
    assert net.loss_node.name == "loss"
    assert [n.name for n in net.input_nodes] == ["data", "label"]


def shape(net, node):
    return net.node(node).shape


def test_output_and_feature_shapes():
    net = resnet(50, batch=4)
    assert shape(net, "data") == (4, 3, 224, 224) and shape(net, "label") == (4,)
    assert shape(net, "maxpool") == (4, 64, 56, 56)
    assert shape(net, "layer3.5.relu") == (4, 1024, 14, 14)
    assert shape(net, "layer4.2.relu") == (4, 2048, 7, 7)
    assert shape(net, "fc") == (4, 1000) and net.logits_node.name == "fc"

    net = resnet(20, batch=3, image_size=32, num_classes=10)
    assert net.name == "resnet20_cifar"
    assert [shape(net, f"layer{i}.2.relu") for i in (1, 2, 3)] == [(3, 16, 32, 32), (3, 32, 16, 16), (3, 64, 8, 8)]
    assert shape(net, "fc") == (3, 10)

    net = alexnet(batch=2)
    assert shape(net, "pool5") == (2, 256, 6, 6) and shape(net, "fc8") == (2, 1000)
    net = vgg(16, batch=2, num_classes=7)
    assert shape(net, "pool5") == (2, 512, 7, 7) and shape(net, "fc8") == (2, 7)

    net = densenet(121, batch=2)
    assert shape(net, "pool0") == (2, 64, 56, 56)
    assert shape(net, "denseblock1.denselayer6.cat") == (2, 64 + 6 * 32, 56, 56)
    assert shape(net, "transition1.pool") == (2, 128, 28, 28)
    assert shape(net, "norm5") == (2, 1024, 7, 7) and shape(net, "classifier") == (2, 1000)

    net = inception_v4(batch=2)
    assert shape(net, "stem.conv3.relu") == (2, 64, 147, 147)
    assert shape(net, "stem.mixed3a.concat") == (2, 160, 73, 73)
    assert shape(net, "stem.mixed4a.concat") == (2, 192, 71, 71)
    assert shape(net, "stem.mixed5a.concat") == (2, 384, 35, 35)
    assert shape(net, "inception_a4.concat") == (2, 384, 35, 35)
    assert shape(net, "reduction_a.concat") == (2, 1024, 17, 17)
    assert shape(net, "inception_b7.concat") == (2, 1024, 17, 17)
    assert shape(net, "reduction_b.concat") == (2, 1536, 8, 8)
    assert shape(net, "inception_c3.concat") == (2, 1536, 8, 8)
    assert shape(net, "fc") == (2, 1000)
    assert weighted_layers(net) == 150


def test_hierarchical_names():
    net = resnet(101, batch=1)
    for name in ("conv1", "bn1", "layer3.17.conv2", "layer3.17.bn2", "layer3.17.relu2", "layer3.17.add",
                 "layer3.22.relu", "layer2.0.downsample.conv", "layer2.0.downsample.bn", "avgpool", "fc"):
        net.node(name)
    assert net.node("layer3.17.conv2").type_name == "conv"
    # v1.5: the stride sits on the 3x3 conv of the first bottleneck of a stage
    assert net.node("layer2.0.conv1").layer.stride == (1, 1)
    assert net.node("layer2.0.conv2").layer.stride == (2, 2)
    net = inception_v4(batch=1)
    for name in ("inception_c1.branch1.1a.conv", "inception_c1.branch2.3b.bn", "inception_b3.branch3.pool",
                 "inception_b3.branch3.1.conv", "reduction_b.branch1.3.relu"):
        net.node(name)


@pytest.mark.parametrize("name", ["resnet50", "resnet20", "densenet121", "inception_v4"])
def test_convs_before_bn_have_no_bias(name):
    net = build_model(name, batch=1)
    convs = [n for n in net.layer_nodes if isinstance(n.layer, Conv2d)]
    assert convs
    for n in convs:  # DenseNet is BN-ReLU-Conv: its convs feed a concat or the next BN
        if name != "densenet121":
            assert any(isinstance(net.nodes[c].layer, BatchNorm2d) for c in n.consumers), n.name
        assert "bias" not in n.params, n.name
    if name == "inception_v4":
        assert all(n.layer.eps == 0.001 for n in net.layer_nodes if isinstance(n.layer, BatchNorm2d))


def test_resnet2500_superneurons():
    t0 = time.perf_counter()
    net = resnet(depth=2500, batch=16)
    seconds = time.perf_counter() - t0
    print(f"\nresnet(depth=2500, batch=16): built in {seconds:.2f} s, {len(net.nodes)} nodes, "
          f"{net.num_params():,} params")
    # blocks (6, 32, 788, 6): 3 * 832 + 2 = 2498 weighted layers on the main path, plus 4 projections
    assert weighted_layers(net, include_shortcuts=False) == 2498
    assert weighted_layers(net) == 2502
    for stage, blocks in zip((1, 2, 3, 4), (6, 32, 788, 6)):
        net.node(f"layer{stage}.{blocks - 1}.add")
        with pytest.raises(dl.GraphError, match="no node named"):
            net.node(f"layer{stage}.{blocks}.add")
    assert shape(net, "fc") == (16, 1000)


def test_harmony_models():
    """Harmony's two CNNs as its model library builds them: vDNN's VGG-416 (configuration D with 80 more 3x3
    convolutions per stage, torchvision's classifier) and the basic-block ResNet-1026 (128 blocks per stage)."""
    vgg416 = build_model("vgg416", batch=2)
    assert weighted_layers(vgg416) == 416
    assert [sum(1 for n in vgg416.layer_nodes if n.name.startswith(f"conv{s}_")) for s in range(1, 6)] == \
        [82, 82, 83, 83, 83]
    assert vgg416.num_params() == 577_894_184
    assert shape(vgg416, "pool5") == (2, 512, 7, 7) and shape(vgg416, "fc8") == (2, 1000)
    r = build_model("resnet1026", batch=2)
    assert weighted_layers(r, include_shortcuts=False) == 1026
    assert weighted_layers(r) == 1029          # three projection shortcuts (stages 2-4)
    assert r.num_params() == 801_800_232
    assert r.node("layer4.127.conv2").layer.__class__.__name__ == "Conv2d"
    with pytest.raises(dl.GraphError, match="no node named"):
        r.node("layer4.128.conv1")


@pytest.mark.parametrize("depth,blocks", [(35, (3, 4, 1, 3)), (56, (3, 4, 8, 3)), (2498, (3, 4, 822, 3))])
def test_resnet_any_depth(depth, blocks):
    net = resnet(depth, batch=1, image_size=224)
    assert weighted_layers(net, include_shortcuts=False) == depth
    assert net.node(f"layer3.{blocks[2] - 1}.conv3") and net.node("layer2.3.conv3")
    with pytest.raises(dl.GraphError, match="no node named"):
        net.node(f"layer3.{blocks[2]}.conv1")


@pytest.mark.parametrize("depth,kw", [
    (51, {}), (19, {}), (20, {}), (32, {}), (26, {}), (0, {}), (-1, {}), (50.0, {}),  # ImageNet rules
    (21, {"variant": "cifar"}), (18, {"image_size": 32}), (2, {"variant": "cifar"}),  # CIFAR: 6n + 2
])
def test_resnet_impossible_depths(depth, kw):
    with pytest.raises(ValueError, match="depth"):
        resnet(depth, batch=1, **kw)


def test_resnet_variant_selection():
    assert weighted_layers(resnet(20, batch=1, image_size=32), include_shortcuts=False) == 20
    net = resnet(18, batch=1, image_size=32, variant="imagenet")  # torchvision's ResNet-18 on 32x32
    assert net.num_params() == PARAMS["resnet18"] and shape(net, "layer4.1.relu") == (1, 512, 1, 1)
    net = resnet(56, batch=1, image_size=64)  # image_size <= 64: the CIFAR net
    assert net.name == "resnet56_cifar"
    with pytest.raises(ValueError, match="variant"):
        resnet(50, batch=1, variant="imagenet_v2")


def test_cifar_resnet_shortcuts():
    """Projection shortcuts ("option B") where the shape changes; the paper's option A would have 2,752
    parameters fewer (269,722 for ResNet-20)."""
    net = resnet(20, batch=1, image_size=32, num_classes=10)
    proj = [n for n in net.layer_nodes if ".downsample." in n.name]
    assert [n.name for n in proj] == ["layer2.0.downsample.conv", "layer2.0.downsample.bn",
                                      "layer3.0.downsample.conv", "layer3.0.downsample.bn"]
    assert sum(math.prod(p.shape) for n in proj for p in n.params.values() if p.trainable) == 2_752
    assert net.num_params() - 2_752 == 269_722


def test_lenet_digits_8x8():
    net = lenet(batch=16, image_size=8, num_classes=10, in_channels=1)
    assert shape(net, "data") == (16, 1, 8, 8)
    assert shape(net, "pool1") == (16, 6, 4, 4)
    assert shape(net, "conv2") == (16, 16, 4, 4)
    assert shape(net, "pool2") == (16, 16, 2, 2)
    assert shape(net, "fc3") == (16, 10)
    assert net.num_params() == 21_386
    net.validate()
    assert shape(build_model("lenet", image_size=8), "pool2")[1:] == (16, 2, 2)
    net = lenet(batch=2)  # 28x28: LeNet-5's valid conv2
    assert shape(net, "conv2") == (2, 16, 10, 10) and shape(net, "pool2") == (2, 16, 5, 5)
    for s in (4, 5, 11, 12, 13, 32):
        lenet(batch=1, image_size=s)
    with pytest.raises(ValueError, match="at least 4"):
        lenet(batch=1, image_size=3)


def test_lenet_trains_on_digits():
    """End to end: the 8x8 LeNet learns the digits (60 SGD steps, batch 32; about 0.5 s)."""
    from minidl.data import digits
    from minidl.optim import SGD
    from minidl.runtime.session import Session

    sess = Session(lenet(batch=32, image_size=8), SGD(lr=0.05, momentum=0.9), policy="liveness", seed=0)
    losses = sess.fit(digits(seed=0), steps=60).losses
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10


def test_alexnet_sizes_and_lrn():
    assert shape(alexnet(batch=1, image_size=227), "pool5") == (1, 256, 6, 6)
    net = alexnet(batch=1, image_size=416)  # 12x12 features: a plain 2x2 average pool gives 6x6
    assert shape(net, "avgpool") == (1, 256, 6, 6) and net.num_params() == PARAMS["alexnet"]
    with pytest.raises(ValueError, match="multiple of 6"):
        alexnet(batch=1, image_size=64)
    net = alexnet(batch=1, variant="lrn")
    assert [n.name for n in net.layer_nodes if n.type_name == "lrn"] == ["norm1", "norm2"]
    assert net.nodes[net.node("norm1").consumers[0]].name == "pool1"
    with pytest.raises(ValueError, match="multiple of 7"):
        vgg(16, batch=1, image_size=32)


def test_densenet_custom_and_tiny():
    tiny = densenet(variant="tiny", batch=4, image_size=32, num_classes=10)
    custom = densenet(depth=None, blocks=(2, 2), growth=8, init_features=16, batch=4, image_size=32,
                      num_classes=10)
    assert tiny.num_params() == custom.num_params() == 15_546
    assert weighted_layers(tiny) == 11
    assert shape(tiny, "transition1.pool") == (4, 16, 4, 4)  # (16 + 2 * 8) * 0.5 channels
    assert shape(tiny, "classifier") == (4, 10)
    assert densenet(batch=1).num_params() == PARAMS["densenet121"]  # depth None: 121
    with pytest.raises(ValueError, match="depth"):
        densenet(depth=100, batch=1)
    with pytest.raises(ValueError, match="give depth 11"):
        densenet(depth=12, blocks=(2, 2), growth=8, init_features=16, batch=1)


def test_inception_v4_minimum_size():
    assert shape(inception_v4(batch=1, image_size=75), "reduction_b.concat") == (1, 1536, 1, 1)
    with pytest.raises(ValueError, match="at least 75"):
        inception_v4(batch=1, image_size=74)


def test_registry_defaults_and_errors():
    assert shape(build_model("lenet"), "data")[1:] == (1, 28, 28)
    assert shape(build_model("resnet20"), "data")[1:] == (3, 32, 32)
    assert shape(build_model("resnet", depth=20), "fc")[1] == 10  # only a CIFAR ResNet has depth 20
    assert shape(build_model("resnet", variant="cifar", depth=56), "data")[2] == 32
    assert shape(build_model("resnet"), "data")[2] == 224  # ResNet-50
    assert shape(build_model("inception_v4", batch=1), "data") == (1, 3, 299, 299)
    assert shape(build_model("alexnet", batch=3, num_classes=5), "fc8") == (3, 5)
    assert build_model("densenet_tiny", batch=2).num_params() == 15_546
    assert build_model("vgg", depth=11, batch=1).num_params() == PARAMS["vgg11"]
    net = build_model("ResNet-50", batch=2, dtype="float64")
    assert net.num_params() == PARAMS["resnet50"] and net.node("data").dtype == "float64"
    natural_order = "unknown model 'resnet51'.*available:.*inception_v4.*resnet18, resnet20.*resnet50"
    with pytest.raises(ValueError, match=natural_order):
        build_model("resnet51")
    with pytest.raises(ValueError, match="fixes depth=16"):
        build_model("vgg16", depth=19)
    with pytest.raises(ValueError, match="no depth option"):
        build_model("lenet", depth=5)
    with pytest.raises(dl.OptionError, match=r"lenet5?: batch must be an integer >= 1, got 0"):
        build_model("lenet", batch=0)
    for name, spec in M.MODELS.items():
        assert callable(spec.builder) and spec.description, name


def test_model_counts_are_integers_never_truncated():
    import numpy as np

    assert build_model("lenet", batch=np.int64(4), image_size=8, in_channels=1).input_nodes[0].shape[0] == 4
    with pytest.raises(dl.OptionError, match=r"lenet5?: batch must be an integer >= 1, got 4.5 \(float\)"):
        build_model("lenet", batch=4.5)
    with pytest.raises(dl.OptionError, match=r"densenet: blocks must be .* entry 0 is 2.5 \(float\)"):
        densenet(blocks=(2.5, 2), batch=2, image_size=32)


def test_resnet_blocks_builds_superneurons_depth_family():
    """blocks=(6, 32, k, 6): the family SuperNeurons' depth table grows, depth 3 (44 + k) + 2."""
    net = build_model("resnet", blocks=(6, 32, 5, 6), batch=1)
    assert net.name == "resnet149" and weighted_layers(net, include_shortcuts=False) == 149
    assert net.node("layer2.31.conv3") and net.node("layer3.4.conv3")
    assert weighted_layers(build_model("resnet", blocks=(6, 32, 788, 6), batch=1), include_shortcuts=False) == \
        weighted_layers(resnet(2500, batch=1), include_shortcuts=False)
    with pytest.raises(ValueError, match="make depth 149"):
        build_model("resnet", depth=152, blocks=(6, 32, 5, 6), batch=1)
    with pytest.raises(ValueError, match="four positive integers"):
        build_model("resnet", blocks=(6, 32, 0, 6), batch=1)
