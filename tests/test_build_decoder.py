"""The build's decoder choice (engine.tuning.decoder_choice) and the end-to-end gate (engine.tuning.calibrate.
allowed_disagreements): a decoder whose own flips against PIL break the budget is replaced by the
next one, PIL last, and the artifact records the one taken."""
from __future__ import annotations

import itertools
import json
import math
import sys

import numpy as np
import pytest
from conftest import tiny_spec

from engine.tuning import decoder_choice as build_decoder
from engine.tuning.calibrate import allowed_disagreements


def _binomial_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))


@pytest.mark.parametrize("budget, n, alpha", itertools.product((1.0, 10.0, 50.0, 100.0, 1000.0), (16, 64, 256, 1024),
                                                               (0.01, 0.05, 0.2)))
def test_the_gate_is_the_binomial_quantile_of_the_budget(budget, n, alpha):
    k = allowed_disagreements(budget, n, alpha)
    p = budget / 1e4
    assert _binomial_cdf(k, n, p) >= 1 - alpha                   # a rate at the budget fails with <= alpha
    assert k == 0 or _binomial_cdf(k - 1, n, p) < 1 - alpha      # and k is the smallest such count


def test_the_gate_in_numbers():
    assert allowed_disagreements(50, 256, 0.05) == 3       # the contest's 50 basis points on 256 images
    assert allowed_disagreements(10, 256, 0.05) == 1       # engine.build's default budget
    assert allowed_disagreements(50, 10_000, 0.05) == 62   # a large n: about the mean 50 + 1.645 sd
    assert allowed_disagreements(0, 256, 0.05) == 0
    with pytest.raises(ValueError, match="alpha"):
        allowed_disagreements(50, 256, 0.0)


def test_the_order_is_the_fast_decoder_first_and_pil_last():
    assert build_decoder.order("cuda") == ["dali-gpu", "nvjpeg", "pil"]
    assert build_decoder.order("cpu") == ["dali-cpu", "pil"]
    assert build_decoder.order("cuda", first="nvjpeg") == ["nvjpeg", "pil"]   # ENGINE_DECODER pins the start
    assert build_decoder.order("cpu", first="pil") == ["pil"]


class PixelDecoder:
    """Decodes a blob to the pixels it names (a fake: blob i is b"i"); `flip` rows get one pixel changed."""

    def __init__(self, name: str, flip=lambda i: False):
        self.name, self.flip = name, flip

    def decode(self, blobs):
        out = np.zeros((len(blobs), 4, 4, 3), np.uint8)
        for r, b in enumerate(blobs):
            i = int(b)
            out[r] = i % 200
            if self.flip(i):
                out[r, 0, 0, 0] += 1
        return out, {}


def _classify(px: np.ndarray) -> np.ndarray:
    """A fake FP32 graph whose answer moves with every pixel value: their sum."""
    return px.reshape(len(px), -1).astype(np.int64).sum(1)


def _make(decoders: dict):
    return lambda name: (decoders[name], None) if name in decoders else (None, "planted: not installed")


def test_a_decoder_that_flips_2_percent_is_replaced_by_the_next(capsys):
    blobs = [str(i).encode() for i in range(200)]
    decs = {"fast": PixelDecoder("fast", lambda i: i % 50 == 0), "pil": PixelDecoder("pil")}
    choice = build_decoder.choose(["fast", "pil"], blobs, _classify, 50.0, _make(decs))
    assert choice.name == "pil" and choice.precision_budget == 50.0
    fast = choice.tried[0]
    assert (fast["flips"], fast["images"], fast["per_10k"], fast["holds"]) == (4, 200, 200.0, False)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "decoder fast changes the FP32 answer on 4 of 200 natural-size images" in err[0] and "with pil" in err[0]


def test_each_decoder_that_breaks_the_budget_is_one_line_and_the_next_is_measured(capsys):
    blobs = [str(i).encode() for i in range(100)]
    decs = {"gpu": PixelDecoder("gpu", lambda i: i % 10 == 0), "other": PixelDecoder("other", lambda i: i == 3),
            "pil": PixelDecoder("pil")}
    choice = build_decoder.choose(["gpu", "other", "pil"], blobs, _classify, 200.0, _make(decs))
    assert choice.name == "other" and choice.precision_budget == pytest.approx(100.0)
    assert [t["flips"] for t in choice.tried] == [10, 1]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["engine.build: decoder gpu changes the FP32 answer on 10 of 100 natural-size images "
                   "(1000 basis points, budget 200): measuring other next"]


