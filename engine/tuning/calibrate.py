"""Choosing the guard's tau at build time, on natural photos that are not evaluation data.

Images (engine.build `--calibration-source`, `--calibration-images DIR`):
    photos   default: random crops of the colour and grey photographs scikit-image ships
             with its package (offline; public-domain / CC0 pictures of an astronaut, a cat,
             a coffee cup, a rocket launch, a motorcycle, coins, a clock, ...: none is from
             ImageNet), each flipped at random, colour-jittered and JPEG-encoded with a fixed
             seed, then preprocessed by the PIL reference path of the spec;
    renders  the procedural renders of engine.tuning.renders (a smoke check that a build is not
             broken; they say little about photos' margins);
    DIR      a folder of the user's own images; the caller may pass a check (`refuse`, engine.build
             `--calibration-check`) whose reasons refuse the folder, e.g. that it holds evaluation data.

Each source is a `Stream`, read only as far as it is needed: the measured build's FP32 reference
(engine.tuning.reference) takes as many images as fit its share of the deadline, at least MIN_IMAGES,
and the record counts those. Both precisions classify every image taken: the compiled low-precision graph (top-1 and its
margin) and the FP32 reference (top-1 and its margin). `choose_tau` then picks the
smallest tau whose estimated disagreement rate stays under a budget; its docstring states
the estimator. Budgets and estimates are rates in basis points of the images (BASIS_POINTS:
1 is 0.01 %; the manifest's `*_per_10k` keys hold them). The source, the margin-error
quantiles and the curve (re-checked fraction and estimated disagreements per threshold) go
into the artifact. `allowed_disagreements` is the gate a check on n images applies for a
budget (a binomial quantile): the search's FP32 candidates and the build's end-to-end check.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from engine.core.spec import Spec
from engine.presets import shared

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"}
MAX_FILE_BYTES = 64 << 20


# scikit-image's bundled photographs (skimage.data loaders that read files shipped in the wheel)
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "stereo_motorcycle", "hubble_deep_field",
          "immunohistochemistry", "retina", "camera", "coins", "clock")
SOURCES = ("photos", "renders")


class CalibrationError(ValueError):
    """The calibration images cannot be used."""


REFERENCE_BATCH = shared("fp32_reference_batch")   # the FP32 reference graph's batch (and its decodes')
MIN_IMAGES = 16    # the guard's minimum: tau is never chosen on fewer calibration images


class Stream:
    """A calibration source read as far as it is needed: `take(n)` the next n images (fewer when the
    source ends), `origin()` the record of what was taken (its count and the digest of exactly those)."""

    def __init__(self, images: Iterator[tuple[np.ndarray, bytes]], record: dict, digest_key: str,
                 too_few: Callable[[int], str] | None = None):
        self.images, self.record, self.digest_key, self.too_few = images, record, digest_key, too_few
        self.count, self.hash = 0, hashlib.sha256()

    def take(self, n: int) -> np.ndarray:
        """[k, S, S, 3] uint8, the next k <= n images (k < n only where the source ends)."""
        out = []
        for px, digest in itertools.islice(self.images, max(n, 0)):
            out.append(px)
            self.hash.update(digest)
        self.count += len(out)
        return np.stack(out) if out else np.zeros((0, 0, 0, 3), np.uint8)

    def at_least(self, n: int) -> None:
        """A CalibrationError when fewer than n images were taken from a source that ended."""
        if self.count < n and self.too_few is not None:
            raise CalibrationError(self.too_few(self.count))

    def origin(self) -> dict:
        return {**self.record, "count": self.count, self.digest_key: self.hash.hexdigest()}


def photo_sources(names=PHOTOS) -> dict[str, np.ndarray]:
    """name -> [H, W, 3] uint8 of scikit-image's bundled photos (grey ones as three equal channels)."""
    try:
        from skimage import data
    except ImportError as e:
        raise CalibrationError(f"the default calibration photos come from scikit-image, which is not "
                               f"installed ({e}); install it or pass --calibration-images DIR") from None
    out = {}
    for name in names:
        px = getattr(data, name)()
        px = px[0] if isinstance(px, tuple) else px          # stereo_motorcycle: (left, right, disparity)
        px = np.asarray(px)
        if px.ndim == 2:
            px = np.repeat(px[..., None], 3, axis=2)
        out[name] = np.ascontiguousarray(px[..., :3].astype(np.uint8))
    return out


