"""`minidl train`: the options checked against the data, the session planned and run, then its report."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..core import startup
from ..core.errors import DivergenceError, OptionError
from .checks import best_path
from .common import (
    build_net,
    check_data_kind,
    cost_table,
    cpu_menu,
    fused_update_option,
    measured_device,
    memory_json,
    moved_line,
    plan_request,
    plot_title,
    say_written,
    token_figures,
)

SYNTHETIC_NOTE = ("minidl: no --data: training on random synthetic images (normal noise, labels a function of "
                  "it; nothing real is learned). --data digits trains on the handwritten digits minidl ships")


def cmd_train(args) -> dict:
    from ..backend import get_backend
    from ..dist.launch import communicator, guarded, with_nccl

    comm = communicator(args.dist, args.comm_timeout)  # None: one plain process (not under mpiexec)
    backend = get_backend(args.backend, device=comm.local_rank if comm is not None else 0, math=args.math,
                          menu=cpu_menu(args))
    comm = with_nccl(comm, backend, args.dist)
    return guarded(comm, lambda: _train(args, backend, comm))


@dataclass(slots=True)
class _TrainInputs:
    """What `_train_inputs` checked and built before any session exists."""

    net: object
    opt: object
    train: object
    heldout: object
    device: object
    costs: object
    note: str | None = None


def _train(args, backend, comm) -> dict:
    """`minidl train`: inputs checked, then the run, then its report."""
    with startup.phase("inputs"):
        inputs = _train_inputs(args, backend)
    sess, res, log = _train_run(args, inputs, backend, comm)
    return _train_report(args, sess, res, log, inputs.heldout, comm, inputs.train)


def _train_inputs(args, backend) -> _TrainInputs:
    """Check the options against the data and build the session's parts: every user error comes before planning."""
    from minidl.models import is_sequence_model

    from ..data import load_data
    from ..optim import make_optimizer

    batch = args.batch or 32
    args.batch = batch
    note = None
    if args.data is None and not is_sequence_model(args.model):
        args.data, note = "synthetic", SYNTHETIC_NOTE
    if is_sequence_model(args.model):
        train, heldout, net = _sequence_inputs(args)
    elif args.data != "synthetic":
        check_data_kind(args.model, args.data)
        train, heldout = load_data(args.data, seed=args.seed, augment=args.augment)
        net = build_net(args, train.image_shape, train.num_classes)
    else:
        net = build_net(args)
        shape = net.input_nodes[0].shape[1:]
        k = net.logits_node.shape[1]
        train, heldout = load_data("synthetic", seed=args.seed, image_shape=shape, num_classes=k,
                                   num_samples=max(4 * batch, 256), augment=args.augment)
    if len(train) < batch:
        raise OptionError(f"--batch {batch} exceeds the {len(train)} training samples of --data {args.data}; "
                          f"lower --batch")
    if args.resume and not Path(args.resume).expanduser().is_file():
        raise OptionError(f"--resume: no checkpoint file at {args.resume}")
    if args.save_every and not args.save:
        raise OptionError("--save-every needs --save PATH.npz: the path the checkpoints are written to")
    if args.eval_every and not args.early_stop:
        raise OptionError("--eval-every sets how often --early-stop evaluates: give --early-stop PATIENCE too")
    if args.early_stop and heldout is None:
        raise OptionError(f"--early-stop watches the held-out loss, but --data {args.data} has no held-out part "
                          f"(digits, npz, npy and images have one; cifar10:DIR and mnist:DIR need their test files)")
    opt = make_optimizer(args.optimizer, args.lr, args.momentum, args.weight_decay)
    device, costs = args.device, cost_table(args, backend)
    if device == "measured":
        device = measured_device(net, opt, backend, costs)
    return _TrainInputs(net, opt, train, heldout, device, costs, note)


def _sequence_inputs(args):
    """A language model's text data (default `stdlib`), with its objective's targets, and the network."""
    from minidl.models import model_objective

    from ..data import load_data
    from ..data.text import text_vocab

    if args.data in (None, "synthetic"):
        args.data = "stdlib"
    if args.data.partition(":")[0].strip().lower() not in ("stdlib", "text"):
        raise OptionError(f"--data {args.data}: model '{args.model}' reads token sequences; give --data stdlib "
                          f"(Python's own sources) or --data text:PATH")
    objective = model_objective(args.model)
    vocab = text_vocab(objective)
    if args.num_classes not in (None, vocab):
        raise OptionError(f"--num-classes {args.num_classes}: --data {args.data} is byte-level text, a vocabulary "
                          f"of {vocab} for {objective} targets" + (" (256 bytes and [MASK])" if vocab > 256 else ""))
    net = build_net(args, num_classes=vocab)
    train, heldout = load_data(args.data, seed=args.seed, augment=args.augment, seq=net.input_nodes[0].shape[1],
                               objective=objective)
    return train, heldout, net


