"""Decoders, one file each, behind one table, with an explicit fallback chain ending at the reference.

Each decoder module has `create(name, spec, batch_size, threads)` returning an object with
`.decode(blobs) -> (uint8 [n, S, S, 3], {index: reason})` and `.name`.
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


def make_decoder(name: str, spec: Spec, batch_size: int, threads: int | None = None):
    """The decoder `name`; one that cannot start (package missing, no GPU) falls back along
    FALLBACK and says why on stderr."""
    if name not in DECODERS:
        raise ValueError(f"unknown decoder {name!r}; choose one of {', '.join(DECODERS)}")
    while True:
        try:
            return importlib.import_module(DECODERS[name]).create(name, spec, batch_size, threads)
        except Exception as e:  # noqa: BLE001 - missing package, no GPU, driver error: all fall back
            nxt = FALLBACK.get(name)
            if nxt is None:
                raise
            print(f"[engine] decoder {name} unavailable ({type(e).__name__}: {e}); using {nxt}", file=sys.stderr)
            name = nxt
