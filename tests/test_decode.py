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


# ------------------------------------------------------------ routing on the marker structure
import functools  # noqa: E402

from engine.decoders.route import NotFast, jpeg_header, route  # noqa: E402


def _segments(blob):
    from hostile import segments

    return segments(blob)


def _replace_segment(blob: bytes, marker: int, body: bytes) -> bytes:
    """`blob` with the first segment FF`marker` given a new body (its length field recomputed)."""
    off, length = next((o, n) for m, o, n in _segments(blob) if m == marker)
    return blob[:off + 2] + (len(body) + 2).to_bytes(2, "big") + body + blob[off + 2 + length:]


def _body(blob: bytes, marker: int) -> bytearray:
    off, length = next((o, n) for m, o, n in _segments(blob) if m == marker)
    return bytearray(blob[off + 4:off + 2 + length])


@pytest.mark.parametrize("name", list(CASES))
def test_every_supported_encoding_is_routed_fast_with_the_reference_geometry(name):
    blob = CASES[name]()
    head = jpeg_header(blob)
    im = Image.open(io.BytesIO(blob))
    assert (head.width, head.height, head.mode) == (im.size[0], im.size[1], im.mode)
    assert head.frame == ("progressive" if name == "progressive" else "baseline") and head.scans >= 1


def _progressive_ac_first(prog: bytes) -> bytes:
    """A progressive JPEG whose first scan is turned into an AC scan (Ss 1, Se 5) of one component."""
    sos = prog.index(b"\xff\xda")
    n = prog[sos + 4]
    hdr = bytearray(prog[sos:sos + 2 + int.from_bytes(prog[sos + 2:sos + 4], "big")])
    comp = hdr[5:7]
    body = bytes([1]) + bytes(comp) + bytes([1, 5, 0])
    new = b"\xff\xda" + (len(body) + 2).to_bytes(2, "big") + body
    assert n >= 1
    return prog[:sos] + new + prog[sos + len(hdr):]


@functools.cache
def _hostile_variants():
    from hostile import header_only

    good = CASES["baseline-420"]()
    prog = CASES["progressive"]()
    sof = _body(good, 0xC0)
    dht = _body(good, 0xC4)
    sos = good.index(b"\xff\xda")
    scan_data = sos + 2 + int.from_bytes(good[sos + 2:sos + 4], "big")   # first byte after the scan header
    frame = good[good.index(b"\xff\xc0"):good.index(b"\xff\xc0") + 4 + len(sof)]
    out = {"header-only": (header_only(good), "no scan"),
           "no-eoi": (good[:-2], "no end-of-image"),
           "empty-scan": (good[:scan_data] + b"\xff\xd9", "no entropy-coded data"),
           "length-past-end": (good[:20] + b"\xff\xe1\xff\xff" + good[20:], "runs past the end"),
           "12-bit": (_replace_segment(good, 0xC0, bytes([12]) + sof[1:]), "12-bit"),
           "zero-height": (_replace_segment(good, 0xC0, sof[:1] + b"\x00\x00" + sof[3:]), "zero side"),
           "arithmetic": (good.replace(b"\xff\xc0", b"\xff\xc9", 1), "arithmetic"),
           "second-frame": (good.replace(b"\xff\xda", frame + b"\xff\xda", 1), "second frame"),
           "bogus-huffman": (_replace_segment(good, 0xC4, dht[:1] + bytes([3] + [0] * 15) + dht[17:]), "Huffman"),
           "unknown-marker": (good.replace(b"\xff\xda", b"\xff\xf7\x00\x02\xff\xda", 1), "FFF7"),
           "ac-before-dc": (_progressive_ac_first(prog), "AC scan before")}
    # a DC symbol above 15 in the first (DC) table
    d = bytearray(dht)
    d[17] = 16
    out["dc-symbol"] = (_replace_segment(good, 0xC4, bytes(d)), "above 15")
    # the scan names a component the frame does not have
    sos_off = good.index(b"\xff\xda")
    bad = bytearray(good)
    bad[sos_off + 5] = 99
    out["scan-component"] = (bytes(bad), "not the frame's")
    # a 3x1-sampled luma with 2x1 chroma cannot be upsampled by an integer factor
    f = bytearray(sof)
    f[7] = 0x31
    f[10] = 0x21
    out["fractional-sampling"] = (_replace_segment(good, 0xC0, bytes(f)), "fractional")
    return out


