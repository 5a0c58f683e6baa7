"""The retrieval task's rules, in one place: what the ABI may return and spend.

The engine's retrieval code takes these as arguments; it knows no task.
"""
from __future__ import annotations

from pathlib import Path

from engine.presets.retrieval import RETRIEVAL

TOP_K = 50                  # at most 50 distinct gallery images per request
MAX_REINSPECT = 100         # candidate images per request that may be re-inspected visually
CLIP_DIR = Path("/task/models/clip")   # where the task mounts the supplied CLIP


def clip_dir(given=None, meta: dict | None = None, model_name: str | None = None, say=None) -> Path:
    """The CLIP folder: `given`, else CLIP_MODEL_DIR, else where the task mounts it when it is
    there, else the folder the index (its meta.json `meta`) records when its digest matches
    (said through `say`), else where the task mounts it (engine.retrieval.index_clip.resolve)."""
    from engine.retrieval.index_clip import resolve

    return resolve(given, meta, CLIP_DIR, model_name, say)


def method(name: str = RETRIEVAL.method, text_weight: float | None = None, prompt: str | None = None):
    """engine.retrieval.compose.make_method with the task's re-inspection cap (clamped, and said)."""
    from engine.retrieval.compose import make_method

    return make_method(name, text_weight, prompt, max_reinspect=MAX_REINSPECT)


def check_method(m):
    """`m` unchanged if it keeps to the task's limits, else ValueError."""
    n = max((o.inspected() for o in m.options), default=0)
    if n > MAX_REINSPECT:
        raise ValueError(f"reinspect must lie in 0..{MAX_REINSPECT} candidates per request, got {n}")
    return m
