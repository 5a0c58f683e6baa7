"""The evaluator's environment switches (the ABIs' defaults), read once through engine.settings.

| variable | default | what it sets |
|---|---|---|
| CONTEST_MANIFEST | /contest/input/manifest.tsv | scripts/run's MANIFEST |
| CONTEST_IMAGE_ROOT | /contest/input/images | scripts/run's IMAGE_ROOT |
| CONTEST_OUTPUT | /contest/output/predictions.i32 | scripts/run's OUTPUT |
| CONTEST_REPORT | (none) | where scripts/run writes its timing JSON |
| CIR_METHOD | the index's, else slerp | scripts/build.sh / run.sh --method |
| CIR_TEXT_WEIGHT | per method | scripts/run.sh --text-weight |
| CIR_PROMPT | auto | scripts/run.sh --prompt |
| CIR_CORPUS | the index's | scripts/run.sh --corpus (records for re-inspection) |
| REHEARSE_RUN_CMD | scripts/run | the command scripts/rehearse runs as the entry point |
"""
from __future__ import annotations

from pathlib import Path

from engine.settings import number, path, read, text


def contest_manifest() -> Path:
    return read("CONTEST_MANIFEST", path, Path("/contest/input/manifest.tsv"))


def contest_image_root() -> Path:
    return read("CONTEST_IMAGE_ROOT", path, Path("/contest/input/images"))


def contest_output() -> Path:
    return read("CONTEST_OUTPUT", path, Path("/contest/output/predictions.i32"))


def contest_report() -> Path | None:
    return read("CONTEST_REPORT", path, None)


def cir_method() -> str | None:
    return read("CIR_METHOD", text, None)


def cir_text_weight() -> float | None:
    return read("CIR_TEXT_WEIGHT", number, None)


def cir_prompt() -> str | None:
    return read("CIR_PROMPT", text, None)


def cir_corpus() -> Path | None:
    return read("CIR_CORPUS", path, None)


def rehearse_run_cmd() -> str | None:
    return read("REHEARSE_RUN_CMD", text, None)
