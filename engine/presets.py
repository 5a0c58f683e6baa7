"""The build's defaults, one table per device (as gpt-fast's `transformer_configs` or MLPerf's
`SUPPORTED_PROFILES`): `python -m engine.build`, `./build.sh` and the device check read them here,
so changing a default precision, backend or batch size is one edit in this file.

`auto` means measured on the build machine (engine.autotune): the precision, the batch size
and the backend are the fastest candidate that holds the disagreement budget there.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Preset:
    device: str
    batch_sizes: tuple[int, ...]       # the candidates of --batch-size auto
    static_batch_size: int             # a static batch where none is measured: the spec's until the search
                                       # picks one, the eager FP32 fallback's, scripts/device_check.py's builds
    search_budget_s: float             # the whole auto search (screens, compiles, timings, agreement)
    options: tuple[str, ...]           # backend compile options the search tries ("default" first)
    cuda_graphs: tuple[bool, ...]      # CUDA graph replay on / off, measured
    precision: str = "auto"            # --precision when none is given
    backend: str = "auto"              # --backend when none is given
    batch_size: int | str = "auto"     # --batch-size when none is given
    recheck_batch: int = 8             # --recheck-batch when none is given: the guard's FP32 re-check graph
    verify_images: int = 256           # the chosen artifact end to end through scripts/run, against FP32
    verify_gate: float = 0.99          # its top-1 agreement with the FP32 eager path, at least


PRESETS = {
    # 2 cores to 16: batches that keep a compiled ViT's GEMMs in cache; Inductor's C++ GEMM templates
    # (max-autotune) are timed against oneDNN/MKL. Budget: ~3 compiles of a ViT-Ti/336 on 2 cores.
    "cpu": Preset("cpu", (8, 16, 32), 16, 900.0, ("default", "max-autotune"), (False,)),
    # One Hopper GPU, EVA-02-L/448 (by estimate, not yet measured on a GPU): a checkpoint load of
    # ~1 min, ~4 min per AOTInductor compile, 4 compiles and their timings in 1,500 s, then the
    # guard's re-check graph and the end-to-end check: inside a 30-minute build step.
    "cuda": Preset("cuda", (32, 64, 100, 128), 64, 1500.0, ("default",), (True, False)),
}


def preset(device: str) -> Preset:
    if device not in PRESETS:
        raise ValueError(f"no preset for device {device!r}; one of {', '.join(PRESETS)}")
    return PRESETS[device]


def per_device(field: str) -> str:
    """`field` of every preset, for a --help: "cpu: auto, cuda: auto"."""
    return ", ".join(f"{d}: {getattr(p, field)}" for d, p in PRESETS.items())
