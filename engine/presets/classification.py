"""The build's defaults, one table per device (as gpt-fast's `transformer_configs` or MLPerf's
`SUPPORTED_PROFILES`): `python -m engine.build`, `./build.sh` and the device check read them here,
so changing a default precision, backend, batch size or guard budget is one edit in this file;
no other module holds a literal default for a field of this table (tests/test_presets.py).
The retrieval engine's table is engine/presets/retrieval.py. `python -m engine.presets` prints
both, as docs/classification.md and docs/retrieval.md show them (a test keeps them equal).

`auto` means measured on the build machine (engine.tuning.autotune): the precision, the batch size
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
                                 names=("GuardConfig.budget", "TauRule.budget"), default=10.0)
    guard_safety: float = _field("`--guard-safety` when none is given: the factor on the estimated disagreements "
                                 "tau is chosen with", names=("GuardConfig.safety", "TauRule.safety"),
                                 default=2.0)
    calibration_count: int = _field("`--calibration-count` when none is given: calibration images tau is chosen on "
                                    "(under `auto`, with a low precision, the pilot the count is traded from)",
                                    names=("photo_pixels.count", "generated_pixels.count", "folder_pixels.count"),
                                    default=256)
    # The trade (engine.tuning.calibration_trade): more calibration images tighten the bound on the
    # margin-error tail, and with it tau and the share of a run re-checked in FP32; each costs the
    # build an FP32 and a low-precision inference. The count is the one with the least calibration +
    # expected re-check seconds for a run of the caller's size (`--run-images`; no size given, no trade), capped by the deadline's share
    # for calibration and by `calibration_max_images`.
    guard_confidence: float = _field("the one-sided confidence of the upper bound on the margin-error tail's scale "
                                     "tau is chosen with: a small calibration sample's tail is taken as heavy as it "
                                     "may be", names=("TauRule.confidence",), default=0.95)
    calibration_max_images: int = _field("the most calibration images the trade takes: past this many, crops of the "
                                         "bundled photos add little variety (a folder source ends at its files)",
                                         default=4096)
    verify_images: int = _field("JPEGs at natural sizes the chosen artifact classifies end to end through "
                                "scripts/run, against FP32 on PIL's pixels; each decoder's own flips, through its "
                                "own resize, are measured on them", default=256)
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
    verify_timeout_s: float = _field("seconds the end-to-end verification of one candidate may take",
                                     names=("verify_artifact.timeout",), default=1800.0)
    recheck_batches: tuple[int, ...] = _field("the candidates of `--recheck-batch auto` (the FP32 re-check graph's "
                                              "static batch)", default=(4, 8, 16))
    fp32_reference_batch: int = _field("the batch of the FP32 reference graph on the calibration and verification "
                                       "images (and of their decodes)", names=("fitted.batch", "flips.batch"),
                                       default=16)
    smoke_count: int = _field("renders that check the low-precision graph is not broken before its guard is "
                              "fitted", default=32)
    smoke_agreement: float = _field("raw low precision agreeing with FP32 on fewer of those renders than this "
                                    "fraction: a broken build", default=0.5)
    guard_tail_quantile: float = _field("the guard's error model: margin errors above this quantile are modelled "
                                        "by an exponential tail", default=0.9)
    search_prune: float = _field("a (precision, batch) screened under this fraction of the best screen is not "
                                 "compiled (unless it is its precision's best)", default=0.6)
    search_keep: int = _field("candidates that hold and keep their compiled files for the build's verification",
                              default=2)
    compile_fit: float = _field("a compile starts when this many times its estimate is left: the compile, its "
                                "timings and agreement", default=1.5)
    timing_warmup: int = _field("untimed calls before a graph's rate is timed (lazy inits, autotuned kernels)",
                                default=2)
    timing_calls: int = _field("timed calls of a graph's rate, at least (their median is the rate)", default=3)
    timing_min_s: float = _field("seconds a graph's rate is timed for, at least", default=2.0)
    timing_max_calls: int = _field("timed calls of a graph's rate, at most (however short each)", default=50)
    retime_tie: float = _field("medians within this fraction (plus the timings' spread) are a tie: the simpler "
                               "candidate wins", default=0.05)
    retime_window: float = _field("candidates within this fraction of the leader are timed again, interleaved "
                                  "with it", default=0.15)
    retime_rounds: int = _field("interleaved rounds (A B) of such a retiming, at least", default=3)
    retime_max_rounds: int = _field("... and more, up to this many, while a trial's timings are not steady",
                                    default=8)
    retime_steady: float = _field("relative median absolute deviation of a trial's timings that counts as steady",
                                  default=0.02)
    retime_settled: int = _field("timings of the leader before a candidate is pruned against it", default=3)
    pipeline_readers: int = _field("file-reading threads of the classification pipeline when its caller gives "
                                   "none (the run gives engine.threads' budget)",
                                   names=("classify.readers", "decoded_batches.readers"), default=8)
    pipeline_depth: int = _field("decoded batches in flight ahead of inference when the caller gives none",
                                 names=("classify.depth", "decoded_batches.ahead_batches"), default=2)
    check_calibration_count: int = _field("calibration images of the device check's builds (scripts/device_check.py "
                                          "`--calibration-count`): a quick check, not a full build", default=64)
    check_search_budget_s: float = _field("seconds of the device check's auto search (scripts/device_check.py "
                                          "`--search-budget-s`)", default=90.0)
    # fp16 costs what bf16 costs on the GEMM units that run both (Ampere, Hopper): where bf16 already holds
    # the budget, fp16's compile buys nothing unless its eager screen is clearly faster
    fp16_same_cost: float = _field("the search compiles fp16 beside a bf16 that holds (same backend) only where "
                                   "fp16's eager screen beats bf16's at the same batch by more than this share "
                                   "(within it, the same cost)", default=0.05)
    # a compile that hangs or runs far past its estimate must leave the others (and the fallback) their time
    compile_share: float = _field("a compile is stopped once it has run this share of the search's time left "
                                  "when it started, and its backend is dropped for the rest of the search",
                                  default=0.7)


PRESETS = {
    # 2 cores to 16: batches that keep a compiled ViT's GEMMs in cache; Inductor's C++ GEMM templates
    # (max-autotune) are timed against oneDNN/MKL. Budget: ~3 compiles of a ViT-Ti/336 on 2 cores.
    "cpu": Preset("cpu", (8, 16, 32), 16, 900.0, ("default", "max-autotune"), (False,)),
    # One Hopper GPU, EVA-02-L/448 (by estimate, not yet measured on a GPU): a checkpoint load of
    # ~1 min, ~4 min per AOTInductor compile. The deadline (1,500 s: 25 min, a margin under a
    # 30-minute build step) less the other phases' estimates leaves the search ~1,050 s, under its cap.
    "cuda": Preset("cuda", (32, 64, 100, 128), 64, 1500.0, ("default",), (True, False), checkpoint_estimate_s=60.0,
                   calibration_estimate_s=30.0, compile_estimate_s=240.0, verify_estimate_s=120.0,
                   recheck_batches=(8, 16, 32, 64)),
}


def preset(device: str) -> Preset:
    if device not in PRESETS:
        raise ValueError(f"no preset for device {device!r}; one of {', '.join(PRESETS)}")
    return PRESETS[device]


def shared(field: str):
    """`field`'s value, which every device's preset holds alike: what a module constant reads at import,
    before any device is known (ValueError once a preset sets its own, so that no module silently reads
    one device's value)."""
    values = {repr(getattr(p, field)): getattr(p, field) for p in PRESETS.values()}
    if len(values) != 1:
        raise ValueError(f"preset field {field!r} differs between devices ({', '.join(values)}): read it per device")
    return next(iter(values.values()))


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
