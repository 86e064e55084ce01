"""COMET (Jin et al., VLDB 2022) on its own networks: training memory with activations stored SZ-compressed,
against `none`, liveness and a JPEG-ACT-style compressor; accuracy over seeds.

**How the figures are made.** Memory is the planner's peak (plan peak = executor peak, held by the tests), for
AlexNet, VGG-16, ResNet-18 and ResNet-50 at 224 px and a training batch, with SGD + momentum state. The
compressed plans reserve each stored activation's block from its *measured* compression ratio
(`decisions.compress.plan_compress(ratios=...)`, with the planner's margin): the ratios are measured by two
training steps of the same network at batch 1 (the first sets the adaptive bound, the second's ratios are
used), on the 8x8 digits upsampled to 224 px (the images this machine has; ImageNet's are not here), and a ratio
is a per-tensor figure that does not depend on the batch. The comparator codec (`codec.jpeg_act`) is measured on
the very same tensors, at the lowest JPEG quality whose median relative error over the tensors with a numeric
reader (convolution, linear, batch norm) is no larger than SZ's there (equal error, so a fair size), and stores
a tensor read only for its sign as a 1-bit mask (the ReLU mask a DCT cannot keep). Both are planned by the same
planner with the same margin.

Against bf16 (`--math bf16`, which stores every activation in 16 bits, exactly): the same stored activations' bytes
in bf16 over their SZ-compressed bytes, COMET's ratio over a half-precision run's activations (the compressor
reads float32 tensors: a bf16 plan compresses nothing more).

Accuracy: ResNet-20 on the digits, `none` and `compress` (rho* = 1 %), the same seed, data order and steps for
both, over several seeds; the table gives each policy's mean and standard deviation and the mean difference,
against the spread of the uncompressed runs themselves.
"""
from __future__ import annotations

import time

import numpy as np

from ..codec import jpeg_act, sz
from ..data import BatchIterator, digits
from ..memory.compressed import CompressedStore
from ..memory.decisions.compress import backward_readers, plan_compress
from ..memory.errorbound import ErrorBoundRule, ReaderKind
from ..models import build_model
from ..optim import SGD
from ..optim.schedules import Cosine
from ..runtime.executor import Executor
from .search import plan_on
from .tables import Report, Row, Table, machine_meta

NETS = {"alexnet": dict(name="alexnet"), "vgg16": dict(name="vgg16"), "resnet18": dict(name="resnet", depth=18),
        "resnet50": dict(name="resnet", depth=50)}
LABELS = {"alexnet": "AlexNet", "vgg16": "VGG-16", "resnet18": "ResNet-18", "resnet50": "ResNet-50"}
BATCH = 64
QUICK_NETS = ("alexnet",)
QUALITIES = (50, 75, 90, 95, 98, 99, 100)
TARGET = 0.01
SEEDS = (0, 1, 2, 3, 4)
STEPS = 500
ACC_BATCH = 32
PAPER_VS_BASELINE = 13.5
PAPER_VS_OTHER = 1.8
_NOT_IMAGENET = "digits upsampled to 224 px (no ImageNet here) measure the ratios; peaks planned, CPU"


def _images(net) -> tuple[np.ndarray, np.ndarray]:
    """The digits, upsampled (bilinear in effect: repeat then a 3x3 box blur) to the net's input, 3 channels."""
    shape = net.input_nodes[0].shape
    d = digits(seed=0)
    x = d.x[:shape[0]].astype(np.float64)[:, :1]
    rep = -(-shape[2] // x.shape[2])
    x = np.kron(x, np.ones((1, 1, rep, rep)))[:, :, :shape[2], :shape[3]]
    p = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), mode="edge")
    x = sum(p[:, :, i:i + shape[2], j:j + shape[3]] for i in range(3) for j in range(3)) / 9.0
    x = (x - x.mean()) / (x.std() + 1e-12)
    return np.repeat(x, shape[1], axis=1).astype(np.float32), d.y[:shape[0]]


def _rel(x: np.ndarray, y: np.ndarray) -> float:
    d = x.astype(np.float64)
    den = np.sqrt(np.mean(d * d))
    return float(np.sqrt(np.mean((d - y) ** 2)) / den) if den > 0 else 0.0