@pytest.mark.parametrize("name", list(_hostile_variants()))
def test_malformed_structures_are_not_routed_fast(name):
    blob, why = _hostile_variants()[name]
    with pytest.raises(NotFast, match=why):
        jpeg_header(blob)
    fast, slow, failed = route([blob], tiny_spec())
    assert not fast and (slow == [0] or 0 in failed)


def test_route_sends_readable_slow_files_to_pil_and_names_the_unreadable():
    from hostile import header_only

    png = io.BytesIO()
    Image.new("RGB", (64, 48)).save(png, "PNG")
    good = CASES["444"]()
    cmyk = CASES["cmyk"]()
    blobs = [good, png.getvalue(), header_only(good), good[: len(good) // 2], b"GIF89a nonsense", None, cmyk]
    fast, slow, failed = route(blobs, tiny_spec())
    assert [i for i, _ in fast] == [0] and 1 in slow and 3 in slow   # PNG and truncated JPEG: the reference
    assert 6 in slow                                                  # CMYK: the reference (Adobe inversion)
    assert set(failed) | set(slow) | {0} == set(range(7)) and failed[5] == "not read"
    assert "0x" not in failed.get(4, "")                             # one stable line, no object address


def test_a_pipeline_that_raised_is_replaced_before_the_next_batch(monkeypatch, capfd):
    spec = tiny_spec()
    blobs = [CASES["baseline-420"](), CASES["444"]()]
    dec = DaliDecoder(spec, 2, threads=1)
    first = dec._pipe
    want, _ = dec.decode(blobs)
    real = DaliDecoder._run

    def fails_once(self, *a):
        monkeypatch.setattr(DaliDecoder, "_run", real)
        raise RuntimeError("Critical error in pipeline:\nError in CPU operator nvidia.dali.fn.decoders.image")

    monkeypatch.setattr(DaliDecoder, "_run", fails_once)
    got, failed = dec.decode(blobs)
    assert failed == {} and dec._pipe is not first and dec._pipe is not None
    assert all(np.array_equal(got[i], decode_pil(b, spec)) for i, b in enumerate(blobs))   # the reference redid it
    again, _ = dec.decode(blobs)
    assert np.array_equal(again, want)                                 # the fresh pipeline decodes
    assert "rebuilding the pipeline" in capfd.readouterr().err


FUZZ = r'''
import sys, numpy as np
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
from conftest import tiny_spec
from engine.decoders.dali import DaliDecoder
from engine.decoders.route import NotFast, jpeg_header
from test_decode import CASES
from hostile import header_flips
rng = np.random.default_rng(int(sys.argv[2]))
accepted = []
for name in ("baseline-420", "444", "422", "progressive", "grayscale", "cmyk"):
    for blob in header_flips(CASES[name](), rng, 40):
        try:
            jpeg_header(blob)
            accepted.append(blob)
        except NotFast:
            pass
dec = DaliDecoder(tiny_spec(), 32, threads=2)
for i in range(0, len(accepted), 32):
    dec.decode(accepted[i:i + 32])
print("accepted", len(accepted), flush=True)
'''


def test_header_bit_flips_the_router_accepts_never_fail_a_dali_batch():
    """Fuzzing: every header-flipped JPEG that passes the router goes through DALI's CPU decoder,
    in batches, in a subprocess: no batch fails (which could crash the process) and it exits 0."""
    import subprocess
    import sys

    from conftest import REPO

    r = subprocess.run([sys.executable, "-c", FUZZ, str(REPO), "7"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) > 30                      # some mutants do reach DALI
    assert "batch of" not in r.stderr, r.stderr[-3000:]