def test_a_decoder_within_the_budget_is_kept_and_precision_gets_the_rest(capsys):
    blobs = [str(i).encode() for i in range(200)]
    broken = PixelDecoder("broken", lambda i: 1 / 0)
    decs = {"broken": broken, "fast": PixelDecoder("fast", lambda i: i == 7), "pil": PixelDecoder("pil")}
    choice = build_decoder.choose(["missing", "broken", "fast", "pil"], blobs, _classify, 100.0, _make(decs))
    assert choice.name == "fast"
    assert choice.precision_budget == pytest.approx(100.0 - 50.0)        # 1 of 200 images: 50 basis points
    assert choice.tried[0] == {"decoder": "missing", "holds": False, "why": "cannot start: planted: not installed"}
    assert choice.tried[1]["why"].startswith("failed: ZeroDivisionError")
    err = capsys.readouterr().err
    assert "decoder missing cannot start here" in err and "decoder broken failed on the check's images" in err
    rec = choice.record()
    assert rec["name"] == "fast" and rec["budget_per_10k"] == 100.0 and rec["precision_budget_per_10k"] == 50.0


# a decoder registered for a test (the registry's tables patched by monkeypatch): PIL's pixels,
# every EVERY-th image it decodes inverted (the first one included)
EVERY = 50


class FlippingDecoder:
    name = "flip-2pc"

    def __init__(self, spec):
        from engine.decoders.pil import PilDecoder

        self.pil, self.seen = PilDecoder(spec, 16, 1), 0

    def decode(self, blobs):
        px, failed = self.pil.decode(blobs)
        for r in range(len(blobs)):
            if (self.seen + r) % EVERY == 0:
                px[r] = 255 - px[r]
        self.seen += len(blobs)
        return px, failed


def create(name, spec, batch_size, threads=None):
    return FlippingDecoder(spec)


@pytest.fixture
def flipping_decoder(monkeypatch):
    """FlippingDecoder registered as `flip-2pc` (falling back to pil), and the start of the build's order."""
    from engine.decoders import registry

    monkeypatch.setitem(registry.DECODERS, "flip-2pc", __name__)
    monkeypatch.setitem(registry.NEEDS, "flip-2pc", ((), False))
    monkeypatch.setitem(registry.FALLBACK, "flip-2pc", "pil")
    monkeypatch.setenv("ENGINE_DECODER", "flip-2pc")


@pytest.mark.abi   # slow: a build's measured decoder and precision choice
def test_a_decoder_kept_leaves_precision_the_rest_of_the_budget(tiny_checkpoint, flipping_decoder, monkeypatch):
    from engine.core.checkpoint import load_model
    from engine.tuning import auto as build_auto
    from engine.tuning.assemble import GuardConfig
    from engine.tuning.context import BuildContext

    monkeypatch.setattr(sys.modules[__name__], "EVERY", 1000)     # the first of 100 images only: 100 basis points
    spec = tiny_spec("squash", 16)
    ctx = BuildContext(spec, "cpu", GuardConfig(budget=500.0), net=load_model(spec, tiny_checkpoint),
                       extra={"build": {}})
    build_auto._choose_decoder(ctx, 100)
    guard, extra = ctx.guard, ctx.extra
    rec = extra["build"]["decoder"]
    assert rec["tried"][0]["flips"] == 1 and extra["decoder"] == rec["name"] == "flip-2pc"
    assert guard.budget == rec["precision_budget_per_10k"] == 400.0 and rec["budget_per_10k"] == 500.0


@pytest.mark.abi   # slow: a whole build with its decoder check
def test_at_build_time_a_flipping_decoder_gives_way_to_pil_which_the_artifact_records(tmp_path, tiny_checkpoint,
                                                                                   flipping_decoder, capsys):
    from engine.tuning import AutoConfig, GuardConfig, build

    meta = build(tiny_spec("squash", 16), tiny_checkpoint, tmp_path / "art", backend="eager", device="cpu",
                 guard=GuardConfig(calibration_source="renders", calibration_count=100),
                 auto=AutoConfig(precision=False, batch_size=False, backend=False, budget_s=60))
    err = capsys.readouterr().err
    rec = meta["build"]["decoder"]
    flipped = rec["tried"][0]
    assert flipped["decoder"] == "flip-2pc" and flipped["flips"] >= 1 and not flipped["holds"], rec
    assert meta["decoder"] == rec["name"] == "pil"
    assert "decoder flip-2pc changes the FP32 answer" in err and "the artifact decodes with pil" in err
    # the end-to-end check ran scripts/run with PIL: no decoder flips, the total within the gate
    v = meta["build"]["search"]["verify"][-1]
    assert v["ok"] and v["decoder"] == "pil" and v["decoder_flips"] == 0 and v["disagreements"] <= v["allowed"]
    on_disk = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert on_disk["decoder"] == "pil"
    from engine.decoders import artifact_decoder

    assert artifact_decoder(on_disk) == "pil" and artifact_decoder({"device": "cuda"}) == "dali-gpu"


