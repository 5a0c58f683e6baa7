"""The run-time side of an artifact: its backend's function behind a static batch shape.

uint8 [B, S, S, 3] in, int32 top-1 [B] out. On CUDA the upload goes through a pinned
buffer and the static batch is replayed from a captured CUDA graph. Nothing here
compiles: a backend that would need to is an error, not a JIT.
"""
from __future__ import annotations

import sys

import numpy as np
import torch

from engine import backends, settings
from engine.artifact import Artifact


class Runtime:
    """Callable batch classifier. `run` takes exactly `batch_size` images (pad the last batch)."""

    def __init__(self, fn, artifact: Artifact, device: torch.device, cuda_graphs: bool | None = None):
        self._fn, self.artifact, self.device = fn, artifact, device
        self.batch_size = artifact.batch_size
        self.name = artifact.backend
        self.cuda_graph = False
        shape = (self.batch_size, artifact.spec.input_size, artifact.spec.input_size, 3)
        self._pinned = torch.empty(shape, dtype=torch.uint8).pin_memory() if device.type == "cuda" else None
        if cuda_graphs is None:
            cuda_graphs = settings.cuda_graphs()
        if device.type == "cuda" and cuda_graphs:
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


def load_runtime(artifact: Artifact, device: str | None = None, cuda_graphs: bool | None = None) -> Runtime:
    """The artifact's model, ready to run on its device (its backend from the registry)."""
    dev = torch.device(device or artifact.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"artifact was built for {artifact.device} but CUDA is not available")
    try:
        backend = backends.get(artifact.backend)
    except ValueError as e:
        raise RuntimeError(str(e)) from None
    return Runtime(backend.load(artifact, dev), artifact, dev, cuda_graphs)
