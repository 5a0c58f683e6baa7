"""Runtime backends, one file each, behind one table (as MLPerf's `backend_*.py`).

A backend module declares everything the rest of the kit needs to know about it:

    NAME              its name in manifests and on the command line
    FILES             the artifact files it writes (names relative to the artifact)
    COMPILED          suffixes of those files that are compiled code (the rehearsal's
                      no-JIT check and provenance ask this)
    NEEDS_WEIGHTS     False when it builds without a checkpoint
    COMPILES          True when save() compiles (engine.tuning.autotune times that, and budgets for it)
    AUTO              True when `--backend auto` may measure it (the null backend answers class 0)
    OPTIONS           (optional) compile options save(..., options=) takes, "default" first
    unavailable(device) -> str | None   (optional) why it cannot build here (None: it can)
    save(net, spec, device, out_dir, margin) -> dict   build time: write FILES, return manifest extras
    load(artifact, device) -> fn      run time: fn(uint8 [B, S, S, 3]) -> int32 top-1 [B], or with
                                      margin (artifact.meta["guard"]) (top-1 [B], FP32 margin [B]);
                                      fn takes a batch on any device and runs on `device`
                                      (engine.core.model.OnDevice), its outputs on `device`

Adding a backend is one file here and one entry in BACKENDS.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# name -> module; the first is the default
BACKENDS: dict[str, str] = {
    "aot": "engine.backends.aot",
    "eager": "engine.backends.eager",
    "null": "engine.backends.null",
    "trt": "engine.backends.trt",
}
DEFAULT = next(iter(BACKENDS))
REFERENCE = "eager"   # the plain form every other backend is checked against, and the measured build's fallback


def get(name: str) -> ModuleType:
    """The backend module for `name`; ValueError naming the choices for an unknown one."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])


def compiled_suffixes() -> set[str]:
    """Suffixes of artifact files that any backend writes as compiled code (e.g. '.pt2')."""
    return {s for name in BACKENDS for s in get(name).COMPILED}
