"""Agreement of predictions with reference answers, at the contest gate (99 %).

    python -m evaluator.agreement --predictions P.i32 --reference R [--manifest M] [--gate 0.99] [--json]

R is another `.i32` (one int32 per row; -1 marks an image the reference could not
read, left out of the count) or a TSV of `request_id<TAB>class` aligned through the
manifest. Exit status: 0 PASS, 1 FAIL, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

GATE = 0.99


@dataclass(frozen=True)
class Agreement:
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


def read_reference(path: str | Path, manifest: str | Path | None, n: int) -> np.ndarray:
    """Reference answers as int32 [n] (-1 = no answer)."""
    path = Path(path)
    if path.suffix != ".tsv":
        return read_i32(path, n, check_range=False)
    if manifest is None:
        raise ValueError("a TSV reference needs --manifest to align request ids with rows")
    from evaluator.contest.manifest import read_manifest

    answers = {}
    for no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rid, cls = line.rstrip("\r").split("\t")[:2]
            answers[rid] = int(cls)
        except ValueError as e:
            raise ValueError(f"{path}:{no}: expected request_id<TAB>class") from e
    rows = read_manifest(manifest)
    if len(rows) != n:
        raise ValueError(f"manifest has {len(rows)} rows, predictions have {n}")
    return np.array([answers.get(r.request_id, -1) for r in rows], np.int32)


def agreement(pred: np.ndarray, ref: np.ndarray, gate: float = GATE) -> Agreement:
    """Exact top-1 matches on the rows that have a reference answer."""
    if len(pred) != len(ref):
        raise ValueError(f"{len(pred)} predictions vs {len(ref)} reference answers")
    has = ref >= 0
    return Agreement(int((pred[has] == ref[has]).sum()), int(has.sum()), int((~has).sum()), gate)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluator.agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("--predictions", required=True, type=Path)
    p.add_argument("--reference", required=True, type=Path)
    p.add_argument("--manifest", type=Path)
    p.add_argument("--gate", type=float, default=GATE)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        n = None
        if a.manifest is not None:
            from evaluator.contest.manifest import read_manifest

            n = len(read_manifest(a.manifest))
        pred = read_i32(a.predictions, n)
        res = agreement(pred, read_reference(a.reference, a.manifest, len(pred)), a.gate)
    except (OSError, ValueError) as e:
        print(f"agreement: error: {e}", file=sys.stderr)
        return 2
    verdict = "PASS" if res.passed else "FAIL"
    if a.json:
        print(json.dumps({**asdict(res), "rate": res.rate, "verdict": verdict}))
    else:
        print(f"{res.matches}/{res.total} ({100 * res.rate:.2f} %) {verdict} at the {100 * res.gate:g} % gate"
              + (f"; {res.unreadable} rows without a reference answer" if res.unreadable else ""))
    return 0 if res.passed else 1


if __name__ == "__main__":
    sys.exit(main())
