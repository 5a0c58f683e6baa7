"""Memory bounded by bytes and pixels: an image whose decode or resize would exceed the pixel
budget is refused from its header, before any allocation, on every decoder (the row is still
answered), and a run's read-ahead is a byte budget whatever the file sizes."""
from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, tiny_spec
from PIL import Image


def _jpeg(w: int, h: int, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), (90, 140, 200)[: len(mode)] if mode == "RGB" else 128).save(buf, "JPEG")
    return buf.getvalue()


def _spec336():
    """A center-crop spec at EVA-02's 336 side: a 3000x1 image resizes to 1008000x336."""
    return dataclasses.replace(tiny_spec("center"), input_size=336)


def test_checked_window_refuses_the_source_and_the_resized_size(monkeypatch):
    from engine.decoders.pil import TooLarge, checked_window

    spec = _spec336()
    assert checked_window(500, 375, spec).resize_h == 336
    with pytest.raises(TooLarge, match=r"resizes to 1008000x336 before the crop.*ENGINE_MAX_PIXELS"):
        checked_window(3000, 1, spec)
    monkeypatch.setenv("ENGINE_MAX_PIXELS", "100000")
    with pytest.raises(TooLarge, match=r"400x300 image has 120000 pixels, above the budget of 100000"):
        checked_window(400, 300, spec)
    with pytest.raises(TooLarge, match=r"300x300 image resizes to 336x336"):   # 90000 pixels, resized 112896
        checked_window(300, 300, spec)
    assert checked_window(300, 300, dataclasses.replace(spec, input_size=300)).resized is False


def test_a_tiny_wide_jpeg_is_refused_before_decoding_on_every_decoder():
    """The issue's 1 KB JPEG of 3000x1 px (3.9 GB in decode): unreadable, with the reason, from its
    header, on the router (DALI's and nvJPEG's path), the reference and the isolated DALI child."""
    from engine.decoders import make_decoder
    from engine.decoders.route import route

    spec = _spec336()
    wide, ok = _jpeg(3000, 1), _jpeg(500, 375)
    assert len(wide) < 2048
    fast, slow, failed = route([wide, ok], spec)
    assert [i for i, _ in fast] == [1] and slow == [] and "1008000x336" in failed[0]
    for name, isolate in (("pil", False), ("dali-cpu", False), ("dali-cpu", True)):
        dec = make_decoder(name, spec, 2, 1, isolate=isolate)
        try:
            out, failed = dec.decode([wide, ok])
        finally:
            if hasattr(dec, "close"):
                dec.close()
        assert list(failed) == [0] and "ENGINE_MAX_PIXELS" in failed[0], (name, failed)
        assert out.shape == (2, 336, 336, 3) and out[1].any()


PEAK = r'''
import resource, sys, json
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import dataclasses
from conftest import tiny_spec
from engine.decoders.pil import PilDecoder
from test_decoder_memory import _jpeg
spec = dataclasses.replace(tiny_spec("center"), input_size=336)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out, failed = PilDecoder(spec, 1, 1).decode([_jpeg(3000, 1)])
print(json.dumps({"failed": failed, "grew_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before}))
'''


def test_refusing_the_wide_jpeg_costs_no_memory():
    r = subprocess.run([sys.executable, "-c", PEAK, str(REPO)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert list(got["failed"]) == ["0"] and got["grew_kib"] < 64 << 10, got   # under 64 MiB, not GBs


def test_the_pixel_budget_is_a_setting_read_in_the_child_too(monkeypatch):
    from engine.decoders import make_decoder

    spec = tiny_spec("squash")
    blob = _jpeg(400, 300)
    monkeypatch.setenv("ENGINE_MAX_PIXELS", "100000")
    dec = make_decoder("dali-cpu", spec, 1, 1, isolate=True)
    try:
        _, failed = dec.decode([blob])
    finally:
        dec.close()
    assert "above the budget of 100000" in failed[0]
    monkeypatch.setenv("ENGINE_MAX_PIXELS", "0")
    from engine import settings

    with pytest.raises(settings.SettingsError, match="ENGINE_MAX_PIXELS"):
        settings.max_pixels()


def _null_artifact(dst: Path, batch_size: int = 16) -> Path:
    from engine.tuning import build

    build(tiny_spec(batch_size=batch_size), None, dst, backend="null", device="cpu")
    return dst


def run_rows_of_one_file(tmp: Path, size: int, rows: int, artifact: Path, **env: str) -> dict:
    """scripts/run over `rows` rows naming one JPEG grown to `size` bytes; its report."""
    import os

    from hostile import padded_jpeg

    root = tmp / f"root-{size}"
    root.mkdir()
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (300, 400, 3), dtype=np.uint8)).save(buf, "JPEG")
    (root / "img.JPEG").write_bytes(padded_jpeg(buf.getvalue(), size))
    (root / "manifest.tsv").write_text("".join(f"r{i}\timg.JPEG\n" for i in range(rows)))
    out, report = tmp / f"p-{size}.i32", tmp / f"report-{size}.json"
    r = subprocess.run([str(REPO / "scripts" / "run"), str(root / "manifest.tsv"), str(root), str(out),
                        "--report", str(report)], env={**os.environ, "ENGINE_ARTIFACT": str(artifact), **env},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(np.fromfile(out, "<i4")) == rows
    return json.loads(report.read_text())


# measured on 2 cores (null backend, isolated DALI decoder, default 256 MiB budget): 64 rows of a
# 50 KB file peak at ~0.5 GiB in the run's process and ~0.45 GiB in the decoder's; of a 63 MiB file
# at 1.1-1.8 GiB and ~1.1 GiB (before the byte budget: 6.4 GB, 96 files read ahead whatever their
# size). The process holds the budget's read-ahead, the chunk being decoded and its copy on the way
# to the decoder child besides its ~0.6 GiB base, and how much of that overlaps depends on timing
# (1.8 GiB seen on a busy machine): the stated bound is 2.5 GiB, whatever the file size.
BOUND_MIB = 2560


@pytest.mark.abi
def test_64_rows_of_a_63_mib_file_stay_within_the_stated_bound(tmp_path):
    art = _null_artifact(tmp_path / "artifact")
    rep = run_rows_of_one_file(tmp_path, 63 << 20, 64, art)
    assert rep["failed"] == 0
    peak = rep["peak_rss_mib"]
    assert 0 < peak["process"] < BOUND_MIB and 0 < peak["children"] < BOUND_MIB, peak
