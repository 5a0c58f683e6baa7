"""`fp8-torchao` (engine.core.fp8_torchao) traced on fake CUDA tensors, without a GPU.

The eager backend loads a tiny EVA-02 artifact of precision fp8-torchao on "cuda" under
FakeTensorMode (test_fake_cuda's fixture): torchao quantizes the GEMMs on the fake device,
and the forward's shapes, dtypes, devices and the GEMM op it dispatches are checked. The
compute capability (no GPU here) is the test's to set, and torchao's own hardware check,
which asks the real CUDA runtime, is stood in for; everything else is torchao's.
"""
from __future__ import annotations

import pytest
import torch
from test_fake_cuda import B, S, _artifact, fake_cuda  # noqa: F401 - fake_cuda: the fixture

pytest.importorskip("torchao.quantization")


@pytest.fixture
def fp8_gpu(monkeypatch):
    """A compute capability 9.0 device as far as the engine and torchao ask."""
    import torchao.quantization.quant_api as quant_api

    from engine import settings
    from engine.core import fp8_torchao

    settings.reload()
    fp8_torchao._said.clear()
    monkeypatch.setattr(fp8_torchao, "capability", lambda device: (9, 0) if device.type == "cuda" else None)
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    yield monkeypatch
    settings.reload()


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops a call dispatches."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _load(tmp_path):
    from engine.backends import eager

    return eager.load(_artifact(tmp_path, "fp8-torchao", guard=True), torch.device("cuda"))


def test_torchao_fp8_graph_runs_float8_gemms_on_cuda(fake_cuda, fp8_gpu, tmp_path, capfd):  # noqa: F811
    """Every GEMM Linear holds a torchao float8 weight on the device (e4m3, one scale per output
    row); the head stays FP32; the forward dispatches _scaled_mm and answers top-1 and margins."""
    from torchao.quantization import Float8Tensor

    from engine.core.fp8_torchao import PendingFp8
    from engine.core.precision import Fp32Linear

    fn = _load(tmp_path)
    lins = [m for m in fn.fn.modules() if isinstance(m, PendingFp8)]
    assert lins, "the policy put no GEMM in torchao's hands"
    for m in lins:
        w = m.weight
        assert isinstance(w, Float8Tensor) and w.device.type == "cuda"
        assert w.qdata.dtype == torch.float8_e4m3fn and tuple(w.scale.shape) == (w.shape[0], 1)
    head = next(m for m in fn.fn.modules() if isinstance(m, Fp32Linear))
    assert head.weight.dtype == torch.float32 and head.weight.device.type == "cuda"
    ops = _Ops()
    with fake_cuda:
        x = torch.zeros((B, S, S, 3), dtype=torch.uint8, device="cuda")
        with ops:
            top1, margin = fn(x)
    assert (top1.device.type, top1.dtype, tuple(top1.shape)) == ("cuda", torch.int32, (B,))
    assert (margin.device.type, margin.dtype, tuple(margin.shape)) == ("cuda", torch.float32, (B,))
    assert ops.seen.count("aten._scaled_mm.default") >= len(lins)
    assert capfd.readouterr().err.count("[engine] fp8-torchao") == 0      # no fallback said


@pytest.mark.parametrize("case", ["old_gpu", "no_torchao", "switched_off", "torchao_refuses"])
def test_without_torchao_fp8_one_line_and_the_fallback(fake_cuda, fp8_gpu, tmp_path, capfd, case):  # noqa: F811
    """Below compute capability 8.9: bf16 GEMMs; torchao missing, refusing, or ENGINE_FP8_TORCHAO=0 on
    an fp8 GPU: the engine's own Fp8Linear. Either way one stderr line naming the cause, and the graph runs."""
    import sys

    from engine import settings
    from engine.core import fp8_torchao
    from engine.core.precision import Fp8Linear

    if case == "old_gpu":
        fp8_gpu.setattr(fp8_torchao, "capability", lambda device: (8, 0))
    elif case == "no_torchao":
        fp8_gpu.setitem(sys.modules, "torchao.quantization", None)       # import raises ImportError
    elif case == "torchao_refuses":                                       # its own hardware check fails
        import torchao.quantization.quant_api as quant_api

        def refuse(granularity):
            raise AssertionError("Float8 dynamic quantization requires CUDA compute capability >=8.9")
        fp8_gpu.setattr(quant_api, "_check_hardware_support", refuse)
    else:
        fp8_gpu.setenv("ENGINE_FP8_TORCHAO", "0")
        settings.reload()
    fn = _load(tmp_path)
    err = [line for line in capfd.readouterr().err.splitlines() if "fp8-torchao" in line]
    why = {"old_gpu": "compute capability 8.0 < 8.9", "no_torchao": "torchao is not importable",
           "switched_off": "ENGINE_FP8_TORCHAO=0",
           "torchao_refuses": "torchao refused (AssertionError: Float8 dynamic quantization requires"}[case]
    assert len(err) == 1 and why in err[0], err
    mods = list(fn.fn.modules())
    assert not any(fp8_torchao.is_float8(getattr(m, "weight", None)) for m in mods)
    if case == "old_gpu":
        assert not any(isinstance(m, Fp8Linear) for m in mods)
        assert any(isinstance(m, fp8_torchao.PendingFp8) and m.weight.dtype == torch.bfloat16 for m in mods)
    else:
        fp8 = [m for m in mods if isinstance(m, Fp8Linear)]
        assert fp8 and all(m.weight.device.type == "cuda" and m.weight.dtype == torch.float8_e4m3fn for m in fp8)
    with fake_cuda:
        top1, margin = fn(torch.zeros((B, S, S, 3), dtype=torch.uint8, device="cuda"))
    assert top1.device.type == "cuda" and top1.dtype == torch.int32 and margin.shape == (B,)


def test_policy_record_names_torchao_and_its_fallback():
    from engine.core.precision import describe

    d = describe("fp8-torchao")
    assert d["precision"] == "fp8-torchao" and "PerRow" in d["gemm"] and "8.9" in d["fallback"]
    assert d["head"] == d["norms"] == "fp32"


def test_compare_layers_runs_both_implementations_on_cpu_kernels(fp8_gpu):
    """The device check's comparison, on torch's CPU float8 GEMM: torchao's layer is float8 and as
    close to the FP32 GEMM as the engine's own (same recipe: e4m3, per-row and per-token scales);
    no timing off CUDA. On a machine where torchao cannot run it says why instead."""
    from engine.core import fp8_torchao

    assert "no CUDA compute capability on cpu" in fp8_torchao.compare_layers("cpu")["unavailable"]
    fp8_gpu.setattr(fp8_torchao, "unavailable", lambda device: None)
    res = fp8_torchao.compare_layers("cpu", rows=64, shapes=((64, 96), (48, 32)))
    assert set(res["layers"]) == {"64x96", "48x32"}
    for row in res["layers"].values():
        assert row["torchao_float8"] is True and "torchao_ms" not in row
        assert 0 < row["engine_rel_error"] < 0.08 and 0 < row["torchao_rel_error"] < 0.08
        assert abs(row["torchao_rel_error"] - row["engine_rel_error"]) < 0.1 * row["engine_rel_error"]
