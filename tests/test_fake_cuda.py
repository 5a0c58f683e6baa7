"""GPU-only Python lines traced on fake CUDA tensors, on a machine without a GPU.

Under torch's FakeTensorMode a tensor can live on device "cuda" with no GPU behind it:
shapes, dtypes and devices propagate, no kernel runs, and an op that mixes a CPU and a
CUDA tensor raises FakeTensorDeviceMismatchError, as the GPU would. Each test loads or
builds what the GPU path loads (the eager backend, every precision policy, the guard,
the calibration, Runtime's CUDA branch) with "cuda" as its device.

The `fake_cuda` fixture enters the mode for the model's move to the device (Module.to
"cuda" inside the mode makes fake CUDA parameters) and for the calls the test makes
inside `with fake_cuda:`. Values read back to the host come from a `probe`, which checks
what the graph returned and answers with real zeros of the same shape.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import tiny_spec
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorDeviceMismatchError,
    FakeTensorMode,
    unset_fake_temporarily,
)

from engine.classify.artifact import Artifact

S = 112     # tiny input size: 8 x 8 patches
B = 4       # static batch of the fakes


def _to_cuda(args, kwargs) -> bool:
    dev = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
    return dev is not None and torch.device(dev).type == "cuda"


@pytest.fixture
def fake_cuda(monkeypatch):
    """A FakeTensorMode; moves to "cuda" (Module.to, Tensor.to) anywhere make fake CUDA tensors.

    Ops on fake tensors run in their mode wherever they happen, so code under test runs as
    it is, outside `with fake_cuda:`; real host tensors stay real (and a fake CUDA tensor
    meeting one raises FakeTensorDeviceMismatchError).
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    monkeypatch.setattr(torch.__future__, "get_overwrite_module_params_on_conversion", lambda: True)
    for cls in (torch.nn.Module, torch.Tensor):
        def to_fake(self, *args, _to=cls.to, **kwargs):
            if not _to_cuda(args, kwargs):
                return _to(self, *args, **kwargs)
            with mode:
                if isinstance(self, torch.Tensor) and not isinstance(self, FakeTensor):
                    # a real host tensor (an inference tensor cannot be faked): its shape on fake CUDA
                    return torch.empty(self.shape, dtype=self.dtype, device="cuda")
                return _to(self, *args, **kwargs)

        monkeypatch.setattr(cls, "to", to_fake)
    return mode


def _artifact(tmp_path, precision: str, guard: bool, batch: int = B) -> Artifact:
    """A cuda eager artifact of a 2-block tiny EVA-02 (random weights: only devices matter here)."""
    from engine.backends import eager
    from engine.core.checkpoint import create_model

    spec = dataclasses.replace(tiny_spec("squash", batch, precision),
                               model_kwargs={"depth": 2})
    torch.manual_seed(0)
    tmp_path.mkdir(parents=True, exist_ok=True)
    eager.save(create_model(spec), spec, "cuda", tmp_path)
    return Artifact(tmp_path, spec, "eager", "cuda", precision, batch, {}, {"guard": {"tau": 0.1}} if guard else {})


def _probe(fn, seen: list):
    """fn's outputs checked (device cuda, dtypes) and replaced by real host zeros of their shape."""
    def probe(x):
        out = fn(x)
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        seen.append([(o.device.type, o.dtype, tuple(o.shape)) for o in outs])
        with unset_fake_temporarily():          # (when called inside the mode)
            real = [torch.zeros(o.shape, dtype=o.dtype) for o in outs]
        return real if isinstance(out, (list, tuple)) else real[0]
    return probe


def test_calibration_feeds_the_low_precision_graph_on_its_device(fake_cuda, tmp_path):
    """engine.build's guard calibration classifies host pixels with the graph the run executes."""
    from engine.backends import eager
    from engine.tuning import calibrate

    art = _artifact(tmp_path, "bf16", guard=True)
    low = eager.load(art, torch.device("cuda"))
    seen: list = []
    pixels = np.random.default_rng(0).integers(0, 256, (6, S, S, 3), dtype=np.uint8)   # host pixels
    # host chunks in: the backend's function moves them (before the fix: a device mismatch)
    top1, margins = calibrate.classify(_probe(low, seen), pixels, B, margin=True)
    # and as engine.build calls it: each chunk uploaded once to the graph's device
    calibrate.classify(_probe(low, seen), pixels, B, margin=True, device="cuda")
    assert top1.shape == (6,) and margins.shape == (6,)
    assert seen == [[("cuda", torch.int32, (B,)), ("cuda", torch.float32, (B,))]] * 4


