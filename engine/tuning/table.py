"""The search's table as the build prints it: a legend once (every column and status), then one
line per candidate with every timing of its compiled graph, the choice marked, the skipped
precisions and dropped backends last."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from engine.tuning.retime import RETIME, TIE


class Rows(Protocol):
    """What the table reads of a search's result (engine.tuning.autotune.SearchResult, which imports
    this module: the table names the shape it needs instead of importing it back)."""
    trials: Sequence[Any]           # autotune.Trial: candidate, status, why, timings, the rates, agreement, tau
    skipped: dict[str, str]
    dropped: dict[str, str]

# what each column and status means, printed once above the rows (docs/classification.md says the same)
COLUMNS = {
    "candidate": "backend/precision/b<static batch>, +graphs: replayed from a CUDA graph, +max-autotune: Inductor's "
                 "GEMM autotuning at compile time",
    "screen": "images/s of the eager network, which only orders the compiles",
    "graph": "images/s of the compiled graph, the median of the timings listed",
    "eff.": "graph with the guard's re-check cost (below FP32: near-ties re-run in FP32); the choice is the fastest here",
    "agree": "guarded top-1 agreement with the FP32 graph on the calibration images",
    "tau": "the guard's margin threshold (below FP32)",
}
STATUSES = {
    "chosen": "the build's choice",
    "holds": "holds the disagreement budget, not the fastest",
    "slower": "slower on the graph than the leader (agreement then not measured)",
    "rejected": "breaks the disagreement budget",
    "failed": "its build or its run failed (the reason follows)",
    "not compiled": "could not win in the time or disk left, or its backend was dropped",
    "not screened": "its screen did not fit the time left (nor a compile then)",
    "skipped": "a precision not measured (not native here)",
    "dropped": "a backend that cannot build here",
}
LEGEND = "\n".join([
    "columns (- = not measured):", *(f"  {k:13} {v}" for k, v in COLUMNS.items()),
    "status:", *(f"  {k:13} {v}" for k, v in STATUSES.items()),
    f"medians within {TIE:.0%} plus their spread are a tie (the simpler wins); within {RETIME:.0%} of the leader a "
    "candidate is retimed interleaved with it; timings: every images/s timing of the graph"])


def format_table(result: Rows, chosen: str | None) -> str:
    """The short table the build prints: a legend, one line per candidate (every timing), the choice marked."""
    lines = [LEGEND, f"{'candidate':34} {'screen':>8} {'graph':>8} {'eff.':>8} {'agree':>7} {'tau':>7}  status"]
    for t in result.trials:
        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"
        mark = "chosen" if t.candidate.name == chosen else t.status
        timings = f"  timings: [{', '.join(f'{x:.1f}' for x in t.timings)}]" if t.timings else ""
        lines.append(f"{t.candidate.name:34} {f(t.screened_images_per_s, '8.1f')} {f(t.images_per_s, '8.1f')} "
                     f"{f(t.effective_images_per_s, '8.1f')} {f(t.agreement, '7.4f')} {f(t.tau, '7.4f')}  "
                     f"{mark}{(': ' + t.why) if t.why and mark != 'chosen' else ''}{timings}")
    for k, why in result.skipped.items():
        lines.append(f"{k:34} {'':>8} {'':>8} {'':>8} {'':>7} {'':>7}  skipped: {why}")
    for be, why in result.dropped.items():
        lines.append(f"{'backend ' + be:34} {'':>8} {'':>8} {'':>8} {'':>7} {'':>7}  dropped: {why}")
    return "\n".join(lines)
