"""The GPU decoders' hand-over to inference, the capture order, and FP32 without TF32, on a CPU.

Fakes cannot show stream order on a device, so the design is checked where it is decided:
- each GPU decoder works on its own stream; the batch it yields comes with an event that
  inference's stream waits for on the device, and the batch is kept alive for that stream
  (`record_stream`); no host synchronisation per batch (no `synchronize()` of a stream or
  the device, no upload from pageable memory), counted on fake streams and events;
- torchvision's nvJPEG outputs land on a stream that holds nothing else;
- the contest ABI captures its CUDA graphs only after the decoder (a DALI GPU pipeline
  allocates while it builds, on its own thread) is built;
- FP32 graphs run with TF32 off at every point where one runs, and the manifest and the
  run's report say so.
"""
from __future__ import annotations

import contextlib
import io
import threading

import numpy as np
import pytest
import torch
from conftest import tiny_spec
from PIL import Image
from test_fake_cuda import fake_cuda  # noqa: F401 - the fixture
from torch._subclasses.fake_tensor import unset_fake_temporarily

S = 112
B = 4


class Log:
    """What the fakes saw: host syncs by kind, and the device-side ordering calls."""

    def __init__(self):
        self.host_syncs: list[str] = []     # "stream:NAME", "device", "pageable upload", ...
        self.event_waits: list[str] = []    # host waits on an event: the stream it was recorded on
        self.calls: list[tuple] = []        # ("wait_event", consumer, producer), ("record_stream", name), ...


class FakeStream:
    def __init__(self, log: Log, name: str):
        self.log, self.name = log, name

    def synchronize(self):
        self.log.host_syncs.append(f"stream:{self.name}")

    def wait_event(self, ev):
        self.log.calls.append(("wait_event", self.name, ev.stream.name))

    def wait_stream(self, other):
        self.log.calls.append(("wait_stream", self.name, other.name))


@pytest.fixture
def streams(monkeypatch, fake_cuda):  # noqa: F811
    """torch.cuda's streams, events and syncs replaced by fakes that log; returns the Log.
    The thread's current stream starts as "inference"; torch.cuda.stream(s) switches it."""
    log = Log()
    local = threading.local()
    inference = FakeStream(log, "inference")
    made = iter(f"s{i}" for i in range(100))

    def current(*_a, **_k):
        return getattr(local, "stream", inference)

    @contextlib.contextmanager
    def use(s):
        before = current()
        local.stream = s
        try:
            yield
        finally:
            local.stream = before

    class Event:
        def __init__(self, *a, **k):
            self.stream = None

        def record(self, stream=None):
            self.stream = stream or current()

        def synchronize(self):
            log.event_waits.append(self.stream.name)

    def pageable(self, *args, **kwargs):
        dev = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
        if dev is not None and torch.device(dev).type == "cuda" and self.device.type == "cpu":
            if not (getattr(self, "_pinned", False) and kwargs.get("non_blocking", False)):
                log.host_syncs.append("pageable upload")
        return to(self, *args, **kwargs)

    def as_tensor(data, *args, **kwargs):
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
            log.host_syncs.append("pageable upload")
            with fake_cuda:
                return torch.empty(np.shape(data), dtype=torch.int64, device="cuda")
        return real_as_tensor(data, *args, **kwargs)

    def pin(t):
        with unset_fake_temporarily():              # a real host buffer of its shape, marked page-locked
            out = torch.empty(t.shape, dtype=t.dtype)
        out._pinned = True
        return out

    to, real_as_tensor = torch.Tensor.to, torch.as_tensor
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: FakeStream(log, next(made)))
    monkeypatch.setattr(torch.cuda, "current_stream", current)
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.host_syncs.append("device"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: log.calls.append(("record_stream", s.name)),
                        raising=False)
    monkeypatch.setattr(torch.Tensor, "to", pageable)
    monkeypatch.setattr(torch, "as_tensor", as_tensor)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: pin(self))   # no pinned memory here
    monkeypatch.setenv("ENGINE_DECODER_ISOLATE", "0")       # the PIL reference in this process
    return log


