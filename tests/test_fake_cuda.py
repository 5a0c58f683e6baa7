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

from engine.artifact import Artifact

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
    from engine.checkpoint import create_model

    spec = dataclasses.replace(tiny_spec("squash", batch, precision),
                               model_kwargs={"depth": 2})
    torch.manual_seed(0)
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
    from engine import calibrate
    from engine.backends import eager

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
