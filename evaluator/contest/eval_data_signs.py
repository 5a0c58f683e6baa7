"""Flags for files that look like ImageNet validation data or its answers.

Evaluation data must never feed a build (calibration, fitting): the contest's build step
passes `calibration_refusals` to engine.build (`--calibration-check`), which refuses a
calibration folder it flags, and the provenance record lists the flags for every file of
an artifact. The patterns are assembled so this file does not flag itself.
"""
from __future__ import annotations

import re
from pathlib import Path

from evaluator.contest.task import COHORT_IMAGES

VAL = "ILSVRC2012" + "_val_"
VAL_NAME = re.compile(re.escape(VAL) + r"\d{8}", re.IGNORECASE)
BAD_NAMES = [
    (re.compile("ILSVRC2012_validation" + "_ground_truth", re.IGNORECASE), "ImageNet validation ground truth"),
    (re.compile("LOC_val" + "_solution", re.IGNORECASE), "ImageNet localisation validation answers"),
    (re.compile("LOC_synset" + "_mapping", re.IGNORECASE), "ImageNet synset table"),
    (re.compile(r"(^|/)val\.txt$", re.IGNORECASE), "validation label list (val.txt)"),
    (re.compile("imagenet" + r"[_-]?val", re.IGNORECASE), "ImageNet validation data by name"),
]
ANSWER_LINE = re.compile(rb"^\s*\S+[\t ,]+(\d{1,3})\s*$")  # <id><sep><class>
SYNSET_LINE = re.compile(rb"^\s*n\d{8}\b")
CLASS_LINE = re.compile(rb"^\s*(\d{1,4})\s*$")  # one class id per line, as the devkit's ground truth
VALIDATION_IMAGES = 50_000
ANSWER_COUNTS = (COHORT_IMAGES, VALIDATION_IMAGES)  # a scored cohort and the full validation set
TABLE_LINES = 1000
TEXT_LIMIT = 64 << 20  # larger files are binaries (weights, engines): names and arrays only


def name_flags(name: str) -> list[str]:
    flags = [f"name looks like an ImageNet validation image ({VAL}NNNNNNNN)"] if VAL_NAME.search(name) else []
    return flags + [f"name suggests {what}" for rx, what in BAD_NAMES if rx.search(name)]


def content_flags(path: Path) -> list[str]:
    """Answer tables, synset tables, validation file lists and answer arrays inside one file."""
    import numpy as np

    flags = []
    size = path.stat().st_size
    if size in (4 * n for n in ANSWER_COUNTS) and path.suffix != ".npy":
        a = np.fromfile(path, "<i4")
        if a.min() >= 0 and a.max() <= 999:
            flags.append(f"{len(a)} int32 values all in [0, 999]: an answer array")
    if path.suffix == ".npy":
        try:
            a = np.load(path, mmap_mode="r", allow_pickle=False)
            if a.dtype.kind in "iu" and a.size in ANSWER_COUNTS and a.min() >= 0 and a.max() <= 999:
                flags.append(f".npy of {a.size} integers all in [0, 999]: an answer array")
        except ValueError as e:
            flags.append(f"unreadable .npy ({e}): cannot rule out an answer array")
    if size > TEXT_LIMIT:
        return flags
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return flags  # binary
    lines = data.splitlines()
    answers = sum(1 for ln in lines if (m := ANSWER_LINE.match(ln)) and int(m.group(1)) <= 999)
    if answers >= TABLE_LINES:
        flags.append(f"{answers} lines of <id> <class 0..999>: an answer table")
    column = sum(1 for ln in lines if (m := CLASS_LINE.match(ln)) and int(m.group(1)) <= 1000)
    if column >= TABLE_LINES:
        flags.append(f"{column} lines holding one class id each: an answer column")
    synsets = sum(1 for ln in lines if SYNSET_LINE.match(ln))
    if synsets >= TABLE_LINES:
        flags.append(f"{synsets} lines starting with a synset id (nXXXXXXXX): a synset/label table")
    names = set(VAL_NAME.findall(data.decode("utf-8", "replace")))
    if len(names) >= 10:
        flags.append(f"lists {len(names)} ImageNet validation file names")
    return flags


def calibration_refusals(folder: Path, files: list[Path]) -> list[str]:
    """engine.tuning.calibrate's folder check: `REL: flag` for every file of `folder` whose name, or
    (for a file that is not an image) whose content, looks like ImageNet validation data."""
    from engine.tuning.calibrate import IMAGE_SUFFIXES

    flags = []
    for p in files:
        rel = p.relative_to(folder).as_posix()
        flags += [f"{rel}: {f}" for f in name_flags(rel)]
        if p.suffix.lower() not in IMAGE_SUFFIXES:
            flags += [f"{rel}: {f}" for f in content_flags(p)]
    return flags