def _train_run(args, inputs: _TrainInputs, backend, comm):
    """(session, fit's result, step log or None); on divergence --save keeps the last good state."""
    from ..optim.schedules import make_schedule
    from ..runtime.session import RunConfig, Session
    from ..runtime.steplog import StepLog

    request = plan_request(args)
    config = RunConfig(debug=args.debug, trace=bool(args.trace), host_limit_bytes=args.host_limit,
                       costs=inputs.costs, fused_update=fused_update_option(args), paged=request.options.paged_chunk,
                       bucket_bytes=args.bucket_size, reduction=args.reduction, graphs=args.cuda_graph == "on")
    sess = Session(inputs.net, inputs.opt, policy=request.policy, budget=request.budget, seed=args.seed,
                   backend=backend, device=inputs.device, comm=comm, micro_batches=args.micro_batches, math=args.math,
                   config=config)
    lead = comm is None or comm.rank == 0  # rank 0 alone reports, plots and traces
    args.quiet = not lead
    if args.resume:
        sess.load(args.resume, params_only=args.resume_params_only)
    # the schedule spans the whole run: a resume follows the uninterrupted run's schedule
    sess.lr_schedule = make_schedule(args.lr_schedule, sess.iteration + args.steps, args.warmup_steps,
                                     args.lr_step_size, args.lr_gamma, args.lr_min)
    log = StepLog(args.log, sess) if args.log and lead else None
    early = None
    if args.early_stop:
        from ..runtime.earlystop import EarlyStop

        early = EarlyStop(args.early_stop, args.eval_every, best_path=best_path(args.save) if args.save else None)
    if inputs.note and lead and not args.json:
        print(inputs.note, file=sys.stderr)
    try:
        res = sess.fit(inputs.train, args.steps, progress=None if lead and not args.no_progress and not args.json
                       else False, on_step=log, save_every=args.save_every, save_path=args.save,
                       heldout=inputs.heldout, early_stop=early)
    except DivergenceError as e:  # the update was not applied: what is saved is the last good state
        if args.save:
            e.args = (f"{e}; the last good state (after step {e.iteration - 1}) is saved in "
                      f"{sess.save(args.save)}",)
        raise
    finally:
        if log is not None:
            log.close()
    return sess, res, log


def _train_report(args, sess, res, log, heldout, comm, train=None) -> dict:
    """The run's JSON fields, its files written and the text summary (ranks other than 0: the fields only)."""
    from minidl.models import model_objective

    from ..data.text import SequenceDataset
    from ..memory.host import transfer_json
    from ..memory.report import plot_timeline, write_trace
    from ..memory.report.fit import check_fit
    from ..memory.simulate import simulate

    out = {"model": args.model, "data": args.data, "batch": args.batch, "steps": args.steps,
           "steps_done": res.steps, "interrupted": res.interrupted, "backend": args.backend, "math": sess.math,
           "final_loss": res.final_loss, "step_time_s": res.median_step_time, f"{res.unit}_per_s": res.throughput,
           "iteration": sess.executor.iteration, "pool_peak_bytes": sess.executor.pool.peak,
           "step_runner": sess.executor.step_runner, "graph_fallback": sess.executor.graph_fallback,
           "device_profile": getattr(sess.device, "note", sess.device)}
    out.update(memory_json(sess.plan))
    out.update(_startup_json(sess.executor.be))
    # `minidl plan`'s verdict: by how much the plan fits (planning refused a budget too small)
    fit = check_fit(sess.plan, sess.target.profile, sess.request.budget)
    out.update(fit.to_json())
    out["recompute_flops_share"] = simulate(sess.plan, "cpu").recompute_flops_share
    # over the steps after the first (which compiles kernels), as the step times
    out.update(transfer_json(sess.executor.host, len(res.warm_step_times) or 1, res.transfers_after_first))
    if heldout is not None and not res.interrupted:
        loss, acc = sess.evaluate(heldout)
        if isinstance(heldout, SequenceDataset):
            out.update(token_figures(model_objective(args.model), loss, acc, heldout, train, held="heldout_"))
        else:
            out["accuracy"] = acc
            out["heldout_loss"] = loss
    if comm is not None:
        from ..dist.report import dist_json

        out.update(dist_json(sess, res))
    written = []  # (what, path)
    if args.save:
        # fit already wrote the last completed step when interrupted or when --save-every fell on it
        already = res.saved and (res.interrupted or (args.save_every and sess.iteration % args.save_every == 0))
        path = res.saved[-1] if already else sess.save(args.save)
        out["saved"] = str(path)
        written.append((f"checkpoint (step {sess.iteration})", path))
    if res.early_stop is not None:
        out["stopped_early"] = res.stopped_early
        out["early_stop"] = res.early_stop.to_json()
        if res.best_saved is not None:
            out["best_saved"] = str(res.best_saved)
            written.append((f"best checkpoint (step {res.early_stop.best_iteration})", res.best_saved))
    if log is not None:
        out["log"] = str(log.path)
        written.append(("step log", log.path))
    if args.quiet:
        return out
    if args.plot:
        plot_timeline(sess.plan, args.plot, title=plot_title(args, sess.plan), budget=args.budget)
        out["plot"] = args.plot
        written.append(("memory timeline", args.plot))
    if args.trace:
        write_trace(args.trace, sess.plan, sess.executor.trace)
        out["trace"] = args.trace
        written.append(("trace", args.trace))
    if not args.json:
        _print_train_summary(args, sess, res, out, comm, fit)
    say_written(args, written)
    return out


