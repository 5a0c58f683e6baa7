"""Decoder selection: one name per backend, with an explicit fallback chain ending at the reference."""
from __future__ import annotations

import os
import sys

from engine.spec import Spec

DECODERS = ("pil", "dali-cpu", "dali-gpu", "nvjpeg")
# what to try when a backend cannot start: GPU decoders first, the PIL reference last
FALLBACK = {"dali-gpu": "nvjpeg", "nvjpeg": "pil", "dali-cpu": "pil"}


def _create(name: str, spec: Spec, batch_size: int, threads: int | None):
    if name == "pil":
        from engine.decode_pil import PilDecoder

        return PilDecoder(spec, batch_size, threads)
    if name == "nvjpeg":
        from engine.decode_nvjpeg import NvjpegDecoder

        return NvjpegDecoder(spec, batch_size, threads)
    from engine.decode_dali import DaliDecoder

    return DaliDecoder(spec, batch_size, threads, device=name.split("-", 1)[1])


def make_decoder(name: str, spec: Spec, batch_size: int, threads: int | None = None):
    """A decoder with `.decode(blobs) -> (uint8 [n, S, S, 3], {index: reason})` and `.name`.

    `ENGINE_DECODER` overrides `name` (the off switch for the fast paths). A backend that
    cannot start (package missing, no GPU) falls back along FALLBACK and says why on stderr.
    """
    name = os.environ.get("ENGINE_DECODER", name)
    if name not in DECODERS:
        raise ValueError(f"unknown decoder {name!r}; choose one of {DECODERS}")
    while True:
        try:
            return _create(name, spec, batch_size, threads)
        except Exception as e:  # noqa: BLE001 - missing package, no GPU, driver error: all fall back
            nxt = FALLBACK.get(name)
            if nxt is None:
                raise
            print(f"[engine] decoder {name} unavailable ({type(e).__name__}: {e}); using {nxt}", file=sys.stderr)
            name = nxt
