"""`minidl evaluate` and `minidl predict`: a checkpoint written by `train --save`, on held-out data or images."""
from __future__ import annotations

from pathlib import Path

from ..core.errors import OptionError
from .common import build_net, say_written, token_figures


def _checkpoint_meta(args) -> dict:
    """The --checkpoint's metadata (its manifest verified, the arrays not read yet); --seed defaults to its seed,
    so the held-out split of --data digits is the training run's."""
    from ..runtime.checkpoint import read_manifest

    if not Path(args.checkpoint).expanduser().is_file():
        raise OptionError(f"--checkpoint: no checkpoint file at {args.checkpoint}")
    meta = read_manifest(args.checkpoint).get("meta", {})
    if args.seed is None:
        args.seed = meta.get("seed", 0)
    return meta


def _checkpoint_session(args, meta: dict, image_shape, num_classes):
    """A session of the checkpoint's network with its parameters and BN statistics (parameters only: no optimizer
    state or data position is needed to infer), at the checkpoint's batch unless --batch says otherwise."""
    from minidl.models import is_sequence_model

    from ..backend import get_backend
    from ..optim import make_optimizer
    from ..runtime.session import RunConfig, Session

    args.batch = args.batch or max(1, meta.get("batch", 32) // max(1, meta.get("ranks", 1)))
    saved = meta.get("data") or {}
    if is_sequence_model(args.model):  # the sequence length it trained on (its data's sample shape is (T,))
        if args.seq is None and len(saved.get("image_shape", ())) == 1:
            args.seq = int(saved["image_shape"][0])
        net = build_net(args, None, num_classes or saved.get("num_classes"))
    else:
        net = build_net(args, image_shape or tuple(saved.get("image_shape", ())) or None,
                     num_classes or saved.get("num_classes"))
    backend = get_backend(args.backend, math=args.math)
    sess = Session(net, make_optimizer("sgd", 0.0), policy="liveness", seed=args.seed, backend=backend, math=args.math,
                   config=RunConfig(debug=args.debug))
    sess.load(args.checkpoint, params_only=True)
    return sess


def cmd_evaluate(args) -> dict:
    """The held-out loss and accuracy, computed as `train` computes them at its end (Session.evaluate, every
    sample, the split of the checkpoint's seed), so a checkpoint's accuracy is the one its run printed."""
    from minidl.models import model_objective

    from ..data import load_data
    from ..data.text import MASKED, text_vocab

    meta = _checkpoint_meta(args)
    objective = model_objective(args.model)
    if objective is not None:  # the network first: its sequence length cuts the text
        sess = _checkpoint_session(args, meta, None, text_vocab(objective))
        _, heldout = load_data(args.data, seed=args.seed, seq=sess.net.input_nodes[0].shape[1], objective=objective)
    else:
        _, heldout = load_data(args.data, seed=args.seed)
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
    """Classes (argmax of the logits, in inference mode) for --input images or a --data set's samples."""
    import numpy as np

    from minidl.models import is_sequence_model

    from ..data import load_data

    if is_sequence_model(args.model):
        raise OptionError(f"predict gives the classes of images; model '{args.model}' reads token sequences: "
                          f"minidl evaluate gives its held-out loss and accuracy")
    if (args.input is None) == (args.data is None):
        raise OptionError("predict: give either --input IMAGES.npy or --data SPEC")
    meta = _checkpoint_meta(args)
    labels = None
    if args.input is not None:
        try:
            x = np.load(Path(args.input).expanduser(), allow_pickle=False)
        except (OSError, ValueError) as e:
            raise OptionError(f"--input {args.input}: not a readable .npy array ({e})") from None
        if x.ndim != 4:
            raise OptionError(f"--input {args.input}: images must be an array (N, C, H, W), got shape {x.shape}")
        sess = _checkpoint_session(args, meta, tuple(x.shape[1:]), None)
    else:
        train, heldout = load_data(args.data, seed=args.seed)
        data = heldout if heldout is not None else train
        x, labels = data.x, data.y
        sess = _checkpoint_session(args, meta, data.image_shape, data.num_classes)
    classes = sess.predict_classes(x)
    out = {"model": args.model, "checkpoint": args.checkpoint, "iteration": meta.get("iteration"),
           "count": len(classes), "classes": classes.tolist()}
    if labels is not None:
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
