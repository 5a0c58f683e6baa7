"""The run-time side of an artifact: its backend's function behind a static batch shape.

uint8 [B, S, S, 3] in, int32 top-1 [B] out. On CUDA the upload goes through a pinned
buffer and the static batch is replayed from a captured CUDA graph. Nothing here
compiles: a backend that would need to is an error, not a JIT.
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np
import torch

from engine import backends, settings
from engine.classify.artifact import Artifact
from engine.classify.guard import Guard
from engine.core.spec import Spec


class UploadRing:
    """Host -> device uploads through `n` pinned buffers, each rewritten only after the copy
    out of it has finished (an event recorded after each async copy): a batch is never
    classified on the pixels of the next one."""

    def __init__(self, shape, device, n: int = 2, make_buffer=None, make_event=None):
        self.device = device
        make_buffer = make_buffer or (lambda: torch.empty(shape, dtype=torch.uint8).pin_memory())
        self._event = make_event or torch.cuda.Event
        self.buffers = [make_buffer() for _ in range(n)]
        self.pending: list = [None] * n
        self.turn = 0

    def upload(self, x: torch.Tensor) -> torch.Tensor:
        i = self.turn
        self.turn = (i + 1) % len(self.buffers)
        if self.pending[i] is not None:
            self.pending[i].synchronize()  # the last copy out of this buffer is done
        self.buffers[i].copy_(x)
        dev = self.buffers[i].to(self.device, non_blocking=True)
        ev = self._event()
        ev.record()
        self.pending[i] = ev
        return dev


class Runtime:
    """Callable batch classifier. `run` takes exactly `batch_size` images (pad the last batch).

    A guarded artifact (manifest "guard") also loads its FP32 re-check graph; `guard=False`
    (or ENGINE_GUARD=0) runs the raw low-precision answers.
    """

    def __init__(self, fn, artifact: Artifact, device: torch.device, cuda_graphs: bool | None = None,
                 guard: Guard | None = None, capture: bool = True, fp32_math: dict | None = None):
        self._fn, self.artifact, self.device, self.guard = fn, artifact, device, guard
        self.batch_size = artifact.batch_size
        self.name = artifact.backend
        self.fp32_math = fp32_math
        self._shape = (self.batch_size, artifact.spec.input_size, artifact.spec.input_size, 3)
        self._ring = UploadRing(self._shape, device) if device.type == "cuda" else None
        self.gpu_busy_s = 0.0       # summed CUDA-event time of the graph calls (report mode)
        self._events: list = []
        if cuda_graphs is None:
            cuda_graphs = settings.cuda_graphs()
        self._want_graphs = artifact.meta.get("cuda_graphs", True) if cuda_graphs is None else cuda_graphs
        self.cuda_graph_status = "off"
        if capture:
            self.capture_graphs()

    def capture_graphs(self) -> str:
        """Capture the CUDA graphs (the static batch, and the guard's re-check batch); returns the
        status. `load_runtime(..., capture=False)` leaves this to the caller, who first finishes
        whatever else touches the device (a GPU decoder's pipeline allocates while it builds)."""
        if self.device.type == "cuda" and self._want_graphs and self.cuda_graph_status == "off":
            self._fn, self.cuda_graph_status = _capture(self._fn, self._shape, self.device)
            if self.guard is not None:
                rshape = (self.guard.batch,) + self._shape[1:]
                self.guard.recheck, _ = _capture(self.guard.recheck, rshape, self.device)
        return self.cuda_graph_status

    @property
    def cuda_graph(self) -> bool:
        return self.cuda_graph_status == "captured"

    @torch.inference_mode()
    def run_async(self, batch, valid: int | None = None) -> torch.Tensor:
        """batch: [B, S, S, 3] uint8 (numpy or torch, any device) -> int32 [B] on the run's device.

        On CUDA the host copy goes through a pinned buffer and the result stays on the GPU
        until the caller gathers it. A guarded artifact's answers are final only after
        `finish()` (the guard re-checks low-margin rows in full batches, reading each batch's
        margins one batch late on CUDA: no sync per batch). Rows at and past `valid` are padding.
        The artifact's full SHA-256 (engine.classify.artifact) is joined first: ArtifactError
        when its files differ from the manifest (a finished check costs a join, microseconds).
        """
        self.artifact.check_weights()
        x = torch.as_tensor(batch)
        if x.shape[0] != self.batch_size:
            raise ValueError(f"static batch shape is {self.batch_size}, got {x.shape[0]}: pad the batch")
        if self._ring is not None and x.device.type == "cpu":
            x = self._ring.upload(x)
        else:
            x = x.to(self.device, non_blocking=True)
        if self.device.type == "cuda":  # GPU busy time: events around the graph, read once at the end
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self._fn(x)
            end.record()
            self._events.append((start, end))
        else:
            out = self._fn(x)
        top1 = out[0] if isinstance(out, (list, tuple)) else out
        if self.guard is not None:
            return self.guard.apply(x, top1, out[1], valid)   # a copy, fixed in place by finish()
        if self.cuda_graph:
            top1 = top1.clone()  # a graph reuses its output buffer
        return top1

    def finish(self) -> None:
        """Complete every answer run_async returned (the guard's last re-checks)."""
        if self.guard is not None:
            self.guard.finish()

    def run(self, batch, valid: int | None = None) -> np.ndarray:
        """Like run_async then finish, gathered to the host: int32 [B]."""
        top1 = self.run_async(batch, valid)
        self.finish()
        return top1.cpu().numpy().astype(np.int32, copy=False)

    def report(self) -> dict:
        """What the timing report records of the runtime: graphs and the guard's work."""
        out = {"cuda_graph": self.cuda_graph_status}
        if self.fp32_math is not None:
            out["fp32_math"] = self.fp32_math
        if self._events:
            torch.cuda.synchronize(self.device)
            out["gpu_busy_s"] = round(sum(s.elapsed_time(e) for s, e in self._events) / 1000, 4)
            out["gpu_batches"] = len(self._events)
        if self.guard is not None:
            out["guard"] = self.guard.report()
        elif self.artifact.meta.get("guard"):
            out["guard"] = "off (ENGINE_GUARD=0): raw low-precision answers"
        return out


def _capture(fn, shape: tuple[int, ...], device: torch.device):
    """(replay, "captured") of `fn` from a CUDA graph on a static uint8 input; on failure say
    why and return (fn, "failed(<why>)")."""
    try:
        static_in = torch.zeros(shape, dtype=torch.uint8, device=device)  # [B, S, S, 3]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # warm-up outside the graph: lazy inits, autotuned kernels
                fn(static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call another thread makes meanwhile (a library's allocation) neither
        # breaks this capture nor fails there; the callers also capture only once the decoder is built
        with torch.cuda.graph(graph, capture_error_mode="thread_local"), torch.inference_mode():
            static_out = fn(static_in)
    except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager launches
        why = f"{type(e).__name__}: {e}".replace("\n", " ")[:200]
        print(f"[engine] CUDA graph capture failed ({why}); running without graphs", file=sys.stderr)
        return fn, f"failed({why})"

    def replay(x: torch.Tensor):
        static_in.copy_(x, non_blocking=True)
        graph.replay()
        return static_out  # int32 [B], or [top-1, margin]: the graph's own buffers

    return replay, "captured"


def recheck_view(artifact: Artifact) -> Artifact:
    """The guard's FP32 re-check graph as an artifact of its own (a folder inside the artifact)."""
    g = artifact.meta["guard"]
    spec = Spec.from_dict(g["recheck_spec"])
    return dataclasses.replace(artifact, root=artifact.root / g["dir"], spec=spec, precision=spec.precision,
                               batch_size=spec.batch_size, files={}, meta={},
                               backend=g.get("recheck_backend", artifact.backend))


def load_runtime(artifact: Artifact, device: str | None = None, cuda_graphs: bool | None = None,
                 guard: bool | None = None, capture: bool = True) -> Runtime:
    """The artifact's model, ready to run on its device (its backend from the registry).
    `capture=False`: the CUDA graphs are captured when the caller calls `capture_graphs()`.
    FP32 math is set here for the process (engine.classify.tf32_off: TF32 off unless ENGINE_TF32=1)."""
    from engine.classify.tf32_off import set_fp32_math

    dev = torch.device(device or artifact.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"artifact was built for {artifact.device} but CUDA is not available")
    math = set_fp32_math()
    built = artifact.meta.get("fp32_math")
    if built and built != math:
        print(f"[engine] FP32 math differs from the build's ({built}, now {math}): the guard's tau was "
              "chosen against the build's FP32 (ENGINE_TF32)", file=sys.stderr)
    try:
        backend = backends.get(artifact.backend)
    except ValueError as e:
        raise RuntimeError(str(e)) from None
    g = artifact.meta.get("guard")
    use_guard = bool(g) and (settings.guard() if guard is None else guard)
    if use_guard:
        recheck = backends.get(g.get("recheck_backend", artifact.backend)).load(recheck_view(artifact), dev)
        checker = Guard(recheck, g["tau"], g["recheck_batch"], dev)
    else:
        checker = None
    fn = backend.load(artifact, dev)
    if g and not use_guard:
        inner = fn
        fn = lambda x: inner(x)[0]  # noqa: E731 - raw answers: drop the margin output
    return Runtime(fn, artifact, dev, cuda_graphs, checker, capture=capture, fp32_math=math)
