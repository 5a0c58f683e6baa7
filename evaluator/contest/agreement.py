"""Top-1 agreement of predictions with reference answers, and the contest gate.

    python -m evaluator.agreement --predictions P.i32 --reference R.i32|R.tsv [--manifest M]
        [--gate 0.99] [--expect-rows N] [--json]

The contest's rule: a run passes with at least ceil(0.99 N) exact top-1 matches over
the N manifest rows; a row without a reference answer is a miss. R is a frozen
reference: an `.i32` (one little-endian int32 in [0, 999] per row; a -1 "no answer"
entry is refused, since a frozen reference answers every row) or a TSV of
`request_id<TAB>class` aligned through the manifest (a manifest row the TSV does not
name is a miss). `--expect-rows N` also fails a cohort that is not N rows.
Exit status: 0 PASS, 1 FAIL, 2 bad input.

`agreement()` is the other measure the kit uses: agreement over the rows the reference
answers, for comparing a fast path with the kit's own reference path on generated
cohorts, whose deliberately broken files that path cannot read (-1). It is not the
contest gate.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path

import numpy as np

GATE = 0.99


@dataclass(frozen=True)
class Agreement:
    """Agreement over the rows with a reference answer (fast path vs the kit's reference)."""

    matches: int
    total: int          # rows with a reference answer
    unreadable: int     # rows the reference could not read (-1), left out
    gate: float

    @property
    def rate(self) -> float:
        return self.matches / self.total if self.total else 0.0

    @property
    def passed(self) -> bool:
        return self.total > 0 and self.rate >= self.gate


def threshold(rows: int, gate: float = GATE) -> int:
    """Matches needed to pass: ceil(gate * rows), in decimal arithmetic (0.99 * 10000 = 9900 exactly)."""
    return math.ceil(Decimal(repr(gate)) * rows)


@dataclass(frozen=True)
class ContestGate:
    """The contest gate over every manifest row: a row without a reference answer is a miss."""

    matches: int
    rows: int           # manifest rows: the denominator
    unanswered: int     # rows without a reference answer (each one a miss)
    gate: float

    @property
    def threshold(self) -> int:
        return threshold(self.rows, self.gate)

    @property
    def rate(self) -> float:
        return self.matches / self.rows if self.rows else 0.0

    @property
    def passed(self) -> bool:
        return self.rows > 0 and self.matches >= self.threshold  # a gate that saw no row fails

    def line(self) -> str:
        """`matches/rows (pct) PASS|FAIL at the G % gate (threshold T of N rows)`, plus the misses."""
        verdict = "PASS" if self.passed else "FAIL"
        text = (f"{self.matches}/{self.rows} ({100 * self.rate:.2f} %) {verdict} at the {100 * self.gate:g} % gate "
                f"(threshold {self.threshold} of {self.rows} rows)")
        if self.unanswered:
            text += f"; {self.unanswered} rows without a reference answer count as misses"
        return text


def read_i32(path: str | Path, n: int | None = None, check_range: bool = True) -> np.ndarray:
    """Little-endian int32 file; checks the length (when n is given) and the [0, 999] range."""
    data = Path(path).read_bytes()
    if len(data) % 4:
        raise ValueError(f"{path}: {len(data)} bytes is not a whole number of int32")
    a = np.frombuffer(data, "<i4")
    if n is not None and len(a) != n:
        raise ValueError(f"{path}: {len(a)} predictions, expected {n}")
    if check_range and len(a) and (a.min() < 0 or a.max() > 999):
        bad = int(np.flatnonzero((a < 0) | (a > 999))[0])
        raise ValueError(f"{path}: value {a[bad]} at row {bad + 1} is outside [0, 999]")
    return a


def read_tsv_answers(path: str | Path) -> dict[str, int]:
    """{request_id: class in [0, 999]} of a `request_id<TAB>class` file (extra columns ignored, blank
    lines skipped; a request answered twice with different classes is refused)."""
    path = Path(path)
    answers: dict[str, int] = {}
    for no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rid, cls = line.rstrip("\r").split("\t")[:2]
            value = int(cls)
        except ValueError as e:
            raise ValueError(f"{path}:{no}: expected request_id<TAB>class") from e
        if not 0 <= value <= 999:
            raise ValueError(f"{path}:{no}: class {value} is outside [0, 999]")
        if rid in answers and answers[rid] != value:
            raise ValueError(f"{path}:{no}: request {rid} answered twice ({answers[rid]} and {value})")
        answers[rid] = value
    return answers


def read_reference(path: str | Path, manifest: str | Path | None, n: int) -> np.ndarray:
    """Reference answers as int32 [n] (-1 = no answer: an .i32 entry or a row the TSV does not name)."""
    path = Path(path)
    if path.suffix != ".tsv":
        return read_i32(path, n, check_range=False)
    if manifest is None:
        raise ValueError("a TSV reference needs --manifest to align request ids with rows")
    from evaluator.contest.manifest import read_manifest

    answers = read_tsv_answers(path)
    rows = read_manifest(manifest)
    if len(rows) != n:
        raise ValueError(f"manifest has {len(rows)} rows, predictions have {n}")
    return np.array([answers.get(r.request_id, -1) for r in rows], np.int32)


def read_frozen_reference(path: str | Path, manifest: str | Path | None, n: int) -> np.ndarray:
    """A frozen reference for the contest gate: -1 only where a TSV names no answer for a row.

    An .i32 must answer every row with a class in [0, 999]."""
    path = Path(path)
    ref = read_reference(path, manifest, n)
    bad = np.flatnonzero((ref < -1) | (ref > 999) | ((ref == -1) & (path.suffix != ".tsv")))
    if len(bad):
        row, value = int(bad[0]) + 1, int(ref[bad[0]])
        if value == -1:
            raise ValueError(f"{path}: row {row} holds -1 (no answer; {int((ref == -1).sum())} such rows): a frozen "
                             "reference answers every row")
        raise ValueError(f"{path}: class {value} at row {row} is outside [0, 999]")
    return ref


def agreement(pred: np.ndarray, ref: np.ndarray, gate: float = GATE) -> Agreement:
    """Exact top-1 matches on the rows that have a reference answer (not the contest gate)."""
    if len(pred) != len(ref):
        raise ValueError(f"{len(pred)} predictions vs {len(ref)} reference answers")
    has = ref >= 0
    return Agreement(int((pred[has] == ref[has]).sum()), int(has.sum()), int((~has).sum()), gate)


def contest_gate(pred: np.ndarray, ref: np.ndarray, gate: float = GATE) -> ContestGate:
    """Exact top-1 matches over every row; a row whose reference is -1 (no answer) is a miss."""
    if len(pred) != len(ref):
        raise ValueError(f"{len(pred)} predictions vs {len(ref)} reference answers")
    has = ref >= 0
    return ContestGate(int((pred[has] == ref[has]).sum()), int(len(ref)), int((~has).sum()), gate)


def _gate_value(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {text}")
    return value


def _rows_value(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    from engine.cli import ArgumentParser

    p = ArgumentParser(prog="python -m evaluator.agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("--predictions", required=True, type=Path)
    p.add_argument("--reference", required=True, type=Path, help="frozen reference: .i32 (every row) or .tsv")
    p.add_argument("--manifest", type=Path, help="the cohort manifest (needed for a .tsv reference)")
    p.add_argument("--gate", type=_gate_value, default=GATE, help="fraction of rows that must match (0.99)")
    p.add_argument("--expect-rows", type=_rows_value, help="fail unless the cohort has exactly N rows")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        n = None
        if a.manifest is not None:
            from evaluator.contest.manifest import read_manifest

            n = len(read_manifest(a.manifest))
        pred = read_i32(a.predictions, n)
        res = contest_gate(pred, read_frozen_reference(a.reference, a.manifest, len(pred)), a.gate)
    except (OSError, ValueError) as e:
        print(f"agreement: error: {e}", file=sys.stderr)
        return 2
    rows_ok = a.expect_rows is None or res.rows == a.expect_rows
    passed = res.passed and rows_ok
    if a.json:
        print(json.dumps({**asdict(res), "threshold": res.threshold, "rate": res.rate,
                          "expect_rows": a.expect_rows, "verdict": "PASS" if passed else "FAIL"}))
    else:
        print(res.line())
        if not rows_ok:
            print(f"FAIL: the cohort has {res.rows} rows, expected {a.expect_rows} (--expect-rows)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
