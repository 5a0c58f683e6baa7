"""eva-engine: an optimized EVA-02 ImageNet classifier behind a small API.

    import engine

    with engine.load("artifacts/default") as clf:     # an artifact built by ./build.sh
        top1 = clf.classify(["a.jpg", "b.png"])         # int32 numpy array, in order

`engine.load(artifact, **options)` returns an engine.classify.classifier.Classifier (its options and
load order are documented there). Importing `engine` loads neither torch nor numpy: `load`,
`Classifier`, `LoadError` and the subpackage `engine.retrieval` are imported on first use.
"""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.classify.classifier import Classifier

__all__ = ["Classifier", "LoadError", "load", "retrieval"]

_FROM_CLASSIFIER = ("Classifier", "LoadError")
_SUBPACKAGES = ("retrieval",)


def load(artifact: str | os.PathLike, **options: Any) -> Classifier:
    """The artifact loaded with its decoder, ready to classify (engine.classify.classifier.Classifier)."""
    from engine.classify.classifier import Classifier

    return Classifier(artifact, **options)


def __getattr__(name: str) -> Any:
    if name in _FROM_CLASSIFIER:
        return getattr(importlib.import_module("engine.classify.classifier"), name)
    if name in _SUBPACKAGES:
        return importlib.import_module(f"engine.{name}")
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
