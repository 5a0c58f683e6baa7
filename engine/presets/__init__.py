"""The engine's tables of defaults, one layer above the root's plumbing (every job reads them; they
import nothing of the engine but engine.cli, for their command):

    classification.py   the classification build's table, one column per device (`Preset`, `PRESETS`,
                        `preset(device)`), re-exported here: `from engine.presets import preset`
    retrieval.py        the retrieval engine's and the CLIP towers' table (`RETRIEVAL`)

`python -m engine.presets` prints both, as docs/classification.md and docs/retrieval.md show them.

Every choice a module makes with a number is a field of one of them; a module constant reads its
field (`PRUNE = shared("search_prune")`: `shared` is a field every device's preset holds alike). A
number written elsewhere as a module constant is a fact, not a choice: a unit (BASIS_POINTS, basis
points in a rate of 1), a format or protocol (exit statuses, prctl's numbers, the wire length that
marks a missing blob), a model's own values (CLIP's mean and std, float8's largest value), a limit
against hostile input or a sanity bound on an option's range, or a task's stated rule (the 99 %
gate, the top-50 results): tests/test_presets.py lists each with its reason and fails on a new one.
"""
from __future__ import annotations

from engine.presets.classification import PRESETS, Preset, markdown, per_device, preset, shared

__all__ = ["PRESETS", "Preset", "markdown", "per_device", "preset", "shared", "tables"]


def tables() -> str:
    """Both engines' tables, as the docs show them: the classification build's (docs/classification.md),
    a blank line, the retrieval engine's (docs/retrieval.md)."""
    from engine.presets import retrieval

    return markdown() + "\n\n" + retrieval.markdown()
