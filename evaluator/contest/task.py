"""What the contest fixes, in one place: the model it scores, the images of one scored run,
and what the build may spend of the disagreements its gate allows.

    DEFAULT_MODEL       ./build.sh's ENGINE_MODEL when the checkpoint records none; the model
                        scripts/device_check.py builds
    COHORT_IMAGES       images one scored run classifies: 10,000, of which threshold(10,000) =
                        9,900 must match the reference (evaluator.contest.agreement's 99 % gate),
                        so the gate allows 100 disagreements
    GATE_MARGIN         the gate's allowance over what the build may expect: the build's
                        disagreement budget is allowed_disagreements() / GATE_MARGIN = 50 of
                        10,000 images; `guard_budget()` is that in engine.build's `--guard-budget`
                        unit (basis points of the images: 50)

The 50 hold everything the artifact changes: the decoder's own flips against PIL (the build
measures them, engine.tuning.decoder_choice, and takes the next decoder when they break the 50) and
precision's (the guard's estimate, times its safety 2, held under 50 minus the decoder's
measured rate). The margin of 2 covers the scored run's chance and the calibration photos
standing in for its images: at a true rate of 50 the run's disagreements are about
Binomial(10,000, 0.005), 50 +- 7, over 100 with probability ~1e-10; the rest of the margin is for
the evaluation images' near-ties being more common than the photos'.
"""
from __future__ import annotations

DEFAULT_MODEL = "eva02_large_patch14_448.mim_m38m_ft_in22k_in1k"
COHORT_IMAGES = 10_000
GATE_MARGIN = 2


def allowed_disagreements(images: int = COHORT_IMAGES) -> int:
    """Rows of `images` that may disagree with the reference and still pass the gate (100 of 10,000)."""
    from evaluator.contest.agreement import threshold

    return images - threshold(images)


def guard_budget() -> float:
    """The build's disagreement budget, decoder and precision together: the gate's allowance over
    GATE_MARGIN, in engine.tuning.calibrate's unit (basis points of the images): 100 / 2 = 50."""
    from engine.tuning.calibrate import BASIS_POINTS

    return allowed_disagreements() / GATE_MARGIN * BASIS_POINTS / COHORT_IMAGES