def test_the_self_check_accepts_the_decoder_the_build_chose_but_not_a_fallback_from_it(monkeypatch):
    import engine.decoders as decoders
    from engine.decoders import slow_decoder_reason

    monkeypatch.setattr(decoders, "start_problem", lambda name: None if name == "pil" else "planted: no GPU")
    assert slow_decoder_reason("cuda", recorded="pil") is None               # measured: the fast ones flip
    assert slow_decoder_reason("cuda", recorded="nvjpeg").startswith("this CUDA artifact would decode with pil")
    assert slow_decoder_reason("cuda").startswith("this CUDA artifact would decode with pil")   # nothing recorded
    assert slow_decoder_reason("cuda", "pil", recorded="dali-gpu").startswith("this CUDA artifact would decode "
                                                                              "with pil")


class NearestDecoder:
    """A planted decoder that decodes exactly as PIL does but resizes by nearest neighbour, straight to the
    input size (no antialiasing, no crop): right on images already at the input size, wrong elsewhere."""
    name = "nearest"

    def __init__(self, spec):
        self.side = spec.input_size

    def decode(self, blobs):
        import io

        from PIL import Image

        return np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("RGB").resize((self.side, self.side),
                                                                                      Image.Resampling.NEAREST))
                         for b in blobs]), {}


def create_nearest(name, spec, batch_size, threads=None):
    return NearestDecoder(spec)


def test_the_check_images_come_at_natural_sizes_larger_and_smaller_than_the_input():
    spec = tiny_spec("squash", 16)
    blobs, rec = build_decoder.natural_jpegs(spec, 40)
    from PIL import Image

    sizes = [Image.open(__import__("io").BytesIO(b)).size for b in blobs]
    assert len(blobs) == rec["images"] == 40 and blobs == build_decoder.natural_jpegs(spec, 40)[0]   # seeded
    assert any(max(s) < spec.input_size for s in sizes) and any(min(s) > spec.input_size for s in sizes)
    assert any(w / h > 1.3 for w, h in sizes) and any(h / w > 1.3 for w, h in sizes)
    assert (spec.input_size, spec.input_size) not in sizes


def _decoder_chosen(net, spec, budget: float) -> dict:
    """The manifest extras after the build's decoder choice on 256 natural-size JPEGs, on the CPU."""
    from engine.tuning import auto as build_auto
    from engine.tuning.assemble import GuardConfig
    from engine.tuning.context import BuildContext

    ctx = BuildContext(spec, "cpu", GuardConfig(budget=budget), net=net, extra={"build": {}})
    build_auto._choose_decoder(ctx, 256)
    return ctx.extra


@pytest.mark.abi   # slow: the FP32 graph over 256 images per decoder
def test_a_decoder_that_resizes_differently_is_refused_and_dali_still_holds(tiny_checkpoint, monkeypatch):
    """Decoders are compared where they differ: through their own resize of natural-size JPEGs. A planted
    decoder whose only fault is its resize (nearest neighbour) is refused; DALI's resize holds."""
    from engine.core.checkpoint import load_model
    from engine.decoders import registry, start_problem

    monkeypatch.setitem(registry.DECODERS, "nearest", __name__)
    monkeypatch.setitem(registry.NEEDS, "nearest", ((), False))
    monkeypatch.setitem(registry.FALLBACK, "nearest", "pil")
    monkeypatch.setattr(sys.modules[__name__], "create", create_nearest)
    monkeypatch.setenv("ENGINE_DECODER", "nearest")
    spec = tiny_spec("squash", 16)
    net = load_model(spec, tiny_checkpoint)
    budget = 100.0                                   # 2 flips in 256 images: DALI's rounding, not a wrong resize
    extra = _decoder_chosen(net, spec, budget)
    rec = extra["build"]["decoder"]
    near = rec["tried"][0]
    assert near["decoder"] == "nearest" and not near["holds"] and near["per_10k"] > budget, rec
    assert extra["decoder"] == "pil" and rec["images"]["larger_than_input"] > 0
    if start_problem("dali-cpu") is None:
        monkeypatch.setenv("ENGINE_DECODER", "dali-cpu")
        extra = _decoder_chosen(net, spec, budget)
        assert extra["decoder"] == "dali-cpu" and extra["build"]["decoder"]["tried"][0]["per_10k"] < budget
