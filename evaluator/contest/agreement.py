"""Top-1 agreement of predictions with reference answers, and the contest gate.

    python -m evaluator.agreement --predictions P.i32 --reference R.i32|R.tsv [--manifest M]
        [--gate 0.99] [--expect-rows N] [--json]

The contest's rule: a run passes with at least ceil(0.99 N) exact top-1 matches over
the N manifest rows; a row without a reference answer is a miss. R is a reference: an
`.i32` (one little-endian int32 per row, a class in [0, 999] or -1 where the reference
could not read the image, as `python -m evaluator.reference` writes it) or a TSV of
`request_id<TAB>class` aligned through the manifest (a manifest row the TSV does not
name is a miss).

Which figure decides. The verdict (exit status) is the gate over the rows the reference
could read: ceil(0.99 J) matches over those J rows. A -1 row is an image no path can be
judged on (the kit's generated cohorts plant broken files on purpose); it is reported
apart, never refused. The second line gives the contest's gate over all N rows, with
those rows as misses. The contest's frozen reference answers every row, so there J = N
and the two figures are one. `--expect-rows N` also fails a cohort that is not N rows
(it counts manifest rows, never matches). Exit status: 0 PASS, 1 FAIL, 2 bad input.

`agreement()` is the same measure over answered rows as a record (matches, total,
unreadable), for the demo, the rehearsal and the sweep.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path

import numpy as np

from engine.cli import finite_float, whole_number

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


def read_i32(path: str | Path, n: int | None = None, check_range: bool = True, what: str = "predictions",
             expected: str = "") -> np.ndarray:
    """Little-endian int32 file; checks the length (when n is given: `PATH: 90 WHAT, expected
    100 EXPECTED`) and the [0, 999] range."""
    data = Path(path).read_bytes()
    if len(data) % 4:
        raise ValueError(f"{path}: {len(data)} bytes is not a whole number of int32")
    a = np.frombuffer(data, "<i4")
    if n is not None and len(a) != n:
        raise ValueError(f"{path}: {len(a)} {what}, expected {n}{' ' + expected if expected else ''}")
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


def read_reference(path: str | Path, manifest: str | Path | None, n: int | None) -> np.ndarray:
    """Reference answers as int32 [n] (-1 = no answer: an .i32 entry or a row the TSV does not name);
    n None: as many rows as an .i32 holds."""
    path = Path(path)
    if path.suffix != ".tsv":
        return read_i32(path, n, check_range=False, what="reference answers")
    if manifest is None:
        raise ValueError("a TSV reference needs --manifest to align request ids with rows")
    from evaluator.contest.manifest import read_manifest

    answers = read_tsv_answers(path)
    rows = read_manifest(manifest)
    if n is not None and len(rows) != n:
        raise ValueError(f"manifest has {len(rows)} rows, predictions have {n}")
    return np.array([answers.get(r.request_id, -1) for r in rows], np.int32)


def read_frozen_reference(path: str | Path, manifest: str | Path | None,
                          n: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(answers int32 [n], unreadable bool [n]) of a reference for the gate.

    -1 in an .i32 is a row the reference could not read (unreadable: left out of the
    verdict, reported apart); -1 from a TSV is a row it does not name (a miss). Any other
    value outside [0, 999] is refused."""
    path = Path(path)
    ref = read_reference(path, manifest, n)
    bad = np.flatnonzero((ref < -1) | (ref > 999))
    if len(bad):
        raise ValueError(f"{path}: class {int(ref[bad[0]])} at row {int(bad[0]) + 1} is outside [0, 999]")
    unreadable = (ref == -1) if path.suffix != ".tsv" else np.zeros(len(ref), bool)
    return ref, unreadable


@dataclass(frozen=True)
class Verdict:
    """The gate over the rows the reference could read (decides), and over every row (the contest's)."""

    judged: ContestGate     # rows the reference could read; TSV-unnamed rows are misses here too
    all_rows: ContestGate   # every row; unreadable rows are misses
    unreadable: int         # rows the reference could not read (-1 in an .i32)

    @property
    def passed(self) -> bool:
        return self.judged.passed

    def lines(self) -> list[str]:
        """The verdict line, plus the all-rows line when some rows were unreadable."""
        first = self.judged.line()
        if not self.unreadable:
            return [first]
        return [f"{first}; {self.unreadable} rows the reference could not read (-1) are left out",
                f"over all {self.all_rows.rows} rows (the contest's gate, unreadable rows as misses): "
                + self.all_rows.line()]


def judge(pred: np.ndarray, ref: np.ndarray, unreadable: np.ndarray, gate: float = GATE) -> Verdict:
    """The verdict of `pred` against `ref` (see the module docstring: which figure decides)."""
    if len(pred) != len(ref):
        raise ValueError(f"{len(pred)} predictions vs {len(ref)} reference answers")
    keep = ~unreadable
    return Verdict(contest_gate(pred[keep], ref[keep], gate), contest_gate(pred, ref, gate), int(unreadable.sum()))


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


_gate_value = finite_float(0.0, 1.0, lo_open=True)     # --gate: a fraction of the rows
_rows_value = whole_number(1, 10**9, "rows")            # --expect-rows


def main(argv: list[str] | None = None) -> int:
    from engine.cli import ArgumentParser, HelpFormatter, debug_flag, debugging

    p = debug_flag(ArgumentParser(prog="python -m evaluator.agreement", description=__doc__.split("\n\n")[0],
                                  formatter_class=HelpFormatter))
    p.add_argument("--predictions", required=True, type=Path, help="the run's OUTPUT: one int32 per manifest row")
    p.add_argument("--reference", required=True, type=Path,
                   help="reference: .i32 (-1 = could not read: left out, reported apart) or .tsv")
    p.add_argument("--manifest", type=Path, help="the cohort manifest (needed for a .tsv reference; default: none)")
    p.add_argument("--gate", type=_gate_value, default=GATE, help="fraction of rows that must match")
    p.add_argument("--expect-rows", type=_rows_value,
                   help="fail unless the cohort has exactly N rows (default: any number)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of lines")
    a = p.parse_args(argv)
    try:
        n = None
        if a.manifest is not None:
            from evaluator.contest.manifest import read_manifest

            n = len(read_manifest(a.manifest))
        # the row count comes from the manifest, else from the reference: each file is checked against it
        ref, unreadable = read_frozen_reference(a.reference, a.manifest, n)
        pred = read_i32(a.predictions, len(ref), expected="(one per row of the reference "
                        + (f"and the manifest {a.manifest})" if n is not None else f"{a.reference})"))
        res = judge(pred, ref, unreadable, a.gate)
    except (OSError, ValueError) as e:
        if debugging(a.debug):
            raise
        print(f"agreement: error: {e}", file=sys.stderr)
        return 2
    rows = res.all_rows.rows              # manifest rows, whatever matched
    rows_ok = a.expect_rows is None or rows == a.expect_rows
    passed = res.passed and rows_ok
    g = res.judged
    if a.json:
        print(json.dumps({**asdict(g), "threshold": g.threshold, "rate": g.rate, "unreadable": res.unreadable,
                          "all_rows": {**asdict(res.all_rows), "threshold": res.all_rows.threshold,
                                       "passed": res.all_rows.passed},
                          "expect_rows": a.expect_rows, "verdict": "PASS" if passed else "FAIL"}))
    else:
        print("\n".join(res.lines()))
        if not rows_ok:
            print(f"FAIL: the cohort has {rows} rows, expected {a.expect_rows} (--expect-rows)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
