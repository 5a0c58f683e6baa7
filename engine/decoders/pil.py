"""The reference decoder: PIL + timm's `create_transform` eval path, one image at a time."""
from __future__ import annotations

import io
import re
from functools import lru_cache

import numpy as np

from engine.spec import Spec


@lru_cache(maxsize=8)
def _timm_transform(spec_json: str, normalize: bool):
    import timm.data

    spec = Spec.from_dict(__import__("json").loads(spec_json))
    return timm.data.create_transform(
        input_size=(3, spec.input_size, spec.input_size),
        is_training=False,
        interpolation=spec.interpolation,
        mean=spec.mean,
        std=spec.std,
        crop_pct=spec.crop_pct,
        crop_mode=spec.crop_mode,
        use_prefetcher=not normalize,  # prefetcher form stops at a uint8 CHW tensor
    )


def open_rgb(blob: bytes):
    """PIL image as the reference reads it: `Image.open(...).convert('RGB')`, no EXIF rotation."""
    from PIL import Image

    im = Image.open(io.BytesIO(blob))
    return im.convert("RGB")


_PIL_FILTERS = {"bicubic": 3, "bilinear": 2, "nearest": 0}  # PIL.Image.Resampling values


def decode_pil(blob: bytes, spec: Spec) -> np.ndarray:
    """[S, S, 3] uint8: the reference pixels before normalisation.

    The same operations timm's eval transform performs on a PIL image (torchvision's
    Resize -> PIL `resize`, then CenterCrop), with sizes from engine.geometry, so the
    fast paths' fallback does not import timm; tests check it byte for byte against
    `timm_pixels`.
    """
    from engine.geometry import window

    im = open_rgb(blob)
    win = window(im.size[0], im.size[1], spec)
    if win.resized:  # torchvision returns the image untouched when the size already matches
        im = im.resize((win.resize_w, win.resize_h), _PIL_FILTERS[spec.interpolation])
    im = im.crop((win.left, win.top, win.left + win.size, win.top + win.size))
    return np.asarray(im, dtype=np.uint8).copy()


def timm_pixels(blob: bytes, spec: Spec) -> np.ndarray:
    """[S, S, 3] uint8 straight from timm's `create_transform` (prefetcher form): the ground truth."""
    chw = _timm_transform(spec.to_json(), False)(open_rgb(blob))  # [3, S, S] uint8
    return np.ascontiguousarray(chw.numpy().transpose(1, 2, 0))


def reference_tensor(blob: bytes, spec: Spec):
    """[3, S, S] float32, normalised: exactly what timm's eval transform feeds the model."""
    return _timm_transform(spec.to_json(), True)(open_rgb(blob))


_OBJECT_AT = re.compile(r" ?<[\w.]+ object at 0x[0-9a-f]+>")


def failure(e: BaseException) -> str:
    """Why an image could not be read, in one stable line (PIL names its in-memory buffer's address)."""
    return f"{type(e).__name__}: {_OBJECT_AT.sub('', str(e))}".strip()


class PilDecoder:
    """Batch interface over the reference decoder (the slow, exact backend)."""

    name = "pil"

    def __init__(self, spec: Spec, batch_size: int, threads: int | None = None):
        self.spec = spec

    def decode(self, blobs: list[bytes | None]) -> tuple[np.ndarray, dict[int, str]]:
        s = self.spec.input_size
        out = np.zeros((len(blobs), s, s, 3), np.uint8)
        failed: dict[int, str] = {}
        for i, blob in enumerate(blobs):
            if blob is None:
                failed[i] = "not read"
                continue
            try:
                out[i] = decode_pil(blob, self.spec)
            except Exception as e:  # noqa: BLE001 - any decoder error makes the image unreadable
                failed[i] = failure(e)
        return out, failed


def create(name: str, spec: Spec, batch_size: int, threads: int | None = None) -> PilDecoder:
    return PilDecoder(spec, batch_size, threads)
