"""Decoders, one file each, behind one table, with an explicit fallback chain ending at the reference.

Each decoder module has `create(name, spec, batch_size, threads)` returning an object with
`.decode(blobs) -> (uint8 [n, S, S, 3], {index: reason})` and `.name`; a module may list
in `ISOLABLE` the names whose output is host memory, which then run in a child process
(engine.decoders.isolate) unless make_decoder is told otherwise (ENGINE_DECODER_ISOLATE=0 in the ABIs).
"""
from __future__ import annotations

import importlib
import sys
import threading

from engine.core.spec import Spec
from engine.decoders.registry import DECODERS, FALLBACK, NEEDS

__all__ = ["DECODERS", "FALLBACK", "NEEDS", "artifact_decoder", "default_decoder", "make_decoder", "planned_decoder",
           "runs_isolated", "slow_decoder_reason", "start_decoder", "start_problem"]


def default_decoder(device: str) -> str:
    """The fast decoder for an artifact built for `device` (cpu | cuda)."""
    return "dali-gpu" if device == "cuda" else "dali-cpu"


def artifact_decoder(meta: dict) -> str:
    """The decoder an artifact's manifest names (the build measured it against PIL:
    engine.tuning.decoder_choice), else the fast one of its device."""
    name = meta.get("decoder")
    return name if name in DECODERS else default_decoder(meta.get("device", "cpu"))


def runs_isolated(name: str, isolate: bool = True) -> bool:
    """Whether make_decoder(name, isolate=...) runs the decoder in a child process (it can then
    start before the model loads: it imports nothing heavy in this process)."""
    return isolate and name in DECODERS and name in getattr(importlib.import_module(DECODERS[name]), "ISOLABLE", ())


def start_problem(name: str) -> str | None:
    """Why decoder `name` could not start on this machine (None: it can), found without building it:
    its package is missing, or it needs a CUDA device and torch sees none."""
    modules, cuda = NEEDS[name]
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001 - ImportError, or a native library that fails to load
            return f"cannot import {m} ({type(e).__name__}: {e})"
    if cuda:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device"
    return None


def planned_decoder(name: str) -> tuple[str, list[str]]:
    """(the decoder make_decoder(name) would end with here, ["NAME: why it is skipped", ...] for the
    links of FALLBACK before it). A driver error at build time can still push it further along."""
    skipped = []
    while (why := start_problem(name)) is not None and name in FALLBACK:
        skipped.append(f"{name}: {why}")
        name = FALLBACK[name]
    return name, skipped


def slow_decoder_reason(device: str, name: str | None = None, recorded: str | None = None) -> str | None:
    """For an artifact built for `device`, decoding with `name` (default: `recorded`, the one its
    build chose, else the device's): why the run would fall back to something slower than the GPU
    decoder, or None. Every chroma-subsampled JPEG then goes through PIL on the CPU (~5 ms an
    image; tens of seconds over a few thousand images). The recorded decoder starting as recorded
    is no fallback: the build measured the faster ones break the disagreement budget."""
    if device != "cuda":
        return None
    want = name or recorded or default_decoder(device)
    got, skipped = planned_decoder(want)
    if got == "dali-gpu" or got == want == recorded:
        return None
    why = f" ({'; '.join(skipped)})" if skipped else ""
    return f"this CUDA artifact would decode with {got}, not dali-gpu{why}"


class PendingDecoder:
    """make_decoder(...) running on a thread (a DALI GPU pipeline builds while the model loads);
    `result()` waits for it and raises what make_decoder raised."""

    def __init__(self, *args, **kwargs):
        self._out: dict = {}
        self._thread = threading.Thread(target=self._build, args=args, kwargs=kwargs, name="decoder-build",
                                        daemon=True)
        self._thread.start()

    def _build(self, *args, **kwargs) -> None:
        try:
            self._out["decoder"] = make_decoder(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller of result()
            self._out["error"] = e

    def result(self):
        self._thread.join()
        if "error" in self._out:
            raise self._out["error"]
        return self._out["decoder"]


def start_decoder(name: str, spec: Spec, batch_size: int, threads: int | None = None,
                  isolate: bool = True) -> PendingDecoder:
    """make_decoder in the background: call `.result()` when the first batch needs it."""
    return PendingDecoder(name, spec, batch_size, threads, isolate)


def make_decoder(name: str, spec: Spec, batch_size: int, threads: int | None = None,
                 isolate: bool = True):
    """The decoder `name`; one that cannot start (package missing, no GPU) falls back along
    FALLBACK and says why on stderr. isolate: run an ISOLABLE decoder in a child process
    (the ABIs pass ENGINE_DECODER_ISOLATE)."""
    if name not in DECODERS:
        raise ValueError(f"unknown decoder {name!r}; choose one of {', '.join(DECODERS)}")
    while True:
        try:
            mod = importlib.import_module(DECODERS[name])
            if isolate and name in getattr(mod, "ISOLABLE", ()):
                from engine.decoders.isolate import IsolatedDecoder

                try:
                    return IsolatedDecoder(name, DECODERS[name], spec, batch_size, threads)
                except (OSError, AttributeError) as e:  # no memfd, no fork: the same decoder in this process
                    print(f"[engine] decoder {name}: no child process ({type(e).__name__}: {e}); "
                          "running it in this process", file=sys.stderr)
            return mod.create(name, spec, batch_size, threads)
        except Exception as e:  # noqa: BLE001 - missing package, no GPU, driver error: all fall back
            nxt = FALLBACK.get(name)
            if nxt is None:
                raise
            print(f"[engine] decoder {name} unavailable ({type(e).__name__}: {e}); using {nxt}", file=sys.stderr)
            name = nxt
