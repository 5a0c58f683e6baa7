"""The build's defaults, one table per device (as gpt-fast's `transformer_configs` or MLPerf's
`SUPPORTED_PROFILES`): `python -m engine.build`, `./build.sh` and the device check read them here,
so changing a default precision, backend, batch size or guard budget is one edit in this file;
no other module holds a literal default for a field of this table (tests/test_presets.py).
The retrieval engine's table is engine/retrieval/presets.py. `python -m engine.presets` prints
both, as docs/classification.md and docs/retrieval.md show them (a test keeps them equal).

`auto` means measured on the build machine (engine.build.autotune): the precision, the batch size
and the backend are the fastest candidate that holds the disagreement budget there.
"""
from __future__ import annotations

import dataclasses


def _field(doc: str, names: tuple[str, ...] = (), **default):
    """A preset field whose meaning the table (markdown()) prints beside its values. `names`: what
    other code calls this default (`name` anywhere, `Owner.name` in that class or function only),
    so that tests/test_presets.py finds a literal copy of it under either name."""
    return dataclasses.field(metadata={"doc": doc, "names": names}, **default)


@dataclasses.dataclass(frozen=True)
class Preset:
    device: str = _field("the device the preset is for")
    batch_sizes: tuple[int, ...] = _field("the candidates of `--batch-size auto`")
    static_batch_size: int = _field("a static batch where none is measured: the spec's until the search picks "
                                    "one, the eager FP32 fallback's, the device check's builds")
    search_budget_s: float = _field("seconds for the whole auto search (screens, compiles, timings, agreement)",
                                    names=("budget_s",))
    options: tuple[str, ...] = _field("backend compile options the search tries (`default` first)")
    cuda_graphs: tuple[bool, ...] = _field("CUDA graph replay on / off, measured")
    precision: str = _field("`--precision` when none is given", default="auto")
    backend: str = _field("`--backend` when none is given", default="auto")
    batch_size: int | str = _field("`--batch-size` when none is given", default="auto")
    recheck_batch: int = _field("`--recheck-batch` when none is given: the guard's FP32 re-check graph", default=8)
    guard_budget: float = _field("`--guard-budget` when none is given: disagreements with FP32 allowed, in basis "
                                 "points of the images (1 is 0.01 %); the guard's tau keeps its estimate under it",
                                 names=("GuardConfig.budget", "choose_tau.budget"), default=10.0)
    guard_safety: float = _field("`--guard-safety` when none is given: the factor on the estimated disagreements "
                                 "tau is chosen with", names=("GuardConfig.safety", "choose_tau.safety"),
                                 default=2.0)
    calibration_count: int = _field("`--calibration-count` when none is given: calibration images tau is chosen on",
                                    names=("photo_pixels.count", "generated_pixels.count", "folder_pixels.count"),
                                    default=256)
    verify_images: int = _field("images the chosen artifact classifies end to end through scripts/run, "
                                "against FP32; each decoder's own flips are measured on them", default=256)
    verify_alpha: float = _field("the chance an artifact exactly at the disagreement budget fails that check: "
                                 "it allows the (1 - alpha) quantile of Binomial(images, budget) disagreements "
                                 "with FP32 on PIL's pixels (the decoder's included)", default=0.05)
    build_deadline_s: float = _field("seconds for the whole measured build (checkpoint, calibration reference, "
                                     "search, re-check graph, verification): every phase spends from it, the search "
                                     "what the others leave (`search_budget_s` its cap)", default=1500.0)
    checkpoint_estimate_s: float = _field("the deadline's plan: seconds to load the checkpoint", default=10.0)
    calibration_estimate_s: float = _field("the deadline's plan: seconds for the FP32 reference on the calibration "
                                           "images", default=20.0)
    compile_estimate_s: float = _field("the deadline's plan: seconds of one compile before one is measured (the "
                                       "search's first, the guard's re-check graph)", default=120.0)
    verify_estimate_s: float = _field("the deadline's plan: seconds to assemble and verify one candidate end to end",
                                      default=60.0)
    int8_calibration_images: int = _field("calibration images the int8 candidate's activation ranges are observed "
                                          "on (PT2E static quantization; the CPU's only: the GPU has no int8 "
                                          "candidate)", names=("export_int8.count",), default=64)


PRESETS = {
    # 2 cores to 16: batches that keep a compiled ViT's GEMMs in cache; Inductor's C++ GEMM templates
    # (max-autotune) are timed against oneDNN/MKL. Budget: ~3 compiles of a ViT-Ti/336 on 2 cores.
    "cpu": Preset("cpu", (8, 16, 32), 16, 900.0, ("default", "max-autotune"), (False,)),
    # One Hopper GPU, EVA-02-L/448 (by estimate, not yet measured on a GPU): a checkpoint load of
    # ~1 min, ~4 min per AOTInductor compile. The deadline (1,500 s: 25 min, a margin under a
    # 30-minute build step) less the other phases' estimates leaves the search ~1,050 s, under its cap.
    "cuda": Preset("cuda", (32, 64, 100, 128), 64, 1500.0, ("default",), (True, False), checkpoint_estimate_s=60.0,
                   calibration_estimate_s=30.0, compile_estimate_s=240.0, verify_estimate_s=120.0),
}


def preset(device: str) -> Preset:
    if device not in PRESETS:
        raise ValueError(f"no preset for device {device!r}; one of {', '.join(PRESETS)}")
    return PRESETS[device]


def markdown() -> str:
    """The table as Markdown: one row per field, one column per device, and what the field means."""
    rows = ["| field | " + " | ".join(PRESETS) + " | meaning |", "|---|" + "---|" * (len(PRESETS) + 1)]
    for f in dataclasses.fields(Preset):
        if f.name == "device":
            continue
        cells = []
        for p in PRESETS.values():
            value = getattr(p, f.name)
            cells.append(", ".join(map(str, value)) if isinstance(value, tuple) else str(value))
        rows.append(f"| `{f.name}` | " + " | ".join(cells) + f" | {f.metadata['doc']} |")
    return "\n".join(rows)


def per_device(field: str) -> str:
    """`field` of every preset, for a --help: "cpu: auto, cuda: auto"."""
    return ", ".join(f"{d}: {getattr(p, field)}" for d, p in PRESETS.items())


def tables() -> str:
    """Both engines' tables, as the docs show them: this one (docs/classification.md), a blank
    line, the retrieval engine's (docs/retrieval.md)."""
    from engine.retrieval import presets as retrieval

    return markdown() + "\n\n" + retrieval.markdown()


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.presets`: both tables on stdout (it takes no arguments but --help)."""
    from engine.cli import ArgumentParser

    ArgumentParser(prog="python -m engine.presets", description="Print the defaults as Markdown tables: the "
                   "classification build's, one column per device (docs/classification.md), then the retrieval "
                   "engine's (docs/retrieval.md).").parse_args(argv)
    print(tables())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
