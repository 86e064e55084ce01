"""The backend contract (`minidl.backend.base`): both backends provide every method of the `Backend` protocol with
a signature that accepts the protocol's call, declare a `Capabilities` record, provide the optional families
their record claims; and no module outside `minidl/backend/` probes a backend with getattr/hasattr."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import minidl
from minidl.backend.base import Backend, Capabilities, GraphCapture, StreamCopies, backend_name
from minidl.backend.cpu.backend import CPUBackend
from minidl.backend.cuda.backend import CUDABackend  # importing needs neither cupy nor a GPU


def _members(protocol) -> dict[str, object]:
    """The protocol's methods (name -> function) and its declared attributes (name -> None)."""
    out: dict[str, object] = {n: None for n in getattr(protocol, "__annotations__", {})}
    for name, value in vars(protocol).items():
        if not name.startswith("_") and inspect.isfunction(value):
            out[name] = value
    return out


def _accepts(impl, spec) -> str | None:
    """Why `impl` (a method of a backend class) cannot take the calls `spec` (the protocol's) describes: every
    positional parameter of the spec, in order, must be one of the impl's (or absorbed by *args), and every
    further parameter of the impl must have a default. None: compatible."""
    if isinstance(impl, (staticmethod, classmethod)):
        impl = impl.__func__
    want = [p for p in inspect.signature(spec).parameters.values() if p.name != "self"]
    params = list(inspect.signature(impl).parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_args = any(p.kind is p.VAR_POSITIONAL for p in params)
    if len(positional) < len(want) and not var_args:
        return f"takes {len(positional)} positional arguments, the protocol passes {len(want)}"
    for p in positional[len(want):]:
        if p.default is p.empty:
            return f"needs '{p.name}', which the protocol's call does not pass"
    for p in params:
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty:
            return f"needs keyword '{p.name}'"
    return None


def _violations(cls, protocol) -> list[str]:
    bad = []
    for name, spec in _members(protocol).items():
        impl = inspect.getattr_static(cls, name, None)
        if impl is None:
            if spec is None and name in _instance_attributes(cls):
                continue
            bad.append(f"{cls.__name__}.{name} is missing")
            continue
        if spec is not None:
            if isinstance(impl, property) or not callable(getattr(impl, "__func__", impl)):
                bad.append(f"{cls.__name__}.{name} is not a method")
                continue
            why = _accepts(impl, spec)
            if why:
                bad.append(f"{cls.__name__}.{name} {why}")
    return bad


def _instance_attributes(cls) -> set[str]:
    """Attributes an instance sets in __init__ or its helpers (`self.x = ...`), read from the class's source
    (the CUDA backend cannot be constructed without a GPU)."""
    src = inspect.getsource(cls)
    return set(re.findall(r"self\.(\w+)\s*(?::[^=]*)?=", src))


@pytest.mark.parametrize("cls", [CPUBackend, CUDABackend], ids=["cpu", "cuda"])
def test_the_backend_class_provides_the_protocol(cls):
    assert _violations(cls, Backend) == []
    assert isinstance(cls.capabilities, Capabilities)


@pytest.mark.parametrize("cls", [CPUBackend, CUDABackend], ids=["cpu", "cuda"])
def test_the_optional_families_are_there_exactly_where_the_capabilities_say(cls):
    caps = cls.capabilities
    for flag, protocol in (("stream_copies", StreamCopies), ("graph_capture", GraphCapture)):
        missing = _violations(cls, protocol)
        if getattr(caps, flag):
            assert missing == [], f"{flag} is declared but {missing}"
        else:
            assert missing, f"{cls.__name__} has the {protocol.__name__} methods but does not declare {flag}"
    for kernel in caps.kernels:
        assert callable(inspect.getattr_static(cls, kernel, None)), f"{cls.__name__} declares {kernel}"
    if caps.fused_update:
        assert callable(inspect.getattr_static(cls, "fuse_update", None))


def test_a_cpu_backend_instance_satisfies_the_runtime_protocol():
    be = CPUBackend()
    assert isinstance(be, Backend)
    assert backend_name(be) == "cpu" and backend_name(None) == "cpu"
    assert CUDABackend.capabilities.name == "cuda"


def _declared_by_layers() -> set[str]:
    """Every kernel some layer names in `Layer.backend_ops`."""
    from minidl import layers as L

    declared = set()
    for cls in vars(L).values():
        if isinstance(cls, type) and issubclass(cls, L.Layer) and "backend_ops" in vars(cls):
            declared |= set(_ops_of(cls))
    return declared


def test_every_kernel_a_layer_declares_is_declared_by_the_cpu_backend():
    """`Layer.backend_ops` names kernels beyond the protocol; the CPU reference has them all, in its record."""
    declared = _declared_by_layers()
    assert declared and declared <= CPUBackend.capabilities.kernels
    assert not declared & set(_members(Backend)), "a protocol kernel need not be declared by a layer"


def test_the_cuda_backend_runs_every_layer():
    """The CUDA backend declares (and, by the test above, has) every kernel a layer declares: no layer is
    refused on the GPU (the executor refuses a layer whose kernels a backend does not declare)."""
    assert _declared_by_layers() <= CUDABackend.capabilities.kernels


def _ops_of(cls) -> tuple[str, ...]:
    return tuple(re.findall(r'"(\w+_(?:forward|backward|forward_apply))"', inspect.getsource(cls.backend_ops)))


# getattr(be, ...), hasattr(self.be, ...), getattr(type(ex.be), ...), hasattr(backend, ...) and the like.
PROBE = re.compile(r"\b(?:get|has)attr\(\s*(?:type\()?\s*(?:[\w.]+\.)?(?:be|backend)\b")


def test_no_module_outside_the_backends_probes_a_backend():
    root = Path(minidl.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "backend":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if PROBE.search(line):
                found.append(f"minidl/{rel}:{i}: {line.strip()}")
    assert found == [], "backend probes (use the Backend protocol or backend.capabilities):\n" + "\n".join(found)


def test_the_probe_pattern_catches_the_forms_it_forbids():
    for probe in ('getattr(be, "fuse_update", None)', 'hasattr(self.be, op)', 'hasattr(type(self.be), "x")',
                  'getattr(ex.be, flag, False)', 'getattr(self.ex.be, f)', 'hasattr(backend, "offload_async")'):
        assert PROBE.search(probe), probe
    for fine in ('getattr(layer, "uses_rng_key", False)', 'getattr(self.engine, "thread", None)',
                 'getattr(args, "backend", None)'):
        assert not PROBE.search(fine), fine
