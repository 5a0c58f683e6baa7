"""`python -m engine.build`: the build command, whose code lives in engine/tuning/ (its name here
stays the command's: scripts and docs call it so).

`from engine.build import build, GuardConfig, AutoConfig, ...` keeps working too: the names of
engine.tuning.command are loaded from it on first use, and importing this module imports nothing
heavy. A file, not a build/ folder: the common ignore templates hide folders named build/.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any

from engine.tuning import COMMAND_NAMES  # imports nothing heavy


def __getattr__(name: str) -> Any:
    if name in COMMAND_NAMES:
        return getattr(importlib.import_module("engine.tuning.command"), name)
    raise AttributeError(f"module 'engine.build' has no attribute {name!r}")


if __name__ == "__main__":
    from engine.tuning.command import main

    sys.exit(main())
