"""What the contest fixes, in one place: the model it scores, the images of one scored run,
and what the build's guard may spend of the disagreements its gate allows.

    DEFAULT_MODEL       ./build.sh's ENGINE_MODEL when the checkpoint records none; the model
                        scripts/device_check.py builds
    COHORT_IMAGES       images one scored run classifies: 10,000, of which threshold(10,000) =
                        9,900 must match the reference (evaluator.contest.agreement's 99 % gate),
                        so the gate allows 100 disagreements
    GUARD_DISAGREEMENTS the estimated disagreements per scored run the guard may leave (10 of those
                        100); `guard_budget()` is that in engine.build's `--guard-budget` unit
"""
from __future__ import annotations

DEFAULT_MODEL = "eva02_large_patch14_448.mim_m38m_ft_in22k_in1k"
COHORT_IMAGES = 10_000
GUARD_DISAGREEMENTS = 10


def allowed_disagreements(images: int = COHORT_IMAGES) -> int:
    """Rows of `images` that may disagree with the reference and still pass the gate (100 of 10,000)."""
    from evaluator.contest.agreement import threshold

    return images - threshold(images)


def guard_budget() -> float:
    """GUARD_DISAGREEMENTS per COHORT_IMAGES in engine.calibrate's unit (basis points of the images)."""
    from engine.calibrate import BASIS_POINTS

    return GUARD_DISAGREEMENTS * BASIS_POINTS / COHORT_IMAGES