def _startup_json(backend) -> dict:
    """The startup's seconds and parts (`core/startup.py`) and what the backend loaded from its cache or built."""
    rep = startup.CLOCK.report()
    return {"startup_s": rep.startup_s, "startup_parts": rep.parts, "startup_after_first_step": rep.later,
            "startup_caches": backend.startup_caches()}


def _print_train_summary(args, sess, res, out: dict, comm, fit) -> None:
    """The text `minidl train` ends with."""
    from ..memory.host import copies_line

    print(sess.report().format())
    print(fit.format())
    print(moved_line(out["moved_bytes_by_role"]))
    line = (f"final loss {res.final_loss:.4f}, median step {res.median_step_time * 1e3:.1f} ms "
            f"({sess.math}), {res.throughput:.1f} {res.unit}/s")
    if "perplexity" in out:
        line += (f", held-out loss {out['heldout_loss']:.4f} (perplexity {out['perplexity']:.2f}; a unigram model's "
                 f"{out['unigram_loss']:.4f}), next-token accuracy {out['accuracy']:.2%}")
    elif "heldout_masked_token_loss" in out:
        line += (f", held-out masked-token loss {out['heldout_masked_token_loss']:.4f} (a unigram model's "
                 f"{out['unigram_masked_token_loss']:.4f}), masked-token accuracy "
                 f"{out['heldout_masked_token_accuracy']:.2%} ({out['masked_tokens']:,} masked tokens)")
    elif "accuracy" in out:
        line += f", held-out accuracy {out['accuracy']:.2%}"
    print(line)
    print("  " + startup.CLOCK.report().line())
    if out["offloaded_bytes"]:   # what the copies cost, not only their speed
        warm = res.warm_step_times
        over = f"the {len(warm)} steps after the first" if res.steps > 1 else "the one step"
        print("  " + copies_line(out, sum(warm) / len(warm), over))
    if args.backend != "cpu":   # how the steps ran: as CUDA graphs, or why not
        gs = sess.executor.graph_step
        print(f"  steps: {gs.describe()}" if gs is not None else
              f"  steps: {sess.executor.step_runner}, no CUDA graph: {sess.executor.graph_fallback}")
    if comm is not None:
        from ..dist.report import dist_line

        print(dist_line(out))
    if res.early_stop is not None:
        print(_early_stop_line(res, args.steps))
    if res.interrupted:
        print(f"interrupted after {res.steps} of {args.steps} steps (Ctrl-C)"
              + ("" if args.save else "; nothing saved: give --save PATH.npz to keep the progress"))


def _early_stop_line(res, steps: int) -> str:
    """When early stopping stopped (or not), and the best held-out loss and its step."""
    w = res.early_stop
    best = (f"best held-out loss {w.best_loss:.4f} at step {w.best_iteration}" if w.best_iteration is not None
            else "no finite held-out loss")
    if res.stopped_early:
        return (f"early stop after {res.steps} of {steps} steps: the held-out loss did not improve in "
                f"{w.rule.patience} evaluations (every {w.every} steps); {best}")
    return f"early stopping watched {len(w.evaluations)} evaluations (every {w.every} steps), no stop; {best}"
