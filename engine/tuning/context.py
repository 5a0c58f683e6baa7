"""One build's state, made once by engine.tuning.command.build and handed down instead of argument lists,
and the two configs a caller gives it (GuardConfig, AutoConfig; engine.build re-exports both).

What the whole build shares is set when it starts (spec, device, its preset looked up once, the guard
with the preset's values filled in, the auto config, the deadline's clock); the work folder, the
network and the manifest's extras as the command reaches them; under `auto` the measured pieces as
they become known (engine.tuning.auto: the decoder, the calibration reference, the search's result,
its record and verifications). What differs per candidate (its spec, its files, its tau) is passed
beside the context.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.core.spec import Spec
from engine.presets import Preset, preset, shared

if TYPE_CHECKING:
    from engine.tuning.autotune import SearchResult
    from engine.tuning.calibrate import FolderCheck
    from engine.tuning.clock import BuildClock
    from engine.tuning.reference import Reference


@dataclasses.dataclass
class GuardConfig:
    """The margin guard's settings; a None of calibration_count, safety, recheck_batch or budget is
    the device preset's (engine/presets/classification.py), filled in when the build's context is made."""
    enabled: bool = True                  # below fp32: re-check near-ties in FP32
    calibration_images: Path | None = None  # a folder of the user's images; None: calibration_source
    calibration_count: int | None = None  # calibration images tau is chosen on
    safety: float | None = None           # factor on the estimated disagreements
    recheck_batch: int | str | None = None  # static batch of the FP32 re-check graph, "auto" (measured)
    recheck_backend: str | None = None    # backend of the re-check graph (default: the build's)
    budget: float | None = None           # disagreements allowed, in basis points: tau keeps its estimate
                                          # under it (under auto, what the decoder's flips leave of it)
    calibration_source: str = "photos"    # photos (scikit-image's bundled photos) | renders
    smoke_count: int = shared("smoke_count")   # renders that check the low-precision graph is not broken
    calibration_check: FolderCheck | None = None   # the caller's reasons to refuse calibration_images
    run_images: int | None = None         # images one run classifies: "auto" sizes the re-check calls for them
    calibration_trade: bool | None = None  # under auto with a low precision, trade the count (engine.build.
                                           # calibration_trade); None: when calibration_count was not given

    def for_device(self, device: str) -> GuardConfig:
        """This config with every None that stands for the device preset's value filled in."""
        return self.for_preset(preset(device))

    def for_preset(self, pre: Preset) -> GuardConfig:
        """This config with every None that stands for a value of the preset `pre` filled in."""
        trade = self.calibration_trade if self.calibration_trade is not None else self.calibration_count is None
        given = {"calibration_trade": trade, "calibration_count": pre.calibration_count, "safety": pre.guard_safety,
                 "recheck_batch": pre.recheck_batch, "budget": pre.guard_budget}
        return dataclasses.replace(self, **{k: v for k, v in given.items() if getattr(self, k) is None})



@dataclasses.dataclass
class AutoConfig:
    """What `auto` leaves to the measurement (engine.tuning.autotune), and its limits."""
    precision: bool = True                # measure the precisions (else the spec's)
    batch_size: bool = True               # measure the preset's batch sizes (else the spec's)
    backend: bool = True                  # measure the backends that import (else the build's)
    precisions: tuple[str, ...] | None = None   # candidates to measure; None: the device's native ones
    budget_s: float | None = None         # the search's time budget; None: the device preset's
    verify: bool = True                   # run the chosen artifact end to end against FP32
    deadline_s: float | None = None       # the whole build's seconds; None: the device preset's
    clock: Callable[[], float] = time.monotonic   # the deadline's clock (engine.tuning.clock.BuildClock)


@dataclasses.dataclass
class BuildContext:
    """The build's shared state; `preset` and the guard's None fields come from the device's preset."""
    spec: Spec                              # asked (auto: FP32 and the preset's static batch until chosen)
    device: str
    guard: GuardConfig = dataclasses.field(default_factory=GuardConfig)   # under auto: the budget the decoder leaves
    work: Path | None = None                # the artifact folder being made (renamed into place when done)
    checkpoint: Path | None = None
    net: Any = None                         # the FP32 network (None: a backend that needs no weights)
    auto: AutoConfig | None = None          # what `auto` measures (None: a fixed build)
    clock: BuildClock | None = None         # the deadline kept under auto (engine.tuning.clock)
    extra: dict = dataclasses.field(default_factory=dict)   # the manifest's extras so far
    t0: float = dataclasses.field(default_factory=time.perf_counter)   # the build's start (its seconds)
    preset: Preset | None = None            # None: the device's, looked up here
    # measured under auto, as they become known (engine.tuning.auto)
    decoder: dict | None = None             # the decoder chosen: build_decoder.Choice.record()
    calibration: Reference | None = None    # the FP32 reference on the calibration images
    search: SearchResult | None = None      # the search's trials, ranked and handles
    search_record: dict = dataclasses.field(default_factory=dict)   # the manifest's build.search, without the table
    verified: list[dict] = dataclasses.field(default_factory=list)  # the end-to-end checks, in order

    def __post_init__(self) -> None:
        if self.preset is None:
            self.preset = preset(self.device)
        self.guard = self.guard.for_preset(self.preset)