def test_a_cuda_graph_refuses_host_input_when_nothing_moves_it(fake_cuda, tmp_path):
    """The fake device check is real: a bare policy module on fake CUDA rejects a CPU batch."""
    from engine.backends import eager

    art = _artifact(tmp_path, "bf16", guard=False)
    fn = eager.load(art, torch.device("cuda"))
    module = fn.fn                     # the policy Top1Model behind the backend's input move
    with pytest.raises(FakeTensorDeviceMismatchError):
        module(torch.zeros((B, S, S, 3), dtype=torch.uint8))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "fp8"])
def test_eager_backend_runs_every_policy_on_cuda_and_takes_any_input_device(fake_cuda, tmp_path, precision):
    """Each policy's graph (fp8 through torch._scaled_mm) traces on CUDA, from a CUDA or a host batch."""
    from engine.backends import eager

    art = _artifact(tmp_path, precision, guard=precision != "fp32")
    fn = eager.load(art, torch.device("cuda"))
    with fake_cuda:
        on_gpu = torch.zeros((B, S, S, 3), dtype=torch.uint8, device="cuda")
    for x in (on_gpu, torch.zeros((B, S, S, 3), dtype=torch.uint8)):
        out = fn(x)
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        assert [(o.device.type, o.dtype, tuple(o.shape)) for o in outs] == \
            [("cuda", torch.int32, (B,))] + ([("cuda", torch.float32, (B,))] if precision != "fp32" else [])
    if precision == "fp8":
        from engine.core.precision import Fp8Linear

        layer = next(m for m in fn.fn.modules() if isinstance(m, Fp8Linear))
        assert layer.weight.device.type == "cuda" and layer.weight.dtype == torch.float8_e4m3fn


class _Event:
    def __init__(self, *args, **kwargs):
        self.recorded = 0

    def record(self, *args):
        self.recorded += 1

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 1.0


def _fake_guard(recheck, monkeypatch, rows=(1, 3)):
    """A CUDA guard whose host read of the margins (the one value-dependent step) names `rows`."""
    from engine.classify.guard import Guard

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: self)   # no pinned memory without a GPU
    guard = Guard(recheck, 0.5, batch=4, device="cuda", make_event=_Event,
                  make_host=lambda n: torch.empty(n, dtype=torch.float32))
    assert guard.deferred
    monkeypatch.setattr(guard, "_low_rows", lambda b: (np.array(rows), np.full(b.host.shape[0], 0.1, np.float32)))
    return guard


def test_guard_gathers_and_rechecks_cuda_rows_on_the_device(fake_cuda, tmp_path, monkeypatch):
    from engine.backends import eager

    recheck = eager.load(_artifact(tmp_path / "r", "fp32", guard=False), torch.device("cuda"))
    seen: list = []

    def fp32(x):
        seen.append((x.device.type, tuple(x.shape)))
        return recheck(x)

    guard = _fake_guard(fp32, monkeypatch)
    outs = []
    with fake_cuda:
        for _ in range(3):                                     # 2 rows a batch: 6 rows -> 1 full call + 1 at finish
            x = torch.zeros((8, S, S, 3), dtype=torch.uint8, device="cuda")
            top1 = torch.zeros(8, dtype=torch.int32, device="cuda")
            margin = torch.zeros(8, dtype=torch.float32, device="cuda")
            outs.append(guard.apply(x, top1, margin))
        guard.finish()
    assert seen == [("cuda", (4, S, S, 3))] * 2 and guard.stats.calls == 2 and guard.stats.rechecked == 6
    assert all(o.device.type == "cuda" and o.dtype == torch.int32 for o in outs)
    assert guard._changed.device.type == "cuda"                # counted on the device, read at the report


def test_runtime_cuda_branch_uploads_replays_graphs_and_guards_on_the_device(fake_cuda, tmp_path, monkeypatch):
    """Runtime on "cuda": the upload ring, CUDA-graph capture and replay of both graphs, the guard."""
    import contextlib

    from engine.backends import eager
    from engine.classify.runtime import Runtime

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    art = _artifact(tmp_path / "low", "bf16", guard=True, batch=8)
    low = eager.load(art, torch.device("cuda"))
    recheck = eager.load(_artifact(tmp_path / "r", "fp32", guard=False), torch.device("cuda"))
    guard = _fake_guard(recheck, monkeypatch)
    with fake_cuda:
        rt = Runtime(low, art, torch.device("cuda"), cuda_graphs=True, guard=guard)
        assert rt.cuda_graph and rt._ring is not None
        host = np.zeros((8, S, S, 3), np.uint8)                # a decoded batch on the host
        outs = [rt.run_async(host, valid=8) for _ in range(3)]
        rt.finish()
    assert all(o.device.type == "cuda" and o.dtype == torch.int32 for o in outs)
    assert Graph.replays == 3 + 2                              # 3 low-precision batches, 2 re-check calls
    assert len(rt._events) == 3                                # GPU busy time: events around each batch
