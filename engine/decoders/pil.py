"""The reference decoder: PIL + timm's `create_transform` eval path, one image at a time."""
from __future__ import annotations

import io
import re
from functools import lru_cache

import numpy as np

from engine.core.spec import Spec


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


class TooLarge(ValueError):
    """An image whose decode or resize would exceed the pixel budget (ENGINE_MAX_PIXELS)."""


def checked_window(w: int, h: int, spec: Spec):
    """engine.core.geometry.window for a w x h image; TooLarge before any pixel is allocated when the
    image, or its resized copy before the crop, has more pixels than ENGINE_MAX_PIXELS (a 3000x1
    JPEG of 1 KB resizes to 1008000x336 under a short-side-336 center crop: 1 GB per plane)."""
    from engine import settings
    from engine.core.geometry import window

    cap = settings.max_pixels()
    if w * h > cap:
        raise TooLarge(f"{w}x{h} image has {w * h} pixels, above the budget of {cap} (ENGINE_MAX_PIXELS)")
    win = window(w, h, spec)
    if win.resize_w * win.resize_h > cap:
        raise TooLarge(f"{w}x{h} image resizes to {win.resize_w}x{win.resize_h} before the crop, "
                       f"{win.resize_w * win.resize_h} pixels, above the budget of {cap} (ENGINE_MAX_PIXELS)")
    return win


def decode_pil(blob: bytes, spec: Spec) -> np.ndarray:
    """[S, S, 3] uint8: the reference pixels before normalisation.

    The same operations timm's eval transform performs on a PIL image (torchvision's
    Resize -> PIL `resize`, then CenterCrop), with sizes from engine.core.geometry, so the
    fast paths' fallback does not import timm; tests check it byte for byte against
    `timm_pixels`. The header's size is checked against the pixel budget before the
    pixels are decoded (checked_window).
    """
    from PIL import Image

    im = Image.open(io.BytesIO(blob))          # header only: no pixel is decoded yet
    win = checked_window(im.size[0], im.size[1], spec)
    im = im.convert("RGB")
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


def _decode_one(blob: bytes | None, spec: Spec) -> tuple[np.ndarray | None, str | None]:
    if blob is None:
        return None, "not read"
    try:
        return decode_pil(blob, spec), None
    except Exception as e:  # noqa: BLE001 - any decoder error makes the image unreadable
        return None, failure(e)


class ReferencePool:
    """decode_pil over many images on `threads` threads (PIL releases the GIL while it decodes
    and resizes); one thread decodes in the caller's thread. The pool's threads start on first
    use and live as long as the object."""

    def __init__(self, spec: Spec, threads: int = 1):
        self.spec, self.threads = spec, max(1, threads)
        self._pool = None

    def each(self, blobs: list[bytes | None], progress=None):
        """Yields (position in `blobs`, uint8 [S, S, 3] or None, reason or None), in order.
        `progress(position)` is called as each image is taken up (the isolated child reports it)."""
        if self.threads == 1 or len(blobs) < 2:
            for k, blob in enumerate(blobs):
                if progress is not None:
                    progress(k)
                yield (k, *_decode_one(blob, self.spec))
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="pil")
        futures = [self._pool.submit(_decode_one, b, self.spec) for b in blobs]
        for k, f in enumerate(futures):
            if progress is not None:
                progress(k)                    # the oldest image not finished yet
            yield (k, *f.result())


class PilDecoder:
    """Batch interface over the reference decoder (the slow, exact backend), on a thread pool
    sized by the thread budget."""

    name = "pil"

    def __init__(self, spec: Spec, batch_size: int, threads: int | None = None):
        if threads is None:
            from engine.threads import budget

            threads = budget().decoder
        self.spec = spec
        self.pool = ReferencePool(spec, threads)

    def decode(self, blobs: list[bytes | None], progress=None) -> tuple[np.ndarray, dict[int, str]]:
        s = self.spec.input_size
        out = np.zeros((len(blobs), s, s, 3), np.uint8)
        failed: dict[int, str] = {}
        for i, px, why in self.pool.each(blobs, progress):
            if why is None:
                out[i] = px
            else:
                failed[i] = why
        return out, failed


def create(name: str, spec: Spec, batch_size: int, threads: int | None = None) -> PilDecoder:
    return PilDecoder(spec, batch_size, threads)
