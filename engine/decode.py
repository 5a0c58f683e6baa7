"""Decoder selection: one name per backend, with an explicit fallback to the reference."""
from __future__ import annotations

import os
import sys

from engine.spec import Spec

DECODERS = ("pil", "dali-cpu", "dali-gpu")


def make_decoder(name: str, spec: Spec, batch_size: int, threads: int | None = None):
    """A decoder with `.decode(blobs) -> (uint8 [n, S, S, 3], {index: reason})` and `.name`.

    `ENGINE_DECODER` overrides `name` (the off switch for the fast paths). A DALI backend
    that cannot start falls back to `pil` and says why on stderr.
    """
    name = os.environ.get("ENGINE_DECODER", name)
    if name not in DECODERS:
        raise ValueError(f"unknown decoder {name!r}; choose one of {DECODERS}")
    if name == "pil":
        from engine.decode_pil import PilDecoder

        return PilDecoder(spec, batch_size, threads)
    try:
        from engine.decode_dali import DaliDecoder

        return DaliDecoder(spec, batch_size, threads, device=name.split("-", 1)[1])
    except Exception as e:  # noqa: BLE001 - missing package, no GPU, driver error: all fall back
        print(f"[engine] decoder {name} unavailable ({type(e).__name__}: {e}); using pil", file=sys.stderr)
        from engine.decode_pil import PilDecoder

        return PilDecoder(spec, batch_size, threads)