def measure_ratios(key: str, log) -> dict:
    """Per stored tensor: SZ's ratio (the store's figures) and the comparator's, on one step's activations."""
    net = build_model(**NETS[key], batch=1)
    opt = SGD(lr=0.01, momentum=0.9)
    plan = plan_on(net, "compress", "cpu")
    ex = Executor(net, plan, opt, seed=0)
    readers = {t: r for t, r in backward_readers(ex.route).items() if r}
    store = ex.compressed = CompressedStore(readers, ErrorBoundRule(TARGET), backend=ex.be)
    seen: dict = {}
    encode = store.compress

    def recording(tid, src, block):   # installed before the first step: the compiled step records this call
        encode(tid, src, block)
        seen[tid] = np.array(store._host(src))

    store.compress = recording
    x, y = _images(net)
    ex.train_step(x, y)                                   # rule B0; the next step's bounds are measured ones
    seen.clear()
    t = time.perf_counter()
    ex.train_step(x, y)
    log(f"  {key}: ratios measured on a batch-1 step ({time.perf_counter() - t:.1f} s, {len(seen)} tensors)")
    sign_only = {t for t, rs in readers.items() if all(r.kind is ReaderKind.SIGN for r in rs)}
    sz_err = [_rel(v, sz.decompress(sz.compress(v, store.figures[t].eb, "huffman"), v.shape))
              for t, v in seen.items() if t not in sign_only]
    if not seen or not sz_err:
        raise RuntimeError(f"comet: no stored activation of {key} was seen compressed")
    target_err = float(np.median(sz_err))
    quality, jp = QUALITIES[-1], {}
    for q in QUALITIES:
        errs = {t: _rel(v, jpeg_act.decompress(jpeg_act.compress(v, q), v.shape)) for t, v in seen.items()
                if t not in sign_only}
        if float(np.median(list(errs.values()))) <= target_err or q == QUALITIES[-1]:
            quality = q
            break
    for t, v in seen.items():
        n = len(jpeg_act.compress(v, quality)) if t not in sign_only else -(-v.size // 8) + jpeg_act.HEADER_BYTES
        jp[t] = v.nbytes / n
    return {"sz": store.ratios(), "jpeg": jp, "quality": quality, "sz_median_rel_err": target_err}


def memory_rows(key: str, log) -> dict:
    """Peaks (bytes) at the training batch: none, liveness, compress (SZ ratios), compress (comparator ratios)."""
    r = measure_ratios(key, log)
    net = build_model(**NETS[key], batch=BATCH)
    out = {p: plan_on(net, p, "cpu").peak_bytes for p in ("none", "liveness")}
    live = plan_on(net, "liveness", "cpu")
    out["compress"] = plan_compress(live.route, None, ratios=r["sz"]).peak_bytes
    out["jpeg_act"] = plan_compress(live.route, None, ratios=r["jpeg"]).peak_bytes
    raw = {t: live.route.tensors[t].nbytes for t in r["sz"]}
    out["stored_raw"] = sum(raw.values())
    out["stored_sz"] = sum(raw[t] / r["sz"][t] for t in raw)
    out["stored_jpeg_act"] = sum(raw[t] / r["jpeg"].get(t, 1.0) for t in raw)
    out.update(quality=r["quality"], sz_median_rel_err=r["sz_median_rel_err"], tensors=len(r["sz"]),
               sz_ratio_median=float(np.median(list(r["sz"].values()))),
               jpeg_ratio_median=float(np.median(list(r["jpeg"].values()))))
    log(f"  {key} b{BATCH}: none {out['none'] / 2**30:.2f} GiB, liveness {out['liveness'] / 2**30:.2f} GiB, "
        f"compress {out['compress'] / 2**30:.2f} GiB, jpeg-act (q{out['quality']}) {out['jpeg_act'] / 2**30:.2f} GiB")
    return out


def accuracy(seed: int, steps: int, policy: str) -> float:
    """Held-out accuracy of ResNet-20 on the digits after `steps` steps (SGD 0.05, momentum 0.9, cosine to 0)."""
    data = digits(seed=0)
    train, held = data.split(0.2, seed=0)
    net = build_model("resnet", depth=20, batch=ACC_BATCH, image_size=8, in_channels=1, num_classes=10)
    opt = SGD(lr=0.05, momentum=0.9)
    ex = Executor(net, plan_on(net, policy, "cpu"), opt, seed=seed)
    if policy == "compress":
        readers = {t: r for t, r in backward_readers(ex.route).items() if r}
        ex.compressed = CompressedStore(readers, ErrorBoundRule(TARGET), backend=ex.be)
    it = BatchIterator(train, ACC_BATCH, seed=seed, shuffle=True, drop_last=True)
    sched = Cosine(steps)
    for k in range(steps):
        opt.lr = sched.lr(0.05, k)
        ex.train_step(*it.next_batch())
    n = (len(held) // ACC_BATCH) * ACC_BATCH
    correct = 0
    for i in range(0, n, ACC_BATCH):
        _, logits = ex.evaluate(held.x[i:i + ACC_BATCH].astype(np.float32), held.y[i:i + ACC_BATCH])
        correct += int((logits.argmax(axis=1) == held.y[i:i + ACC_BATCH]).sum())
    return correct / n


def codec_time(batch: int = 64) -> dict:
    """The codec's time in ResNet-20's third training step (CIFAR shape): the first compiles and sets the bound."""
    net = build_model("resnet", depth=20, batch=batch, image_size=32, num_classes=10)
    opt = SGD(lr=0.01, momentum=0.9)
    ex = Executor(net, plan_on(net, "compress", "cpu"), opt, seed=0)
    readers = {t: r for t, r in backward_readers(ex.route).items() if r}
    store = ex.compressed = CompressedStore(readers, ErrorBoundRule(TARGET), backend=ex.be)
    x = np.random.default_rng(0).standard_normal(net.input_nodes[0].shape).astype(np.float32)
    y = np.arange(batch) % 10
    for _ in range(2):
        ex.train_step(x, y)
    store.compress_s = store.decompress_s = 0.0
    t = time.perf_counter()
    ex.train_step(x, y)
    return {"step_s": time.perf_counter() - t, "codec_s": store.compress_s + store.decompress_s,
            "compress_s": store.compress_s, "decompress_s": store.decompress_s, "batch": batch}


def _x(v: float) -> str:
    return f"{v:.1f}x"


def run(quick: bool, log) -> Report:
    keys = QUICK_NETS if quick else tuple(NETS)
    mem = {k: memory_rows(k, log) for k in keys}
    acc = codec = None
    if not quick:
        acc = {p: [] for p in ("none", "compress")}
        for seed in SEEDS:
            for p in acc:
                t = time.perf_counter()
                acc[p].append(accuracy(seed, STEPS, p))
                log(f"  digits ResNet-20 seed {seed} {p}: {acc[p][-1]:.4f} ({time.perf_counter() - t:.0f} s)")
        codec = codec_time()
        log(f"  codec: {codec['codec_s']:.2f} s of a {codec['step_s']:.2f} s ResNet-20 b{codec['batch']} step")
    return report(mem, acc, codec, quick)


def measured(result: dict) -> tuple[dict, dict | None, dict | None]:
    """`report`'s arguments, read back from the JSON it wrote."""
    rows = {r["key"]: r for t in result["tables"] for r in t["rows"]}
    mem = {k.split("/", 1)[1]: r["detail"] for k, r in rows.items() if k.startswith("none/") and k != "none/best"}
    acc = {p: rows[f"accuracy/{p}"]["detail"]["runs"] for p in ("none", "compress")} if not result["quick"] else None
    codec = rows["codec/resnet20"]["detail"] if not result["quick"] else None
    return mem, acc, codec


def report(mem: dict, acc: dict | None, codec: dict | None, quick: bool) -> Report:
    """The tables of the measured figures (`acc`, `codec` None in a --quick run); every figure is made here, so
    the committed JSON rebuilds them."""
    detail = {k: {f: v for f, v in m.items()} for k, m in mem.items()}
    t_none = Table("comet-none", f"Peak training memory, compress vs none (batch {BATCH}, 224 px)", "x less",
                   note="Peaks from the planner (SGD with momentum); compressed blocks reserved from measured ratios.")
    t_live = Table("comet-liveness", f"Peak training memory, compress vs liveness (batch {BATCH}, 224 px)",
                   "x less")
    t_jpeg = Table("comet-jpeg", f"Peak training memory, compress vs a JPEG-ACT-style codec (batch {BATCH})",
                   "x less", note="The comparator at the lowest JPEG quality whose median relative error is no "
                   "larger than SZ's on the same tensors; sign-only tensors as 1-bit masks.")
    for k in mem:
        m = mem[k]
        q = k in QUICK_NETS
        t_none.rows.append(Row(f"none/{k}", LABELS[k], None, _x(m["none"] / m["compress"]),
                               f"paper gives 'up to {PAPER_VS_BASELINE}x' over five nets; {_NOT_IMAGENET}",
                               q, detail[k]))
        t_none.rows.append(Row(f"stored/{k}", f"{LABELS[k]}: activations stored for backward", None,
                               _x(m["stored_raw"] / m["stored_sz"]),
                               "raw / SZ-compressed bytes of the tensors the bound allows, not the whole peak", q))
        t_live.rows.append(Row(f"liveness/{k}", LABELS[k], None, _x(m["liveness"] / m["compress"]),
                               "the paper's baseline frees nothing early; liveness is minidl's own", q))
        t_jpeg.rows.append(Row(f"jpeg/{k}", LABELS[k], None, _x(m["jpeg_act"] / m["compress"]),
                               f"our JPEG-ACT-style codec at quality {m['quality']}, not the paper's framework", q))
        t_jpeg.rows.append(Row(f"jpeg-stored/{k}", f"{LABELS[k]}: activations stored for backward", None,
                               _x(m["stored_jpeg_act"] / m["stored_sz"]),
                               "the compressed activations alone, not the whole peak", q))
    if not quick:
        t_none.rows.append(Row("none/best", "best of the four", PAPER_VS_BASELINE,
                               _x(max(m["none"] / m["compress"] for m in mem.values())),
                               "four of the paper's five nets; " + _NOT_IMAGENET))
        t_jpeg.rows.append(Row("jpeg/best", "best of the four", PAPER_VS_OTHER,
                               _x(max(m["jpeg_act"] / m["compress"] for m in mem.values())),
                               "comparator: our JPEG-ACT-style codec"))
    t_half = Table("comet-bf16", "Activations stored for backward: bf16 over SZ-compressed (rho* = 1 %)", "x less",
                   note="bf16 stores each of these activations in half their float32 bytes, exactly; SZ's bytes are "
                        "the measured ones. The paper compares float32 runs only.")
    for k in mem:
        m = mem[k]
        t_half.rows.append(Row(f"bf16/{k}", f"{LABELS[k]}: stored activations, bf16 / SZ", None,
                               _x(m["stored_raw"] / 2 / m["stored_sz"]),
                               f"bf16 {m['stored_raw'] / 2 / 2**30:.2f} GiB, SZ {m['stored_sz'] / 2**30:.2f} GiB of "
                               f"float32 {m['stored_raw'] / 2**30:.2f} GiB; the paper has no half-precision run",
                               k in QUICK_NETS, {"stored_bf16": m["stored_raw"] // 2}))
    tables = [t_none, t_live, t_jpeg, t_half]
    if acc is not None:
        a = {p: (float(np.mean(v)), float(np.std(v, ddof=1))) for p, v in acc.items()}
        diff = float(np.mean(np.subtract(acc["compress"], acc["none"])))
        setup = (f"ResNet-20 on the 8x8 digits (CPU), {STEPS} steps at batch {ACC_BATCH}, seeds "
                 f"{SEEDS[0]}-{SEEDS[-1]}; the paper: ImageNet")
        tables.append(Table("comet-accuracy", "Held-out accuracy, mean +- standard deviation over seeds", "%", [
            Row("accuracy/none", "none", None, f"{100 * a['none'][0]:.2f} +- {100 * a['none'][1]:.2f}",
                setup + " (the paper's baseline accuracy is ImageNet top-1)", detail={"runs": acc["none"]},
                varies="kernel"),
            Row("accuracy/compress", "compress (rho* = 1 %)", "little or no loss",
                f"{100 * a['compress'][0]:.2f} +- {100 * a['compress'][1]:.2f}", setup,
                detail={"runs": acc["compress"]}, varies="kernel"),
            Row("accuracy/difference", "compress - none (mean of paired runs)", None, f"{100 * diff:+.2f} points",
                f"against the uncompressed runs' own spread of {100 * a['none'][1]:.2f} points", varies="kernel"),
        ]))
    if codec is not None:
        c = codec
        tables.append(Table("comet-codec", "Codec time in a training step (CPU, measured)", "s", [
            Row("codec/resnet20", f"ResNet-20 (CIFAR shape) at batch {c['batch']}: codec / step", None,
                f"{c['codec_s']:.2f} / {c['step_s']:.2f}",
                "the paper's codec runs on the GPU; ours on the CPU (numba), on a shared machine", detail=c,
                varies="time")]))
    return Report("comet", 'Jin et al., "COMET: A Novel Memory-Efficient Deep Learning Training Framework by '
                  'Using Error-Bounded Lossy Compression", VLDB 2022',
                  "The paper: five CNNs on ImageNet, a Caffe fork, one fixed SZ bound on conv inputs, up to 13.5x "
                  "less memory than its baseline and 1.8x less than another compression framework. Ours: four of "
                  "those CNNs planned at 224 px with minidl's adaptive bound (rho* = 1 %) and Huffman-coded SZ.",
                  tables, quick, machine_meta())
