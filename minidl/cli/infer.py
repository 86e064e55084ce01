"""`minidl evaluate` and `minidl predict`: a checkpoint written by `train --save`, on held-out data or images.

`--checkpoint` alone rebuilds the run (its recipe, data source and input transform); options given override, but
the network must still be the checkpoint's (parameters and input shape).
"""
from __future__ import annotations

from pathlib import Path

from ..core.errors import OptionError
from .checks import check_paths_apart
from .common import build_net, check_data_kind, say_written, token_figures


def _checkpoint_meta(args, wants_data: bool) -> dict:
    """The verified metadata; MODEL, --data (if `wants_data`) and --seed (the held-out split) default to it."""
    from ..runtime.checkpoint import read_manifest

    if not Path(args.checkpoint).expanduser().is_file():
        raise OptionError(f"--checkpoint: no checkpoint file at {args.checkpoint}")
    meta = read_manifest(args.checkpoint).get("meta", {})
    if args.seed is None:
        args.seed = meta.get("seed", 0)
    if args.model is None:
        if not meta.get("recipe"):
            raise OptionError(f"--checkpoint {args.checkpoint} does not record its model (its network was built by "
                              f"hand, or by an older minidl): give MODEL and the options it was trained with")
        args.model = meta["recipe"]["model"]
    if wants_data and args.data is None:
        args.data = (meta.get("data") or {}).get("source")
        if args.data is None:
            raise OptionError(f"--checkpoint {args.checkpoint} does not record the data it was trained on: give "
                              f"--data")
        check_paths_apart(args)   # the data's files are known only now
    return meta


