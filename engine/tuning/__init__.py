"""The build: a checkpoint becomes an artifact folder, its choices measured on this machine.

    python -m engine.build ...          the command (engine/build.py, the command's name, runs
                                        engine.tuning.command: parse, plan, build, report)

    command.py        the flags and `build()`: one spec, or the measured choice, written atomically
    context.py        the build's state (BuildContext), made once by `build()` and handed down
    auto.py           the measured build: decoder, search, assembly, end-to-end verification
    autotune.py       the search: candidates, their timings and checks, the ranked table
    measure.py, retime.py, table.py     one candidate timed; close ones retimed interleaved; the table
    assemble.py       a chosen spec made into an artifact (graph, guard, re-check graph)
    calibrate.py      the guard's tau from natural photos that are not evaluation data
    reference.py      the FP32 reference on as many calibration images as fit the deadline's share
    decoder_choice.py the decoder kept only if its flips against PIL fit the budget
    clock.py, disk.py, compile_failures.py   the build's deadline, its disk, a broken toolchain told apart
    renders.py        procedural renders: generated cohorts, a test head's fit, the guard's smoke check

Importing this package imports nothing heavy; `build`, `main`, `parse_args` and the other names
of engine.tuning.command are loaded from it on first use. The folder is not named build/: the
common ignore templates hide a folder of that name (generated output), and a forker's new file
there would be left out of their commits without a word.
"""
from __future__ import annotations

import importlib
from typing import Any

COMMAND_NAMES = ("AutoConfig", "GuardConfig", "RECHECK_DIR", "argument_parser", "build", "main",
                 "measure_batch_size", "parse_args")


def __getattr__(name: str) -> Any:
    if name in COMMAND_NAMES:
        return getattr(importlib.import_module("engine.tuning.command"), name)
    raise AttributeError(f"module 'engine.tuning' has no attribute {name!r}")
