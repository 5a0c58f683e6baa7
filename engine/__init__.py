"""eva-engine: an optimized EVA-02 ImageNet classifier behind a small API.

    import engine

    with engine.load("artifacts/default") as clf:     # an artifact built by ./build.sh
        top1 = clf.classify(["a.jpg", "b.png"])         # int32 numpy array, in order

`engine.load(artifact, **options)` returns an engine.classify.classifier.Classifier (its options and
load order are documented there). Importing `engine` loads neither torch nor numpy: `load`,
`Classifier`, `LoadError` and the subpackage `engine.retrieval` are imported on first use.

The engine's folders are layers. An import (at the top of a file, inside a function, or for types
only) names a module of its own folder or of a lower layer, never of a higher one or of a sibling
on its own layer (tests/test_architecture.py reads this table and checks every import):

    layer  folders                 what it holds
    0      (root)                  plumbing: settings, io, cli, threads, memory, children, progress, ...
    1      presets/                the tables of defaults: the classification build's, the retrieval engine's
    2      core/                   the spec, input geometry, graph, weights, precision policy, GPU hand-over
    3      decoders/, backends/    one file per decoder or runtime backend, each behind its registry
    4      classify/               an artifact loaded and run: the Classifier, runtime, pipeline, guard
    5      tuning/, clip/          the measured classification build; the CLIP towers and their tuning
    6      retrieval/              the index, the gallery embedding, the query pipeline

Three exceptions, each named in the test: this file (the API facade) imports classify/ and retrieval/
on first use, engine/build.py (the build command's name: `python -m engine.build`) hands over to
tuning/, and engine.settings reads the decoders' and backends' name tables (modules that import
nothing of the engine) to check a setting's value. kernels/ imports nothing of the engine; evaluator/
imports the engine and never the reverse.
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