def _jpeg(seed: int, size=(150, 130), subsampling: int = 2) -> bytes:
    px = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "JPEG", quality=90, subsampling=subsampling)
    return buf.getvalue()


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((90, 90, 3), seed, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


class HostRuntime:
    """Inference's side: records which stream it ran on and what that stream had waited for."""

    def __init__(self, log: Log):
        self.batch_size, self.log, self.seen = B, log, []

    def run(self, arr):
        self.seen.append((torch.cuda.current_stream().name, arr.device.type, tuple(arr.shape)))
        self.log.calls.append(("run", torch.cuda.current_stream().name))
        return np.zeros(B, np.int32)


def _classify(decoder, blobs, log):
    from engine.classify.pipeline import classify

    rt = HostRuntime(log)
    res = classify(lambda i: blobs[i], len(blobs), decoder, rt, readers=2, depth=0)
    return res, rt


def _assert_handed_over(log: Log, rt: HostRuntime, batches: int, stream):
    assert log.host_syncs == [], log.host_syncs            # nothing waits on the host per batch
    assert stream is not None and stream.name != "inference"   # the decoder's own stream
    producer = stream.name
    assert all(s == producer for s in log.event_waits) and len(log.event_waits) <= batches
    assert rt.seen == [("inference", "cuda", (B, S, S, 3))] * batches
    runs = [i for i, c in enumerate(log.calls) if c[0] == "run"]
    waits = [i for i, c in enumerate(log.calls) if c == ("wait_event", "inference", producer)]
    kept = [i for i, c in enumerate(log.calls) if c == ("record_stream", "inference")]
    assert len(runs) == len(waits) == batches and len(kept) >= batches
    for k, r in enumerate(runs):    # batch k: inference waited for its event and kept it, before running
        assert waits[k] < r and any(w < r for w in kept[k:k + 1]), log.calls


def test_dali_gpu_batches_come_on_their_own_stream_with_an_event_and_no_host_sync(fake_cuda, streams,  # noqa: F811
                                                                                  monkeypatch):
    import nvidia.dali.plugin.pytorch as dali_torch

    from engine.decoders import dali

    class Pipe:
        def feed_input(self, name, data):
            if name == "enc":
                self.n = len(data)

        def run(self):
            return (self,)

        def as_tensor(self):
            return self

    monkeypatch.setattr(dali.DaliDecoder, "_build", lambda self: Pipe())
    monkeypatch.setattr(dali_torch, "feed_ndarray", lambda tl, arr, cuda_stream=None: arr)
    spec = tiny_spec("squash", B)
    blobs = [_jpeg(i) for i in range(3 * B)]
    blobs[5] = _png(5)                       # routed to the PIL reference: an upload of host pixels
    with fake_cuda:
        dec = dali.create("dali-gpu", spec, B, 1)
        res, rt = _classify(dec, blobs, streams)
    assert not res.failed
    _assert_handed_over(streams, rt, 3, getattr(dec, "stream", None))


def test_nvjpeg_outputs_land_on_a_stream_of_their_own(fake_cuda, streams, monkeypatch):  # noqa: F811
    import torchvision.io

    from engine.decoders import nvjpeg

    landed = []

    def decode_jpeg(data, mode=None, device=None):
        landed.append(torch.cuda.current_stream().name)      # torchvision allocates on the caller's stream
        return [torch.zeros((3, 130, 150), dtype=torch.uint8, device="cuda") for _ in data]

    monkeypatch.setattr(torchvision.io, "decode_jpeg", decode_jpeg)
    spec = tiny_spec("squash", B)
    blobs = [_jpeg(i, subsampling=0) for i in range(2 * B)]   # 4:4:4: the GPU path takes them
    blobs[2] = _jpeg(2)                                        # 4:2:0: the CPU reference, uploaded
    with fake_cuda:
        dec = nvjpeg.create("nvjpeg", spec, B, 1)
        res, rt = _classify(dec, blobs, streams)
    assert not res.failed
    _assert_handed_over(streams, rt, 2, getattr(dec, "stream", None))
    landing = dec._landing.name
    assert landed == [landing, landing] and landing not in ("inference", dec.stream.name)
    assert streams.calls.count(("wait_stream", dec.stream.name, landing)) == 2
    assert streams.calls.count(("record_stream", dec.stream.name)) == 2 * B - 1   # each decoded image


def test_the_abi_captures_cuda_graphs_only_after_the_decoder_is_built(tmp_path, small_cohort, monkeypatch):
    """A slow decoder build (a DALI GPU pipeline allocates on the device while it builds) ends
    before the capture starts."""
    import time

    import engine.classify.runtime as runtime
    import engine.decoders as decoders
    from engine.tuning import build
    from evaluator.contest import run as contest_run

    art = tmp_path / "art"
    build(tiny_spec("squash", B), None, art, backend="null")
    order: list[str] = []
    make, load = decoders.make_decoder, runtime.load_runtime

    def slow_make(*a, **k):
        time.sleep(0.5)
        d = make(*a, **k)
        order.append("decoder built")
        return d

    def loading(artifact, *a, capture=True, **k):
        rt = load(artifact, *a, capture=False, **k)
        rt.capture_graphs = lambda: order.append("capture")
        if capture:
            rt.capture_graphs()
        return rt

    monkeypatch.setattr(decoders, "make_decoder", slow_make)
    monkeypatch.setattr(runtime, "load_runtime", loading)
    monkeypatch.setenv("ENGINE_ARTIFACT", str(art))
    monkeypatch.setenv("ENGINE_DECODER", "pil")
    monkeypatch.setenv("ENGINE_DECODER_ISOLATE", "0")
    out = tmp_path / "pred.i32"
    assert contest_run.main([str(small_cohort / "manifest.tsv"), str(small_cohort), str(out)]) == 0
    assert order == ["decoder built", "capture"]


@pytest.fixture
def tf32_on():
    """TF32 switched on, as a process (or torch's cuDNN default) may have it; restored after."""
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def test_the_runtime_runs_fp32_without_tf32_and_reports_it(tmp_path, tf32_on, monkeypatch):
    from engine import backends
    from engine.classify.artifact import load_artifact
    from engine.classify.runtime import load_runtime
    from engine.tuning import build

    build(tiny_spec("squash", B), None, tmp_path / "art", backend="null")
    seen = []

    def probe(x):
        seen.append(_flags())
        return torch.zeros(x.shape[0], dtype=torch.int32)

    monkeypatch.setattr(backends.get("null"), "load", lambda art, dev: probe)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    rt = load_runtime(load_artifact(tmp_path / "art"))
    rt.run(np.zeros((B, S, S, 3), np.uint8))
    assert seen == [(False, False)]
    assert rt.report()["fp32_math"] == {"tf32_matmul": False, "tf32_conv": False}
    monkeypatch.setenv("ENGINE_TF32", "1")              # the one switch to match a TF32 reference
    rt = load_runtime(load_artifact(tmp_path / "art"))
    rt.run(np.zeros((B, S, S, 3), np.uint8))
    assert seen[-1] == (True, True) and rt.report()["fp32_math"]["tf32_conv"] is True


def test_the_build_calibrates_against_fp32_without_tf32_and_records_it(tmp_path, tiny_checkpoint, tf32_on,
                                                                         monkeypatch):
    from engine.tuning import GuardConfig, build, calibrate

    meta = build(tiny_spec("squash", B), None, tmp_path / "null", backend="null")
    assert meta["fp32_math"] == {"tf32_matmul": False, "tf32_conv": False}

    class Stop(Exception):
        pass

    seen = []

    def classify(fn, *a, **k):   # the guard's calibration: the low graph, then the FP32 reference
        seen.append(_flags())
        if len(seen) == 2:
            raise Stop
        return calibrate_classify(fn, *a, **k)

    calibrate_classify = calibrate.classify
    monkeypatch.setattr(calibrate, "classify", classify)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    with pytest.raises(Stop):
        build(tiny_spec("squash", 16, "bf16"), tiny_checkpoint, tmp_path / "bf16", backend="eager",
              guard=GuardConfig(calibration_source="renders", calibration_count=16))
    assert seen == [(False, False), (False, False)]


def test_the_reference_runs_fp32_without_tf32(tmp_path, tf32_on, monkeypatch):
    from engine.core import checkpoint
    from evaluator.contest import reference

    seen = []

    class Net(torch.nn.Module):
        def forward(self, x):
            seen.append(_flags())
            return torch.zeros((x.shape[0], 10))

    img = tmp_path / "a.jpg"
    img.write_bytes(_jpeg(0))
    monkeypatch.setattr(checkpoint, "load_model", lambda spec, ck: Net())
    top1 = reference.reference_top1(tiny_spec(), tmp_path / "unused", [img])
    assert list(top1) == [0] and seen == [(False, False)]
