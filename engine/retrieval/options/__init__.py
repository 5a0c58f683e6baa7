"""The retrieval options, one file each, in one table.

A method name is a base (engine.retrieval.compose: slerp, sum, text-only, pic2word) followed by
options, each `+name[:key=value...]`. Each option is one file of this folder holding one
`Option` subclass (engine/retrieval/options/base.py: its name, keys with their defaults, checks
and hooks) and one line of `OPTIONS` below. The table's order is the order the pipeline runs
their hooks in and the order a method's label lists them; nothing else names an option.

Adding one: a new file with its `Option` subclass, and its line here.
"""
from __future__ import annotations

from engine.retrieval.options.aqe import AlphaQE
from engine.retrieval.options.base import Key, Option, defines
from engine.retrieval.options.csls import CSLS
from engine.retrieval.options.dba import DBA
from engine.retrieval.options.dual_softmax import DualSoftmax
from engine.retrieval.options.gap import Gap
from engine.retrieval.options.gap_centre import GapCentre
from engine.retrieval.options.isoftmax import ISoftmax
from engine.retrieval.options.pic2word import Pic2WordMapping
from engine.retrieval.options.qbnorm import QBNorm
from engine.retrieval.options.reinspect import Reinspect

OPTIONS: dict[str, type[Option]] = {cls.name: cls for cls in (
    Gap,
    GapCentre,
    Pic2WordMapping,
    ISoftmax,
    QBNorm,
    DualSoftmax,
    CSLS,
    AlphaQE,
    DBA,
    Reinspect,
)}

__all__ = ["OPTIONS", "Key", "Option", "named", "implied", "trained", "extra_files", "record_defaults",
           "summaries"]


def named() -> dict[str, type[Option]]:
    """The options a method name may add after `+` (those no base implies)."""
    return {n: cls for n, cls in OPTIONS.items() if not cls.base}


def implied(base: str) -> list[Option]:
    """The options a base method brings with it (pic2word: its trained mapping)."""
    return [cls() for cls in OPTIONS.values() if cls.base == base]


def trained() -> tuple[str, ...]:
    """The options the build learns (the build's `--mapping` choices besides none)."""
    return tuple(n for n, cls in OPTIONS.items() if cls.trained)


def extra_files() -> tuple[str, ...]:
    """The index's optional data files, every option's (engine.retrieval.index)."""
    return tuple(f for cls in OPTIONS.values() for f in cls.extra_files)


def record_defaults() -> dict:
    """The flat method record's option fields with every option off (meta.json `method`)."""
    out: dict = {}
    for cls in OPTIONS.values():
        for field, value in cls.record_defaults.items():
            out.setdefault(field, value)
    return out


def summaries(space) -> dict:
    """The keys every run's summary holds for the options that report (named in the method or not)."""
    out: dict = {}
    for cls in OPTIONS.values():
        if defines(cls, "summary"):
            out.update(cls.summary(space))
    return out
