"""4-component JPEGs (CMYK, YCCK) decode as PIL reads them, whatever markers they carry.

PIL reads every 4-component JPEG as Adobe-inverted CMYK (JpegImagePlugin's rawmode
"CMYK;I"); libjpeg turns YCCK into CMYK only under an Adobe APP14 marker with transform 2.
DALI inverts only when it sees the Adobe marker, so without one its colours are wrong:
such files go to the reference decoder on every path. A "YCCK file without a marker" is,
byte for byte, a CMYK file without one (the transform flag lives in the marker), so the
variants below cover it.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
from conftest import tiny_spec
from PIL import Image

from engine.decoders.pil import decode_pil
from engine.decoders.route import route
from evaluator.synthetic.cohort import render, templates


def _segments(blob: bytes):
    """(marker, offset of FFxx, length field) of the segments before the first scan."""
    out, pos = [], 2
    while blob[pos] == 0xFF and blob[pos + 1] != 0xDA:
        length = int.from_bytes(blob[pos + 2:pos + 4], "big")
        out.append((blob[pos + 1], pos, length))
        pos += 2 + length
    return out


def _adobe(blob: bytes) -> tuple[int, int]:
    """(offset, length field) of the Adobe APP14 segment."""
    return next((off, n) for m, off, n in _segments(blob) if m == 0xEE and blob[off + 4:off + 9] == b"Adobe")


def _without_adobe(blob: bytes) -> bytes:
    off, n = _adobe(blob)
    return blob[:off] + blob[off + 2 + n:]


def _with_transform(blob: bytes, transform: int) -> bytes:
    """The Adobe marker's colour transform flag (its last byte) set: 0 CMYK, 1 YCC, 2 YCCK."""
    off, n = _adobe(blob)
    data = bytearray(blob)
    data[off + 2 + n - 1] = transform
    return bytes(data)


def _cmyk(w: int = 203, h: int = 157, seed: int = 4) -> bytes:
    rng = np.random.default_rng(seed)
    px = render(templates(3, seed)[seed % 3], w, h, rng)
    buf = io.BytesIO()
    Image.fromarray(px).convert("CMYK").save(buf, "JPEG", quality=90)
    blob = buf.getvalue()
    assert _adobe(blob)[0] > 0 and blob[_adobe(blob)[0] + 2 + _adobe(blob)[1] - 1] == 0  # libjpeg wrote transform 0
    return blob


def _variants() -> dict[str, bytes]:
    cmyk = _cmyk()
    return {"cmyk-adobe": cmyk,
            "cmyk-no-marker": _without_adobe(cmyk),
            "ycck-adobe": _with_transform(cmyk, 2),
            "four-channel-transform-1": _with_transform(cmyk, 1)}   # libjpeg warns and reads YCCK


VARIANTS = _variants()


def _raw_dali(blob: bytes) -> np.ndarray:
    """DALI's own decode, no routing: [H, W, 3] uint8."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def pipe():
        enc = fn.external_source(name="enc", dtype=types.UINT8)
        return fn.decoders.image(enc, device="cpu", output_type=types.RGB, adjust_orientation=False)

    p = pipe()
    p.build()
    p.feed_input("enc", [np.frombuffer(blob, np.uint8)])
    (out,) = p.run()
    return np.asarray(out[0])


def test_dali_alone_gets_a_cmyk_jpeg_without_the_adobe_marker_wrong():
    """Why the router keeps 4-component JPEGs from DALI: without the marker its colours are
    inverted against PIL's (with the marker it agrees)."""
    from engine.decoders.pil import open_rgb

    blob = VARIANTS["cmyk-no-marker"]
    err = np.abs(_raw_dali(blob).astype(int) - np.asarray(open_rgb(blob), dtype=int)).mean()
    assert err > 20, err
    marked = VARIANTS["cmyk-adobe"]
    assert np.array_equal(_raw_dali(marked), np.asarray(open_rgb(marked)))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_router_sends_every_four_component_jpeg_to_the_reference(name):
    fast, slow, failed = route([VARIANTS[name]], tiny_spec())
    assert fast == [] and slow == [0] and failed == {}


@pytest.mark.parametrize("decoder,isolate", [("pil", False), ("dali-cpu", False), ("dali-cpu", True)])
@pytest.mark.parametrize("crop_mode", ["squash", "center"])
def test_every_cpu_decoder_gives_the_reference_pixels(decoder, isolate, crop_mode):
    from engine.decoders import make_decoder

    spec = tiny_spec(crop_mode)
    names = list(VARIANTS)
    blobs = [VARIANTS[n] for n in names]
    dec = make_decoder(decoder, spec, len(blobs), 1, isolate=isolate)
    try:
        assert bool(getattr(dec, "isolated", False)) == isolate
        got, failed = dec.decode(blobs)
    finally:
        if hasattr(dec, "close"):
            dec.close()
    assert failed == {}
    for i, name in enumerate(names):
        assert np.array_equal(got[i], decode_pil(blobs[i], spec)), name


def test_the_retrieval_embedding_path_sees_the_reference_pixels():
    """End to end through engine.retrieval.embed with the decoder the index build makes
    (the artifact device's default, isolated as the setting says)."""
    import torch

    from engine.decoders import default_decoder, make_decoder
    from engine.retrieval.embed import embed_images

    spec = tiny_spec("center")
    blobs = list(VARIANTS.values())
    dec = make_decoder(default_decoder("cpu"), spec, 2, 1, isolate=True)
    try:
        rows = []
        for b in embed_images(lambda i: blobs[i], range(len(blobs)), dec,
                              lambda arr: torch.as_tensor(np.asarray(arr)).reshape(len(arr), -1).float(), 2,
                              readers=2):
            assert b.ok.all()
            rows.append(b.emb.astype(np.float32))
    finally:
        dec.close()
    got = np.concatenate(rows)                                     # [n, S*S*3] pixel values
    want = np.stack([decode_pil(b, spec).reshape(-1) for b in blobs]).astype(np.float32)
    assert np.array_equal(got, want)
