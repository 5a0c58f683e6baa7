"""Decoders, one file each, behind one table, with an explicit fallback chain ending at the reference.

Each decoder module has `create(name, spec, batch_size, threads)` returning an object with
`.decode(blobs) -> (uint8 [n, S, S, 3], {index: reason})` and `.name`; a module may list
in `ISOLABLE` the names whose output is host memory, which then run in a child process
(engine.decoders.isolate) unless make_decoder is told otherwise (ENGINE_DECODER_ISOLATE=0 in the ABIs).
"""
from __future__ import annotations

import importlib
import sys

from engine.spec import Spec

# name -> module
DECODERS: dict[str, str] = {
    "pil": "engine.decoders.pil",
    "dali-cpu": "engine.decoders.dali",
    "dali-gpu": "engine.decoders.dali",
    "nvjpeg": "engine.decoders.nvjpeg",
}
# what to try when a decoder cannot start: GPU decoders first, the PIL reference last
FALLBACK = {"dali-gpu": "nvjpeg", "nvjpeg": "pil", "dali-cpu": "pil"}


def default_decoder(device: str) -> str:
    """The fast decoder for an artifact built for `device` (cpu | cuda)."""
    return "dali-gpu" if device == "cuda" else "dali-cpu"


def runs_isolated(name: str, isolate: bool = True) -> bool:
    """Whether make_decoder(name, isolate=...) runs the decoder in a child process (it can then
    start before the model loads: it imports nothing heavy in this process)."""
    return isolate and name in DECODERS and name in getattr(importlib.import_module(DECODERS[name]), "ISOLABLE", ())


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
