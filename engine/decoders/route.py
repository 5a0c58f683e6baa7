"""JPEG routing: which images a fast decoder may take, which go to the PIL reference.

A fast decoder (DALI, nvJPEG) fails whole batches on one bad image, so each batch is
split by the header alone before it sees them.
"""
from __future__ import annotations

import io

from engine.geometry import window
from engine.spec import Spec

_JPEG_MODES = ("RGB", "L", "CMYK")  # modes whose DALI decode was checked bit-exact against PIL


def probe(blob: bytes) -> tuple[int, int, str, str]:
    """(width, height, format, mode) from the header only; raises if PIL cannot parse it."""
    from PIL import Image

    with Image.open(io.BytesIO(blob)) as im:
        return im.size[0], im.size[1], im.format or "", im.mode


def route(blobs: list[bytes | None], spec: Spec, modes: tuple[str, ...] = _JPEG_MODES):
    """Split a batch: (fast [(index, Window)], slow [index], failed {index: reason}).

    Fast: complete JPEGs in `modes`, for a GPU/DALI decoder. Slow: other formats and
    JPEGs without an end marker (truncated: one bad image would fail a whole batch), for
    the PIL reference, which reads them as the reference does. Failed: nothing reads them.
    """
    fast, slow, failed = [], [], {}
    for i, blob in enumerate(blobs):
        if blob is None:
            failed[i] = "not read"
            continue
        try:
            w, h, fmt, mode = probe(blob)
            win = window(w, h, spec)
        except Exception as e:  # noqa: BLE001 - unparseable header: nothing reads it
            failed[i] = f"{type(e).__name__}: {e}"
            continue
        if fmt != "JPEG" or mode not in modes or not blob.rstrip(b"\0").endswith(b"\xff\xd9"):
            slow.append(i)
        else:
            fast.append((i, win))
    return fast, slow, failed