def _checkpoint_session(args, meta: dict, image_shape, num_classes):
    """A session of the checkpoint's network and parameters (no optimizer state), at its batch unless --batch;
    without a recipe, the options with the data's shape and classes."""
    from minidl.models import canonical_model, is_sequence_model

    from ..backend import get_backend
    from ..optim import make_optimizer
    from ..runtime.session import RunConfig, Session

    args.batch = args.batch or max(1, meta.get("batch", 32) // max(1, meta.get("ranks", 1)))
    saved = meta.get("data") or {}
    trained = tuple(saved.get("image_shape", ())) or None
    recipe = meta.get("recipe")
    if recipe and canonical_model(args.model) == recipe.get("model"):
        net = build_net(args, None, None, recipe)
    elif is_sequence_model(args.model):  # the sequence length it trained on
        if args.seq is None and trained is not None and len(trained) == 1:
            args.seq = int(trained[0])
        net = build_net(args, None, num_classes or saved.get("num_classes"))
    else:
        net = build_net(args, trained or image_shape, num_classes or saved.get("num_classes"))
    reads = tuple(net.input_nodes[0].shape[1:])
    if trained is not None and reads != trained:
        raise OptionError(f"the options build a network reading samples of shape {reads}, but --checkpoint "
                          f"{args.checkpoint} was trained on {trained}: leave out the options that change it")
    classes = net.logits_node.shape[-1]
    if num_classes is not None and not is_sequence_model(args.model) and num_classes > classes:
        raise OptionError(f"--data {args.data} has {num_classes} classes, but the network of --checkpoint "
                          f"{args.checkpoint} tells {classes} apart")
    backend = get_backend(args.backend, math=args.math)
    sess = Session(net, make_optimizer("sgd", 0.0), policy="liveness", seed=args.seed, backend=backend, math=args.math,
                   config=RunConfig(debug=args.debug))
    sess.load(args.checkpoint, params_only=True)
    return sess


def _transform(args, meta: dict):
    """The checkpoint's input transform (None: images taken as they were)."""
    from ..data.transform import InputTransform

    return InputTransform.from_json((meta.get("data") or {}).get("transform"), f"--checkpoint {args.checkpoint}")


def cmd_evaluate(args) -> dict:
    """Held-out loss and accuracy as `train` computes them at its end: the run's printed accuracy."""
    from minidl.models import model_objective

    from ..data import load_data
    from ..data.text import MASKED, text_vocab

    meta = _checkpoint_meta(args, wants_data=True)
    check_data_kind(args.model, args.data)
    objective = model_objective(args.model)
    if objective is not None:  # the network first: its sequence length cuts the text
        sess = _checkpoint_session(args, meta, None, text_vocab(objective))
        _, heldout = load_data(args.data, seed=args.seed, seq=sess.net.input_nodes[0].shape[1], objective=objective)
    else:
        _, heldout = load_data(args.data, seed=args.seed, transform=_transform(args, meta))
    if heldout is None:
        raise OptionError(f"--data {args.data}: has no held-out samples to evaluate on (digits holds out 20%; "
                          f"cifar10:DIR and mnist:DIR need their test files in DIR)")
    if objective is None:
        sess = _checkpoint_session(args, meta, heldout.image_shape, heldout.num_classes)
    loss, acc = sess.evaluate(heldout)
    out = {"model": args.model, "checkpoint": args.checkpoint, "iteration": meta.get("iteration"),
           "data": args.data, "samples": len(heldout)}
    if objective == MASKED:
        out.update(token_figures(objective, loss, acc, heldout))
        if not args.json:
            print(f"{args.checkpoint} (step {meta.get('iteration')}): held-out masked-token loss {loss:.4f}, "
                  f"masked-token accuracy {acc:.2%}, over the {out['masked_tokens']:,} masked tokens of "
                  f"{len(heldout)} sequences of --data {args.data}")
        return out
    if objective is not None:
        out.update(token_figures(objective, loss, acc, heldout))
        if not args.json:
            print(f"{args.checkpoint} (step {meta.get('iteration')}): held-out loss {loss:.4f} per token "
                  f"(perplexity {out['perplexity']:.2f}), next-token accuracy {acc:.2%}, on {len(heldout)} "
                  f"sequences of --data {args.data}")
        return out
    out.update({"loss": loss, "accuracy": acc})
    if not args.json:
        print(f"{args.checkpoint} (step {meta.get('iteration')}): held-out accuracy {acc:.2%}, mean loss "
              f"{loss:.4f}, on {len(heldout)} samples of --data {args.data}")
    return out


def cmd_predict(args) -> dict:
    """Classes for --input images or --data samples (default the checkpoint's data), through its input transform."""
    import numpy as np

    from minidl.models import is_sequence_model

    from ..data import load_data
    from ..data.files import read_array
    from ..data.transform import as_network_input

    if args.input is not None and args.data is not None:
        raise OptionError("predict: give either --input IMAGES.npy or --data SPEC, not both")
    meta = _checkpoint_meta(args, wants_data=args.input is None)
    if is_sequence_model(args.model):
        raise OptionError(f"predict gives the classes of images; model '{args.model}' reads token sequences: "
                          f"minidl evaluate gives its held-out loss and accuracy")
    if args.data is not None:
        check_data_kind(args.model, args.data)
    transform = _transform(args, meta)
    labels = None
    if args.input is not None:
        where = f"--input {args.input}"
        x = read_array(args.input, "--input")
        if x.ndim != 4:
            raise OptionError(f"{where}: images must be an array (N, C, H, W), got shape {x.shape}")
        x = as_network_input(x, transform, where)
        sess = _checkpoint_session(args, meta, tuple(x.shape[1:]), None)
        reads = tuple(sess.net.input_nodes[0].shape[1:])
        if tuple(x.shape[1:]) != reads:
            raise OptionError(f"{where}: images of shape {tuple(x.shape[1:])}, but the network of --checkpoint "
                              f"{args.checkpoint} reads {reads}")
    else:
        train, heldout = load_data(args.data, seed=args.seed, transform=transform)
        data = heldout if heldout is not None else train
        x, labels = data.x, data.y
        sess = _checkpoint_session(args, meta, data.image_shape, data.num_classes)
    classes = sess.predict_classes(x)
    out = {"model": args.model, "checkpoint": args.checkpoint, "iteration": meta.get("iteration"),
           "count": len(classes), "classes": classes.tolist()}
    if labels is not None:
        out["data"] = args.data
        out["accuracy"] = float((classes == labels).mean()) if len(classes) else None
    if args.output:
        np.save(args.output, classes)
        out["output"] = args.output
    if not args.json:
        shown = classes if args.limit == 0 else classes[:args.limit]
        print(f"{len(classes)} predictions" + (f", accuracy {out['accuracy']:.2%}" if labels is not None else "")
              + f"; the first {len(shown)}: " + " ".join(map(str, shown.tolist())))
    say_written(args, [("classes", args.output)])
    return out
