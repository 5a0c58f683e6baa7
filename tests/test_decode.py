"""dali-cpu against the PIL reference: bit-exact decode, torchvision-exact geometry, close resampling."""
from __future__ import annotations

import io

import numpy as np
import pytest
from conftest import tiny_spec
from PIL import Image

from engine.decoders.dali import DaliDecoder
from engine.decoders.pil import PilDecoder, decode_pil, open_rgb
from evaluator.synthetic.cohort import encode, render, templates


def _jpeg(w, h, seed=0, **opts) -> bytes:
    rng = np.random.default_rng(seed)
    px = render(templates(3, seed)[seed % 3], w, h, rng)
    im = Image.fromarray(px)
    mode = opts.pop("mode", "RGB")
    if mode != "RGB":
        im = im.convert(mode)
    buf = io.BytesIO()
    im.save(buf, "JPEG", **opts)
    return buf.getvalue()


CASES = {
    "baseline-420": lambda: _jpeg(500, 375, quality=85, subsampling=2),
    "444": lambda: _jpeg(333, 517, quality=95, subsampling=0),
    "422": lambda: _jpeg(640, 480, quality=75, subsampling=1),
    "progressive": lambda: _jpeg(640, 427, quality=90, progressive=True),
    "grayscale": lambda: _jpeg(301, 299, mode="L"),
    "cmyk": lambda: _jpeg(400, 300, mode="CMYK"),
    "odd-small": lambda: _jpeg(151, 799, quality=60),
    "wide": lambda: _jpeg(800, 150, quality=92),
    "exact-size": lambda: _jpeg(112, 112),
}


def _decode_only_dali(blobs):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=len(blobs), num_threads=1, device_id=None)
    def pipe():
        enc = fn.external_source(name="enc", dtype=types.UINT8)
        return fn.decoders.image(enc, device="cpu", output_type=types.RGB, adjust_orientation=False)

    p = pipe()
    p.build()
    p.feed_input("enc", [np.frombuffer(b, np.uint8) for b in blobs])
    (out,) = p.run()
    return [np.asarray(out[i]) for i in range(len(blobs))]


def test_dali_decode_is_bit_exact_with_pil():
    names = list(CASES)
    blobs = [CASES[n]() for n in names]
    for name, blob, got in zip(names, blobs, _decode_only_dali(blobs)):
        want = np.asarray(open_rgb(blob))
        assert got.shape == want.shape, name
        assert np.array_equal(got, want), f"{name}: max diff {np.abs(got.astype(int) - want).max()}"


@pytest.mark.parametrize("crop_mode", ["squash", "center"])
def test_dali_cpu_preprocess_matches_reference(crop_mode):
    spec = tiny_spec(crop_mode)
    names = list(CASES)
    blobs = [CASES[n]() for n in names]
    got, failed = DaliDecoder(spec, len(blobs), threads=1).decode(blobs)
    assert failed == {}
    for i, name in enumerate(names):
        want = decode_pil(blobs[i], spec)
        d = np.abs(got[i].astype(int) - want.astype(int))
        # same geometry: only the cubic kernel's rounding differs (PIL rounds to uint8 between passes)
        assert d.max() <= 4, (name, d.max())
        assert d.mean() < 0.5, (name, d.mean())


def test_exif_orientation_is_not_applied_like_the_reference():
    im = Image.fromarray(render(templates(1, 5)[0], 320, 200, np.random.default_rng(5)))
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW": PIL's open().convert() ignores it, so must we
    buf = io.BytesIO()
    im.save(buf, "JPEG", exif=exif.tobytes())
    blob = buf.getvalue()
    (got,) = _decode_only_dali([blob])
    assert got.shape == (200, 320, 3)
    assert np.array_equal(got, np.asarray(open_rgb(blob)))


def test_non_jpeg_and_unreadable_images_fall_back_or_fail_alone():
    spec = tiny_spec()
    png = io.BytesIO()
    Image.fromarray(render(templates(1, 2)[0], 200, 150, np.random.default_rng(2))).save(png, "PNG")
    good = CASES["baseline-420"]()
    trunc = good[: len(good) // 3]
    blobs = [good, png.getvalue(), b"", b"not an image at all", trunc, None, good]
    got, failed = DaliDecoder(spec, 8, threads=1).decode(blobs)
    assert sorted(failed) == [2, 3, 4, 5]
    assert np.array_equal(got[1], decode_pil(png.getvalue(), spec))  # PNG in disguise: exact, via PIL
    assert np.abs(got[0].astype(int) - decode_pil(good, spec)).max() <= 4
    assert np.array_equal(got[0], got[6])
    assert not got[2].any() and not got[5].any()  # failed slots stay zero
    ref, ref_failed = PilDecoder(spec, 8).decode(blobs)
    assert sorted(ref_failed) == sorted(failed)


def test_cohort_encodings_all_decode_through_dali(small_cohort):
    import json

    spec = tiny_spec("center")
    items = json.loads((small_cohort / "cohort.json").read_text())["items"]
    blobs = [(small_cohort / it["path"]).read_bytes() for it in items]
    got, failed = DaliDecoder(spec, len(blobs), threads=2).decode(blobs)
    broken = {i for i, it in enumerate(items) if it["encoding"].startswith("broken")}
    assert set(failed) == broken
    for i, blob in enumerate(blobs):
        if i in broken:
            continue
        d = np.abs(got[i].astype(int) - decode_pil(blob, spec).astype(int))
        assert d.max() <= 4 and d.mean() < 0.5, items[i]["encoding"]


def test_encode_helper_covers_the_kinds():
    rng = np.random.default_rng(0)
    px = render(templates(1, 0)[0], 160, 160, rng)
    for kind, mode in [("gray", "L"), ("cmyk", "CMYK"), ("rgb", "RGB")]:
        blob, _ = encode(px, rng, kind)
        assert Image.open(io.BytesIO(blob)).mode == mode


@pytest.mark.parametrize("crop_mode", ["squash", "center"])
def test_pil_decoder_is_byte_identical_to_timm_transform(small_cohort, crop_mode):
    import json

    from engine.decoders.pil import timm_pixels

    spec = tiny_spec(crop_mode)
    for it in json.loads((small_cohort / "cohort.json").read_text())["items"]:
        if it["encoding"].startswith("broken"):
            continue
        blob = (small_cohort / it["path"]).read_bytes()
        assert np.array_equal(decode_pil(blob, spec), timm_pixels(blob, spec)), it["encoding"]
    exact = CASES["exact-size"]()  # 112 x 112: torchvision skips the resize entirely
    assert np.array_equal(decode_pil(exact, spec), timm_pixels(exact, spec))