def augmented_crop(px: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[h, w, 3] uint8: a random crop (8-100 % of the area, aspect 3:4-4:3), a random horizontal
    flip and colour jitter (brightness, contrast, saturation x0.7-1.3) of `px` [H, W, 3]."""
    hh, ww = px.shape[:2]
    for _ in range(10):
        area = hh * ww * rng.uniform(0.08, 1.0)
        aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        w, h = int(round(np.sqrt(area * aspect))), int(round(np.sqrt(area / aspect)))
        if 16 <= w <= ww and 16 <= h <= hh:
            break
    else:
        w, h = ww, hh
    y, x = int(rng.integers(0, hh - h + 1)), int(rng.integers(0, ww - w + 1))
    img = px[y:y + h, x:x + w].astype(np.float32)
    if rng.random() < 0.5:
        img = img[:, ::-1]
    img = img * rng.uniform(0.7, 1.3)                                     # brightness
    img = img.mean() + (img - img.mean()) * rng.uniform(0.7, 1.3)         # contrast
    grey = img.mean(axis=2, keepdims=True)
    img = grey + (img - grey) * rng.uniform(0.7, 1.3)                     # saturation
    return np.clip(img, 0, 255).astype(np.uint8)


def photo_stream(spec: Spec, seed: int = 1, names=PHOTOS) -> Stream:
    """Augmented crops of scikit-image's photos through the reference preprocessing (each crop
    JPEG-encoded at quality 75-95 first, as the inputs are), one [S, S, 3] uint8 at a time, without end."""
    import io

    from PIL import Image

    from engine.decoders.pil import decode_pil

    photos = photo_sources(names)
    keys = sorted(photos)

    def images() -> Iterator[tuple[np.ndarray, bytes]]:
        rng = np.random.default_rng(seed)
        for i in itertools.count():
            crop = augmented_crop(photos[keys[i % len(keys)]], rng)
            buf = io.BytesIO()
            Image.fromarray(crop).save(buf, "JPEG", quality=int(rng.integers(75, 96)))
            px = decode_pil(buf.getvalue(), spec)
            yield px, px.tobytes()

    import skimage

    return Stream(images(), {"origin": f"scikit-image {skimage.__version__} bundled photos, random crops, flips, "
                                       f"colour jitter and JPEG re-encoding, seed {seed}", "photos": keys},
                  "pixels_sha256")


def photo_pixels(spec: Spec, count: int, seed: int = 1, names=PHOTOS) -> tuple[np.ndarray, dict]:
    """([count, S, S, 3] uint8 augmented crops of scikit-image's photos (photo_stream), record)."""
    s = photo_stream(spec, seed, names)
    return s.take(count), s.origin()


def generated_stream(spec: Spec, seed: int = 1) -> Stream:
    """Renders through the reference preprocessing, one [S, S, 3] uint8 at a time, without end."""
    import io

    from PIL import Image

    from engine.decoders.pil import decode_pil
    from engine.tuning.renders import render, templates

    def images() -> Iterator[tuple[np.ndarray, bytes]]:
        rng = np.random.default_rng(seed)
        temps = templates(100, seed + 1000)       # another world of templates than the test cohorts'
        while True:
            w, hh = (int(v) for v in rng.integers(150, 600, 2))
            px = render(temps[int(rng.integers(len(temps)))], w, hh, rng)
            buf = io.BytesIO()
            Image.fromarray(px).save(buf, "PNG")
            px = decode_pil(buf.getvalue(), spec)
            yield px, px.tobytes()

    return Stream(images(), {"origin": f"procedural renders (engine.tuning.renders), seed {seed}"}, "pixels_sha256")


def generated_pixels(spec: Spec, count: int, seed: int = 1) -> tuple[np.ndarray, dict]:
    """([count, S, S, 3] uint8 renders through the reference preprocessing, record)."""
    s = generated_stream(spec, seed)
    return s.take(count), s.origin()


# a calibration folder's check: (folder, its files sorted by path) -> the reasons it must not be used
FolderCheck = Callable[[Path, list[Path]], list[str]]


def folder_stream(folder: Path, spec: Spec, refuse: FolderCheck | None = None) -> Stream:
    """The readable images of `folder`, sorted by path, one [S, S, 3] uint8 at a time (an unreadable or
    oversized file is skipped and counted in the record's `skipped`).

    `refuse(folder, files)`: the caller's reasons to refuse the folder (e.g. it holds evaluation
    data); any reason is a CalibrationError before an image is read.
    """
    from engine.decoders.pil import decode_pil

    folder = Path(folder)
    if not folder.is_dir():
        raise CalibrationError(f"calibration folder not found: {folder}")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
    flags = refuse(folder, files) if refuse is not None else []
    if flags:
        raise CalibrationError(f"{folder} must never feed a build: "
                               + "; ".join(flags[:3]) + (f" (+{len(flags) - 3} more)" if len(flags) > 3 else ""))
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    record = {"origin": f"folder {os.path.abspath(folder)}", "skipped": 0}

    def read() -> Iterator[tuple[np.ndarray, bytes]]:
        for p in images:
            if p.stat().st_size > MAX_FILE_BYTES:
                record["skipped"] += 1
                continue
            data = p.read_bytes()
            try:
                px = decode_pil(data, spec)
            except Exception:  # noqa: BLE001 - an unreadable file is skipped, and counted
                record["skipped"] += 1
                continue
            yield px, p.relative_to(folder).as_posix().encode() + b"\0" + hashlib.sha256(data).digest()

    def too_few(n: int) -> str:
        return f"{folder}: {n} readable images; the guard needs at least {MIN_IMAGES}"

    return Stream(read(), record, "files_sha256", too_few)


def folder_pixels(folder: Path, spec: Spec, count: int,
                  refuse: FolderCheck | None = None) -> tuple[np.ndarray, dict]:
    """([n, S, S, 3] uint8 of the first `count` readable images of `folder`, sorted by path; record)
    (folder_stream; fewer than MIN_IMAGES readable is a CalibrationError)."""
    s = folder_stream(folder, spec, refuse)
    pixels = s.take(count)
    s.at_least(MIN_IMAGES)
    return pixels, s.origin()


def classify(fn, pixels: np.ndarray, batch: int, margin: bool, device=None) -> tuple[np.ndarray, np.ndarray | None]:
    """Run a static-batch graph over [N, S, S, 3] pixels (last batch padded): top-1 [N] (and margins [N]).

    Each padded chunk is uploaded once to `device` (the graph's; None leaves it on the host).
    """
    import torch

    n = len(pixels)
    top1, margins = np.zeros(n, np.int64), np.zeros(n, np.float32)
    with torch.inference_mode():
        for lo in range(0, n, batch):
            chunk = np.zeros((batch,) + pixels.shape[1:], np.uint8)
            m = min(batch, n - lo)
            chunk[:m] = pixels[lo:lo + m]
            x = torch.from_numpy(chunk)                                  # [batch, S, S, 3] uint8
            out = fn(x if device is None else x.to(device))
            if margin:
                t, g = out[0], out[1]
                margins[lo:lo + m] = g[:m].float().cpu().numpy()
            else:
                t = out[0] if isinstance(out, (list, tuple)) else out
            top1[lo:lo + m] = t[:m].cpu().numpy()
    return top1, (margins if margin else None)


BASIS_POINTS = 1e4     # basis points in a rate of 1: budgets and estimates are rates x BASIS_POINTS (1 = 0.01 %)
TAIL_QUANTILE = shared("guard_tail_quantile")   # margin errors above this quantile are modelled by an exponential tail


def allowed_disagreements(budget: float, n: int, alpha: float) -> int:
    """The gate of a check on n images against FP32: the most disagreements a true rate of `budget`
    basis points still explains, i.e. the smallest k with P(X <= k) >= 1 - alpha for
    X ~ Binomial(n, budget / BASIS_POINTS). An artifact whose rate is the budget fails the check
    with probability at most alpha; one at twice the budget still passes it often (B = 50, n = 256:
    3 allowed, passed by a rate of 100 with probability 0.75): the check catches gross failures,
    the estimate that holds the budget is choose_tau's."""
    if not 0 < alpha < 1 or n < 0 or budget < 0:
        raise ValueError(f"the gate needs 0 < alpha < 1, n >= 0 and a budget >= 0, got {alpha}, {n}, {budget}")
    p = min(budget / BASIS_POINTS, 1.0)
    if p >= 1.0:
        return n
    pmf = (1.0 - p) ** n                     # P(X = 0); the recurrence keeps a large n in floating range
    cdf, k = pmf, 0
    while cdf < 1.0 - alpha and k < n:
        pmf *= (n - k) / (k + 1) * p / (1.0 - p)
        k += 1
        cdf += pmf
    return k


def margin_errors(low_top1: np.ndarray, margins: np.ndarray, ref_top1: np.ndarray,
                  ref_margins: np.ndarray) -> np.ndarray:
    """[N] how far low precision moved each image's leading gap: |m_low - m_fp32| where both
    chose the same class; m_low + m_fp32 where they disagree (the gap between the two
    swapped classes moved at least that far)."""
    agree = low_top1 == ref_top1
    return np.where(agree, np.abs(margins - ref_margins), margins + ref_margins).astype(np.float64)


def tail_scale_factor(excesses: float, confidence: float) -> float:
    """The one-sided upper `confidence` bound of an exponential tail's scale over its estimate, the mean
    of `excesses` excesses: 2k / chi2_(1 - confidence)(2k) (2k x mean / scale is chi-square with 2k
    degrees of freedom). 1.43 for 26 excesses at 0.95 (256 images), 1.13 for 200 (2,000), 1.05 for 1,000."""
    from scipy.stats import chi2

    k = max(float(excesses), 0.5)
    return float(2 * k / chi2.ppf(1.0 - confidence, 2 * k))


class ErrorTail:
    """P(E >= t) for the margin error E: empirical up to the 90th percentile u of the
    calibration errors, then p_u exp(-(t - u) / lambda) with lambda the mean excess over u
    (the exponential peaks-over-threshold fit: a tail that never reaches zero, unlike the
    largest error seen). With a `confidence`, lambda is its upper bound at that confidence
    (tail_scale_factor): a small sample's tail is taken as heavy as it may be, and the bound
    tightens as the sample grows; `images` sizes the bound as if the sample had that many
    images at the same excess rate (the projection of engine.tuning.calibration_trade)."""

    def __init__(self, errors: np.ndarray, confidence: float | None = None, images: int | None = None):
        e = np.sort(np.asarray(errors, np.float64))
        self.errors = e
        self.u = float(np.quantile(e, TAIL_QUANTILE)) if len(e) else 0.0
        over = e[e > self.u]
        self.p_u = len(over) / max(len(e), 1)
        self.scale = float((over - self.u).mean()) if len(over) else max(float(e.mean()) if len(e) else 0.0, 1e-6)
        self.point_scale, self.factor = self.scale, 1.0
        if confidence is not None:
            if not 0 < confidence < 1:
                raise ValueError(f"the tail's confidence must be in (0, 1), got {confidence}")
            excesses = max(len(over), 1) * (images / len(e) if images and len(e) else 1.0)
            self.factor = tail_scale_factor(excesses, confidence)
            self.scale *= self.factor

    def survival(self, t: np.ndarray) -> np.ndarray:
        t = np.asarray(t, np.float64)
        emp = 1.0 - np.searchsorted(self.errors, t, side="left") / max(len(self.errors), 1)   # P(E >= t)
        tail = self.p_u * np.exp(-(t - self.u) / self.scale)
        return np.where(t <= self.u, emp, tail)


@dataclasses.dataclass(frozen=True)
class TauRule:
    """What tau is chosen for (choose_tau): the disagreement budget in basis points, the safety factor
    on the estimate, and the tail bound's confidence (None: the point estimate)."""
    budget: float
    safety: float
    confidence: float | None = None


def choose_tau(low_top1: np.ndarray, margins: np.ndarray, ref_top1: np.ndarray, ref_margins: np.ndarray,
               rule: TauRule, bound_images: int | None = None) -> dict:
    """The smallest tau whose estimated disagreement rate, in basis points, stays under `rule.budget`.

    The estimator. Rounding moves each logit a little; an image whose low-precision margin
    (top-1 minus top-2 logit) is m can change its top-1 only if the error on that gap is at
    least m. The calibration images give the error distribution (`margin_errors`, modelled
    by `ErrorTail`: empirical body, exponential tail) and stand in for the run's margin
    distribution. The guard re-checks every image with m < tau in FP32 (those cannot
    disagree), so with tau the expected disagreement rate, in basis points, is

        model(tau)    = BASIS_POINTS x mean over calibration images of [m_i >= tau] x P(E >= m_i)
        observed(tau) = BASIS_POINTS x (calibration disagreements with m_i >= tau) / N
        estimate(tau) = safety x max(model(tau), observed(tau))

    The rule's `safety` covers what the calibration set cannot show: images with more near-ties
    than the photos, an error tail heavier than exponential. Its `confidence` (the build passes
    its preset's `guard_confidence`; None: the point estimate) takes the tail's scale at its
    upper bound (ErrorTail): the bound of a small sample, which tightens, and with it tau and
    the re-checked fraction, as the calibration set grows; `bound_images` sizes that bound for
    a sample of that many images (what more calibration would give). estimate(tau) falls as tau
    grows; tau is the smallest threshold (0, or just above a calibration margin) at which
    it is <= budget, and the expected re-checked fraction is the share of calibration
    margins below it. A budget no threshold meets re-checks every calibration image.
    """
    budget, safety, confidence = rule.budget, rule.safety, rule.confidence
    if safety < 1:
        raise ValueError(f"safety factor must be >= 1, got {safety}")
    if budget <= 0:
        raise ValueError(f"the disagreement budget must be > 0, got {budget}")
    margins = np.asarray(margins, np.float64)
    n = len(margins)
    disagree = np.asarray(low_top1) != np.asarray(ref_top1)
    errors = margin_errors(np.asarray(low_top1), margins, np.asarray(ref_top1), np.asarray(ref_margins, np.float64))
    tail = ErrorTail(errors, confidence, bound_images)
    flip = tail.survival(margins)                                   # [N] P(E >= m_i)

    def estimate(tau: float) -> tuple[float, float]:
        kept = margins >= tau                                       # not re-checked
        model = BASIS_POINTS * float((flip * kept).sum()) / n
        observed = BASIS_POINTS * float((disagree & kept).sum()) / n
        return safety * max(model, observed), observed

    # thresholds: 0 and just above each margin (the guard re-checks margin < tau); "just above" in
    # float32, the margins' dtype on the device, so that the comparison there re-checks that image
    m32 = np.sort(margins).astype(np.float32)
    candidates = np.concatenate([[0.0], np.nextafter(m32, np.float32(np.inf)).astype(np.float64)])
    tau = float(candidates[-1])
    for t in candidates:
        if estimate(float(t))[0] <= budget:
            tau = float(t)
            break
    grid = sorted({0.0, tau, *np.quantile(margins, [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5]).tolist()})
    curve = [{"threshold": round(float(t), 6), "rechecked_fraction": round(float((margins < t).mean()), 6),
              "estimated_per_10k": round(estimate(float(t))[0], 3),
              "disagreements_left": int((disagree & (margins >= t)).sum())} for t in grid]
    est, _ = estimate(tau)
    return {"tau": tau, "budget_per_10k": budget, "safety": safety, "estimated_per_10k": round(est, 4),
            "images": n, "disagreements": int(disagree.sum()),
            "largest_disagreeing_margin": float(margins[disagree].max()) if disagree.any() else 0.0,
            "rechecked_fraction": float((margins < tau).mean()),
            "margin_error": {"quantiles": {q: round(float(np.quantile(errors, float(q))), 6)
                                           for q in ("0.5", "0.9", "0.99", "1.0")},
                             "tail": {"u": round(tail.u, 6), "p_u": round(tail.p_u, 6),
                                      "scale": round(tail.scale, 6), "point_scale": round(tail.point_scale, 6),
                                      "confidence": confidence, "scale_factor": round(tail.factor, 4)}},
            "rule": "smallest tau with safety x max(model, observed) disagreements, in basis points of the "
                    "images, <= budget (engine.tuning.calibrate.choose_tau)",
            "curve": curve}
