"""Runtime backends: uint8 [B, S, S, 3] in, int32 top-1 [B] out, on a static batch shape.

`eager` is the FP32 reference form (timm modules, weights converted at build time);
`aot` loads an AOTInductor package compiled ahead of time for the target device.
Nothing here compiles: a backend that would need to is an error, not a JIT.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

from engine.artifact import Artifact
from engine.spec import Spec

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BACKENDS = ("eager", "aot")


class Top1Model(torch.nn.Module):
    """Normalisation + network + argmax in one graph, so only uint8 pixels cross to the device."""

    def __init__(self, net: torch.nn.Module, spec: Spec):
        super().__init__()
        self.net = net
        self.dtype = DTYPES[spec.precision]
        self.register_buffer("mean", torch.tensor(spec.mean, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(spec.std, dtype=torch.float32).view(1, 3, 1, 1))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, S, S, 3] uint8 -> [B, 3, S, S] float32 in [0, 1], as ToTensor + Normalize do
        x = x.permute(0, 3, 1, 2).float().div(255.0)
        x = (x - self.mean) / self.std
        return self.net(x.to(self.dtype)).float()  # [B, num_classes]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(x).argmax(dim=-1).to(torch.int32)  # [B]


def wrap(net: torch.nn.Module, spec: Spec, device: str) -> Top1Model:
    """Top1Model in the spec's precision on `device` (norm buffers stay FP32)."""
    m = Top1Model(net.to(DTYPES[spec.precision]), spec).to(device).eval()
    return m


class Runtime:
    """Callable batch classifier. `run` takes exactly `batch_size` images (pad the last batch)."""

    def __init__(self, fn, artifact: Artifact, device: torch.device):
        self._fn, self.artifact, self.device = fn, artifact, device
        self.batch_size = artifact.batch_size
        self.name = artifact.backend
        self.cuda_graph = False
        shape = (self.batch_size, artifact.spec.input_size, artifact.spec.input_size, 3)
        self._pinned = torch.empty(shape, dtype=torch.uint8).pin_memory() if device.type == "cuda" else None
        if device.type == "cuda" and os.environ.get("ENGINE_CUDA_GRAPHS", "1") == "1":
            self._fn, self.cuda_graph = _capture(fn, shape, device)

    @torch.inference_mode()
    def run_async(self, batch) -> torch.Tensor:
        """batch: [B, S, S, 3] uint8 (numpy or torch, any device) -> int32 [B] on the run's device.

        On CUDA nothing synchronises: the host copy goes through a pinned buffer, and the
        result stays on the GPU until the caller gathers it.
        """
        x = torch.as_tensor(batch)
        if x.shape[0] != self.batch_size:
            raise ValueError(f"static batch shape is {self.batch_size}, got {x.shape[0]}: pad the batch")
        if self._pinned is not None and x.device.type == "cpu":
            self._pinned.copy_(x)
            x = self._pinned
        x = x.to(self.device, non_blocking=True)
        out = self._fn(x)
        if isinstance(out, (list, tuple)):
            out = out[0]
        return out.clone() if self.cuda_graph else out  # a graph reuses its output buffer

    def run(self, batch) -> np.ndarray:
        """Like run_async, gathered to the host: int32 [B]."""
        return self.run_async(batch).cpu().numpy().astype(np.int32, copy=False)


def _capture(fn, shape: tuple[int, ...], device: torch.device):
    """Replay `fn` from a CUDA graph on a static uint8 input; on failure say why and run it plainly."""
    try:
        static_in = torch.zeros(shape, dtype=torch.uint8, device=device)  # [B, S, S, 3]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # warm-up outside the graph: lazy inits, autotuned kernels
                fn(static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.inference_mode():
            static_out = fn(static_in)
        if isinstance(static_out, (list, tuple)):
            static_out = static_out[0]
    except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager launches
        print(f"[engine] CUDA graph capture failed ({type(e).__name__}: {e}); running without graphs",
              file=sys.stderr)
        return fn, False

    def replay(x: torch.Tensor) -> torch.Tensor:
        static_in.copy_(x, non_blocking=True)
        graph.replay()
        return static_out

    return replay, True


def load_runtime(artifact: Artifact, device: str | None = None) -> Runtime:
    """The artifact's compiled or eager model, ready to run on its device."""
    dev = torch.device(device or artifact.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"artifact was built for {artifact.device} but CUDA is not available")
    if artifact.backend == "eager":
        from safetensors.torch import load_file

        from engine.checkpoint import check_state_dict, create_model

        net = create_model(artifact.spec)
        sd = load_file(str(artifact.path("weights.safetensors")))
        check_state_dict(net, sd, artifact.path("weights.safetensors"))
        net.load_state_dict(sd)
        return Runtime(wrap(net, artifact.spec, str(dev)), artifact, dev)
    if artifact.backend == "aot":
        if dev.type != artifact.device:
            raise RuntimeError(f"AOT package was compiled for {artifact.device}, not {dev.type}")
        return Runtime(_load_aoti(artifact.path("model.pt2")), artifact, dev)
    raise RuntimeError(f"unknown backend {artifact.backend!r}; choose one of {BACKENDS}")


def _load_aoti(package) -> object:
    """Load an AOTInductor package with the C++ loader alone (importing torch._inductor costs ~1 s).

    The fast path calls the loader that `torch._inductor.aoti_load_package` wraps; if this
    torch lacks it, fall back to the public function and say why.
    """
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)
    except AttributeError as e:
        print(f"[engine] direct AOTI loader unavailable ({e}); using torch._inductor.aoti_load_package",
              file=sys.stderr)
        from torch._inductor import aoti_load_package

        return aoti_load_package(str(package))
    return lambda x: loader.boxed_run([x])  # flat inputs [uint8 batch] -> [int32 top-1]
