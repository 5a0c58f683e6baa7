"""CPU-side checks of the GPU path: uploads never race, the AOT loader's CUDA-graph flag,
graph capture status, FP8 GEMMs against their twin, and the TensorRT backend's guards."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.classify.runtime import UploadRing, _capture
from engine.core.precision import Fp8Linear, apply_policy, describe, fp8_reference


class _LazyCopy:
    """What an async host->device copy is until its stream reaches it: a read of the buffer later."""

    def __init__(self, buf):
        self.buf, self.value = buf, None

    def land(self):
        if self.value is None:
            self.value = self.buf.data.copy()


class _Buf:
    def __init__(self, shape, flights):
        self.data, self.flights = np.zeros(shape, np.uint8), flights

    def copy_(self, x):
        self.data[...] = np.asarray(x)

    def to(self, device, non_blocking=False):
        c = _LazyCopy(self)
        self.flights.append(c)
        return c


class _Event:
    """Records the copies issued before it; synchronize() lands them (the copy engine caught up)."""

    def __init__(self, flights):
        self.flights, self.mine = flights, []

    def record(self):
        self.mine = list(self.flights)

    def synchronize(self):
        for c in self.mine:
            c.land()


def test_upload_ring_never_rewrites_a_buffer_before_its_copy_landed():
    flights: list = []
    shape = (2, 4, 4, 3)
    ring = UploadRing(shape, "cuda", n=2, make_buffer=lambda: _Buf(shape, flights),
                      make_event=lambda: _Event(flights))
    batches = [np.full(shape, v, np.uint8) for v in (1, 2, 3, 4, 5)]
    copies = [ring.upload(b) for b in batches]   # the stream lags: nothing lands until an event syncs
    for c in copies:
        c.land()
    assert [int(c.value[0, 0, 0, 0]) for c in copies] == [1, 2, 3, 4, 5]
    # one buffer without the events would classify batch n on batch n+1's pixels
    flights2: list = []
    bad = UploadRing(shape, "cuda", n=1, make_buffer=lambda: _Buf(shape, flights2),
                     make_event=lambda: type("NoSync", (), {"record": lambda s: None, "synchronize": lambda s: None})())
    lazy = [bad.upload(b) for b in batches[:2]]
    for c in lazy:
        c.land()
    assert [int(c.value[0, 0, 0, 0]) for c in lazy] == [2, 2]


def test_aot_loader_runs_single_threaded_under_cuda_graphs(monkeypatch, tmp_path):
    from engine.backends import aot

    seen = []

    def runner(kind):
        class Runner:
            def __init__(self, *args):
                seen.append((kind, args))

            def run(self, xs):
                return xs
        return Runner

    monkeypatch.setattr(torch._C._aoti, "AOTIModelContainerRunnerCuda", runner("cuda"), raising=False)
    monkeypatch.setattr(torch._C._aoti, "AOTIModelContainerRunnerCpu", runner("cpu"), raising=False)
    art = type("A", (), {"device": "cuda", "path": lambda s, n: tmp_path / n})()
    aot.load(art, torch.device("cuda"))
    art.device = "cpu"
    fn = aot.load(art, torch.device("cpu"))
    # (so path, runners, device, cubin dir, run_single_threaded): single-threaded under CUDA graphs
    assert [k for k, _ in seen] == ["cuda", "cpu"] and seen[0][1][-1] is True
    x = torch.zeros((2, 4, 4, 3), dtype=torch.uint8)
    assert fn(x)[0] is x                               # already on the graph's device: no copy


def test_capture_failure_is_reported_not_hidden(capsys):
    fn, status = _capture(lambda x: x, (2, 4, 4, 3), torch.device("cuda"))
    if torch.cuda.is_available():
        pytest.skip("capture works here")
    assert status.startswith("failed(") and "CUDA graph capture failed" in capsys.readouterr().err
    assert fn(1) == 1


@pytest.mark.parametrize("k,n", [(192, 576), (2730, 1024), (1024, 2730), (64, 17)])
def test_fp8_linear_matches_its_twin_and_pads_exactly(k, n):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n)
    layer = Fp8Linear(lin.weight, lin.bias)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.shape[0] % 16 == 0
    x = torch.randn(3, 7, k)
    y = layer(x)
    assert y.shape == (3, 7, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), fp8_reference(layer, x), rtol=2e-2, atol=2e-2)
    rel = (y.float() - lin(x)).abs().max() / lin(x).abs().max()
    assert rel < 0.08                                    # e4m3 keeps ~3 significant bits per operand


def test_fp8_policy_keeps_head_norms_and_patch_embed(tiny_checkpoint):
    from conftest import tiny_spec

    from engine.core.checkpoint import load_model
    from engine.core.precision import Fp32Linear, Fp32Norm

    net = load_model(tiny_spec(), tiny_checkpoint)
    low = apply_policy(net, "fp8")
    assert any(isinstance(m, Fp8Linear) for m in low.modules())
    assert isinstance(low.head, Fp32Linear) and any(isinstance(m, Fp32Norm) for m in low.modules())
    assert low.patch_embed.proj.weight.dtype == torch.float32
    x = torch.randn(2, 3, 112, 112)
    with torch.inference_mode():
        a, b = low(x), net(x)
    assert a.dtype == torch.float32 and (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.5
    assert "float8" in describe("fp8")["gemm"]


def test_tensorrt_backend_is_one_file_and_refuses_clearly_without_a_gpu(tmp_path):
    from engine import backends

    trt = backends.get("trt")
    assert trt.FILES and trt.COMPILED and trt.NEEDS_WEIGHTS
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the refusal without one is not reachable; tests/test_gpu.py "
                    "builds and loads a TensorRT artifact when torch_tensorrt is installed")
    with pytest.raises(RuntimeError, match="GPU"):
        trt.save(torch.nn.Linear(2, 2), None, "cpu", tmp_path)


def test_nvjpeg_routing_sends_subsampled_jpegs_to_the_reference():
    import io

    from PIL import Image

    from engine.core.spec import Spec
    from engine.decoders.route import jpeg_header, route

    px = (np.random.default_rng(0).random((64, 80, 3)) * 255).astype(np.uint8)
    blobs = []
    for sub in (0, 1, 2):                             # 4:4:4, 4:2:2, 4:2:0
        buf = io.BytesIO()
        Image.fromarray(px).save(buf, "JPEG", quality=90, subsampling=sub)
        blobs.append(buf.getvalue())
    assert [jpeg_header(b).subsampled for b in blobs] == [False, True, True]
    spec = Spec(model="m", input_size=32, crop_mode="squash")
    fast, slow, failed = route(blobs, spec, modes=("RGB", "L"), subsampled=False)
    assert [i for i, _ in fast] == [0] and slow == [1, 2] and not failed
    fast, slow, _ = route(blobs, spec)                 # DALI (fancy upsampling) takes all three
    assert [i for i, _ in fast] == [0, 1, 2] and slow == []


@pytest.mark.abi
def test_build_sh_defaults_to_the_measured_build_on_every_device(tmp_path):
    """The submission build measures precision, batch and backend on the machine it runs on, GPU or CPU."""
    import os
    import subprocess

    from conftest import REPO

    ck = tmp_path / "model.safetensors"
    ck.write_bytes(b"not a safetensors file: the build stops before it measures anything")
    env = {**os.environ, "ENGINE_CHECKPOINT": str(ck), "ENGINE_DEVICE": "cuda", "ENGINE_ARTIFACT": str(tmp_path / "a"),
           "ENGINE_MODEL": "eva02_tiny_patch14_224.mim_in22k", "FORCE": "1"}
    for k in ("ENGINE_PRECISION", "ENGINE_BATCH_SIZE", "ENGINE_BACKEND"):
        env.pop(k, None)
    for device in ("cuda", "cpu"):
        env["ENGINE_DEVICE"] = device
        r = subprocess.run([str(REPO / "build.sh")], env=env, capture_output=True, text=True, cwd=REPO, timeout=300)
        assert f"backend auto on {device}, precision auto, batch auto ->" in r.stderr, r.stderr
        assert r.returncode != 0, r.stderr   # the unreadable checkpoint (or the missing GPU) stops it, in one line
