"""Score composed-image-retrieval runs as the task's verifier does: row validity, CIRCO mAP@k,
CIRR Recall@k, raw quality, reward.

    python -m evaluator.score_retrieval --results RUN.jsonl --labels L1 [--labels L2 ...]
        [--queries REQUESTS.jsonl] [--out R.json]

Producing answers and scoring them are separate tools: this module only reads files.

Rows (the task's rules): every line of the results file is parsed on its own. A row is
valid when it is a JSON object with a query_id and a `results` list of at most 50
{image_id, score} objects, the ids distinct, every score a finite number, the scores
non-increasing, and (with --queries) the request's reference image absent. Anything
else is an invalid row: a line that does not parse (a torn last line, what a timeout
leaves, included), a results list of the wrong shape, a non-finite score, a repeated
id, more than 50 results, a rising score, the reference image, or a second row for a
query (the first row of a query decides it; later ones are invalid). Invalid and
missing rows score zero; every valid row counts. The report counts invalid rows by
kind and names the first few (line, query, reason).

Metrics (fractions internally; the report prints fractions and percent, both labelled):
- CIRCO, official miccunifi/CIRCO `src/evaluation.py`: AP@k = (sum over ranks i <= k that
  hold a positive of precision@i) / min(k, #positives); mAP@k = mean over queries, for
  k in 5/10/25/50.
- CIRR, official Cuberick-Orion/CIRR: Recall@k = 1 if `target_hard` is in the top k, for
  k in 1/5/10/50. The run already excludes the reference image; nothing is removed here.
- raw = (mean of the four CIRCO mAPs + mean of the four CIRR recalls) / 2, the two sources
  weighted equally. With labels of one source only, raw = that source's mean (the report
  says so in `raw_note`).
- reward: the task's piecewise-linear map with reference quality b = 0.26812065144613684
  and score anchor a = 20 (on the 0-100 scale): (a/100) q / b for 0 <= q <= b, and
  a/100 + (1 - a/100)(q - b)/(1 - b) for b < q <= 1, so q = 0, b, 1 map to 0, 0.2, 1.

Choices:
- Ids are compared as strings (CIRCO ids are ints, CIRR ids strings): str() everywhere.
- Rank = position in the row's `results` list.
- A labelled query without any row is `missing`, one whose first row is invalid is
  `invalid`; both score zero. A valid row without a label is counted in `unlabeled`.
- The CLI exits 0 whenever it could score; 2 (one `score_retrieval: error:` line) only
  when the labels, the requests or the results file cannot be read at all.
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.retrieval.jsonl import REFERENCE_KEYS, is_id, read_requests
from evaluator.cir.task import TOP_K

CIRCO_KS = (5, 10, 25, 50)
CIRR_KS = (1, 5, 10, 50)
SOURCES = ("circo", "cirr")
REWARD_B = 0.26812065144613684  # reference quality
REWARD_A = 20.0                 # score anchor on the 0-100 scale: reward(b) = a / 100
EXAMPLES = 10                   # invalid rows named in the report

# Invalid-row kinds, in the order a row is checked.
INVALID_KINDS = {
    "torn_last_line": "the last line has no newline and does not parse (what a timeout leaves)",
    "malformed_json": "the line is not valid UTF-8 JSON",
    "not_an_object": "the line is JSON but not an object",
    "bad_query_id": "no usable query_id",
    "duplicate_query": "a later row for a query that already has one (the first row decides)",
    "bad_results": "`results` is not a list of {image_id, score} objects",
    "non_finite_score": "a score is NaN or infinite",
    "too_many_results": f"more than {TOP_K} results",
    "duplicate_ids": "an image id appears more than once",
    "rising_scores": "scores are not in non-increasing order",
    "reference_image": "the request's reference image is among the results",
}


class InputError(ValueError):
    """A labels or requests file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Label:
    """Ground truth of one query: its benchmark and its positive image ids (as str)."""

    source: str  # "circo" | "cirr"
    positives: tuple[str, ...]  # CIRCO: gt_img_ids; CIRR: (target_hard,)


@dataclass(frozen=True)
class InvalidRow:
    """One results line that scores zero, and why."""

    line: int
    query_id: str | None  # None when the line names no usable query
    kind: str  # a key of INVALID_KINDS
    reason: str


@dataclass
class ResultsFile:
    """A results file as the verifier reads it: the rankings that count and the rows that do not."""

    path: Path
    rankings: dict[str, list[str]]  # query_id -> image ids in rank order (first valid row of each query)
    invalid: list[InvalidRow] = field(default_factory=list)
    invalid_queries: dict[str, str] = field(default_factory=dict)  # query_id -> kind of its deciding row
    rows: int = 0  # non-blank lines read
    reference_check: str = "skipped: no --queries file gives the reference image ids"


# ---------------------------------------------------------------- metrics (pure)


def average_precision_at_k(ranking: Sequence, positives: Collection, k: int) -> float:
    """CIRCO AP@k of one ranked list: sum of precision@i at each hit in the top k,
    divided by min(k, number of distinct positives). Duplicates in `ranking` count
    at every position, as in the official script (the row check refuses them first)."""
    pos = {str(p) for p in positives}
    if not pos:
        raise ValueError("average_precision_at_k needs at least one positive")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    hits = 0
    total = 0.0
    for rank, image_id in enumerate(ranking[:k], start=1):
        if str(image_id) in pos:
            hits += 1
            total += hits / rank  # precision at this hit
    return total / min(k, len(pos))


def recall_at_k(ranking: Sequence, positives: Collection, k: int) -> float:
    """Recall@k as CIRR defines it: 1.0 if any positive (the target_hard) is in the top k."""
    pos = {str(p) for p in positives}
    if not pos:
        raise ValueError("recall_at_k needs at least one positive")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return 1.0 if any(str(i) in pos for i in ranking[:k]) else 0.0


def reward(raw: float, b: float = REWARD_B, a: float = REWARD_A) -> float:
    """The task's reward of raw quality q in [0, 1]: (a/100) q / b up to b, then linear to 1 at q = 1."""
    if not math.isfinite(raw) or raw < 0.0 or raw > 1.0 + 1e-12:
        raise ValueError(f"raw quality must lie in [0, 1], got {raw}")
    anchor = a / 100.0  # reward at q = b
    if raw <= b:
        return anchor * raw / b
    return min(1.0, anchor + (1.0 - anchor) * (raw - b) / (1.0 - b))


def reward_formula(b: float = REWARD_B, a: float = REWARD_A) -> str:
    """The reward map written out, for reports."""
    return (f"piecewise linear: reward = ({a:g}/100)*q/b for 0 <= q <= b; "
            f"{a:g}/100 + (1-{a:g}/100)*(q-b)/(1-b) for b < q <= 1; b = {b!r}, a = {a:g} "
            f"(q = 0, b, 1 -> 0, {a / 100:g}, 1)")


def reward_rule(b: float = REWARD_B, a: float = REWARD_A) -> dict:
    """The reward map as data: its name, parameters and formula."""
    return {"name": "piecewise-linear", "b": b, "a": a, "formula": reward_formula(b, a)}


# ---------------------------------------------------------------- row validity (pure)


def _is_score(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_results(items, reference: str | None = None, k: int = TOP_K) -> tuple[str, str] | None:
    """(kind, reason) when a row's `results` value breaks the task's rules, else None.

    `reference` is the request's reference image id (as str), None to skip that check."""
    if not isinstance(items, list):
        return "bad_results", f"'results' is a {type(items).__name__}, not a list"
    ids, scores = [], []
    for rank, item in enumerate(items, 1):
        if not isinstance(item, dict) or not is_id(item.get("image_id")):
            return "bad_results", f"result {rank} has no valid image_id"
        s = item.get("score")
        if not _is_score(s):
            return "bad_results", f"score {s!r} at rank {rank} is not a number"
        if not math.isfinite(s):
            return "non_finite_score", f"score {s!r} at rank {rank} is not finite"
        ids.append(str(item["image_id"]))
        scores.append(s)
    if len(ids) > k:
        return "too_many_results", f"{len(ids)} results (at most {k})"
    seen: dict[str, int] = {}
    for rank, i in enumerate(ids, 1):
        if i in seen:
            return "duplicate_ids", f"image id {i!r} appears more than once (ranks {seen[i]} and {rank})"
        seen[i] = rank
    for rank in range(1, len(scores)):
        if scores[rank] > scores[rank - 1]:
            return "rising_scores", f"scores increase at rank {rank + 1} ({scores[rank - 1]!r} -> {scores[rank]!r})"
    if reference is not None and reference in seen:
        return "reference_image", f"the reference image {reference!r} is in its results (rank {seen[reference]})"
    return None


def _ranking_problem(ranking: Sequence[str], k: int = TOP_K) -> tuple[str, str] | None:
    """The id-only rules, for rankings given without scores (score() on a plain mapping)."""
    if len(ranking) > k:
        return "too_many_results", f"{len(ranking)} results (at most {k})"
    if len(set(ranking)) != len(ranking):
        return "duplicate_ids", "an image id appears more than once"
    return None


# ---------------------------------------------------------------- scoring


def _metric_names(source: str) -> list[str]:
    return [f"mAP@{k}" for k in CIRCO_KS] if source == "circo" else [f"R@{k}" for k in CIRR_KS]


def _query_metrics(source: str, ranking: Sequence[str], positives: Collection[str]) -> list[float]:
    if source == "circo":
        return [average_precision_at_k(ranking, positives, k) for k in CIRCO_KS]
    return [recall_at_k(ranking, positives, k) for k in CIRR_KS]


def score(results: Mapping[str, Sequence], labels: Mapping[str, Label],
          invalid: Mapping[str, str] | None = None) -> dict:
    """Score rankings {query_id: [image_id, ...]} against labels {query_id: Label}.

    `invalid` maps query ids whose deciding row was invalid to its kind: they score zero.
    A ranking that breaks the id-only rules (more than 50, a repeated id) scores zero too.
    Returns the report dict: per source the query count, `answered`, `missing`, `invalid`,
    metrics as fractions and percent and their mean; then `raw`, `reward` and the counts.
    """
    if not labels:
        raise ValueError("no labels to score against")
    results = {str(q): [str(i) for i in r] for q, r in results.items()}
    invalid = {str(q): kind for q, kind in (invalid or {}).items()}
    sums: dict[str, list[float]] = {}
    counts: dict[str, dict[str, int]] = {}
    for qid, label in labels.items():
        if label.source not in SOURCES:
            raise ValueError(f"query {qid}: unknown source {label.source!r}")
        n_metrics = len(CIRCO_KS) if label.source == "circo" else len(CIRR_KS)
        acc = sums.setdefault(label.source, [0.0] * n_metrics)
        cnt = counts.setdefault(label.source, {"queries": 0, "answered": 0, "missing": 0, "invalid": 0})
        cnt["queries"] += 1
        ranking = results.get(str(qid))
        problem = _ranking_problem(ranking) if ranking is not None else None
        if problem:
            ranking = None
            invalid.setdefault(str(qid), problem[0])
        if ranking is None:
            cnt["invalid" if str(qid) in invalid else "missing"] += 1  # scores zero on every metric
            continue
        cnt["answered"] += 1
        for j, value in enumerate(_query_metrics(label.source, ranking, label.positives)):
            acc[j] += value

    report: dict = {"sources": {}}
    means: dict[str, float] = {}
    for source in SOURCES:
        if source not in sums:
            continue
        n = counts[source]["queries"]
        fractions = {name: s / n for name, s in zip(_metric_names(source), sums[source], strict=True)}
        means[source] = sum(fractions.values()) / len(fractions)
        report["sources"][source] = {
            **counts[source],
            "fraction": fractions,
            "percent": {name: 100.0 * v for name, v in fractions.items()},
            "mean_fraction": means[source],
            "mean_percent": 100.0 * means[source],
        }

    raw = sum(means.values()) / len(means)  # equal weight per source, not per query
    if len(means) == 2:
        note = "equal-weight mean of CIRCO mean mAP@5/10/25/50 and CIRR mean R@1/5/10/50"
    else:
        (only,) = means
        what = "mAP@5/10/25/50" if only == "circo" else "R@1/5/10/50"
        note = f"only {only} labels given: raw = {only} mean {what}"
    labelled = {str(q) for q in labels}
    report.update(
        raw=raw,
        raw_sources=sorted(means),
        raw_note=note,
        reward=reward(raw),
        reward_mapping=reward_formula(),
        reward_rule=reward_rule(),
        queries=len(labels),
        answered=sum(c["answered"] for c in counts.values()),
        missing=sum(c["missing"] for c in counts.values()),
        invalid=sum(c["invalid"] for c in counts.values()),
        unlabeled=sum(1 for q in results if q not in labelled),
    )
    return report


def score_file(results: ResultsFile, labels: Mapping[str, Label]) -> dict:
    """score() of a results file read by read_results, with its row-validity section."""
    report = score(results.rankings, labels, results.invalid_queries)
    by_kind = Counter(r.kind for r in results.invalid)
    report["validity"] = {
        "rows_read": results.rows,
        "valid_rows": results.rows - len(results.invalid),
        "invalid_rows": len(results.invalid),
        "invalid_by_kind": {k: by_kind[k] for k in INVALID_KINDS if by_kind[k]},
        "invalid_examples": [vars(r) for r in results.invalid[:EXAMPLES]],
        "reference_check": results.reference_check,
        "rules": "invalid and missing rows score zero; every valid row counts; the first row of a query decides it",
    }
    return report


# ---------------------------------------------------------------- results and requests


def _row(no: int, raw: bytes, torn: bool, seen: set[str],
         references: Mapping[str, str | None] | None) -> tuple[str | None, list[str] | None, InvalidRow | None]:
    """(query_id, ranking, None) for a valid line, else (query_id or None, None, why)."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        kind = "torn_last_line" if torn else "malformed_json"
        what = f"not valid UTF-8 (byte {e.start})" if isinstance(e, UnicodeDecodeError) else getattr(e, "msg", str(e))
        return None, None, InvalidRow(no, None, kind, f"malformed JSON ({what})")
    if not isinstance(obj, dict):
        return None, None, InvalidRow(no, None, "not_an_object", f"a JSON {type(obj).__name__}, not an object")
    qid = obj.get("query_id")
    if not is_id(qid):
        return None, None, InvalidRow(no, None, "bad_query_id", "missing or invalid query_id")
    qid = str(qid)
    if qid in seen:
        return qid, None, InvalidRow(no, qid, "duplicate_query", f"a second row for query {qid!r}; the first counts")
    seen.add(qid)
    reference = references.get(qid) if references is not None else None
    problem = check_results(obj.get("results"), reference)
    if problem:
        return qid, None, InvalidRow(no, qid, *problem)
    return qid, [str(item["image_id"]) for item in obj["results"]], None


def read_results(path: str | Path, references: Mapping[str, str | None] | None = None) -> ResultsFile:
    """Read a run's JSONL output line by line; invalid lines are recorded, never raised.

    `references` maps query_id -> its reference image id (from the requests file);
    None skips the reference check. OSError when the file cannot be read at all."""
    path = Path(path)
    data = path.read_bytes()
    out = ResultsFile(path, {})
    if references is not None:
        out.reference_check = f"checked against the reference image ids of {len(references)} requests"
    pieces = data.split(b"\n")
    seen: set[str] = set()
    for no, raw in enumerate(pieces, start=1):
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue
        out.rows += 1
        torn = no == len(pieces)  # the last piece: the file does not end in a newline
        qid, ranking, bad = _row(no, raw, torn, seen, references)
        if bad is not None:
            out.invalid.append(bad)
            if qid is not None and bad.kind != "duplicate_query":
                out.invalid_queries[qid] = bad.kind
            continue
        out.rankings[qid] = ranking
    return out


def load_results(path: str | Path, references: Mapping[str, str | None] | None = None) -> dict[str, list[str]]:
    """The rankings that count, {query_id: [image_id, ...]} (ids as str, rank order): the first
    row of each query when it is valid. Invalid rows are dropped (read_results names them)."""
    return read_results(path, references).rankings


def load_references(path: str | Path) -> dict[str, str | None]:
    """query_id -> reference image id (str, None when absent) of a requests file: JSONL
    requests (the ABI's input) or an official CIRCO / CIRR annotation JSON list."""
    path = Path(path)
    text = path.read_text(encoding="utf-8", errors="replace")
    if text.lstrip().startswith("["):
        try:
            entries = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{e.lineno}: malformed JSON ({e.msg})") from None
        out = {}
        for n, entry in enumerate(entries):
            qid = entry.get("id", entry.get("pairid")) if isinstance(entry, dict) else None
            if not is_id(qid):
                raise InputError(f"{path}: entry {n}: no id / pairid")
            ref = next((entry[k] for k in REFERENCE_KEYS if k in entry), None)
            out[str(qid)] = str(ref) if is_id(ref) else None
        return out
    requests = read_requests(path, lambda msg: None)  # lines the run skips carry no reference either
    if not requests:
        raise InputError(f"{path}: no usable requests")
    return {str(r.query_id): r.reference for r in requests}


# ---------------------------------------------------------------- labels


def _jsonl_objects(path: Path) -> Iterable[tuple[int, dict]]:
    """Yield (line number, object) for each non-blank line of a labels JSONL file."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise InputError(f"{path}:{lineno}: expected a JSON object")
            yield lineno, obj


def _dedupe(ids: Iterable) -> tuple[str, ...]:
    return tuple(dict.fromkeys(str(i) for i in ids))


def _label_from_official(entry, where: str) -> tuple[str, Label]:
    """One entry of CIRCO val.json or CIRR cap.rc2.val.json -> (query_id, Label)."""
    if not isinstance(entry, dict):
        raise InputError(f"{where}: expected a JSON object")
    if "pairid" in entry:  # CIRR captions file
        if not is_id(entry["pairid"]):
            raise InputError(f"{where}: invalid pairid")
        if not is_id(entry.get("target_hard")):
            raise InputError(f"{where}: CIRR entry without target_hard (test split has no public labels)")
        return str(entry["pairid"]), Label("cirr", (str(entry["target_hard"]),))
    if "reference_img_id" in entry or "gt_img_ids" in entry:  # CIRCO annotations
        if not is_id(entry.get("id")):
            raise InputError(f"{where}: CIRCO entry without a valid id")
        gts = entry.get("gt_img_ids")
        if not isinstance(gts, list) or not gts or not all(is_id(g) for g in gts):
            raise InputError(f"{where}: CIRCO entry without gt_img_ids (test split has no public labels)")
        return str(entry["id"]), Label("circo", _dedupe(gts))
    if "query_id" in entry:
        return _label_from_row(entry, where)
    raise InputError(f"{where}: not a CIRCO, CIRR or {{query_id, source, positives}} entry")


def _label_from_row(row: dict, where: str) -> tuple[str, Label]:
    """One JSONL label row {query_id, source, positives} -> (query_id, Label)."""
    qid = row.get("query_id")
    if not is_id(qid):
        raise InputError(f"{where}: missing or invalid query_id")
    source = row.get("source")
    if source not in SOURCES:
        raise InputError(f"{where}: source must be one of {SOURCES}, got {source!r}")
    positives = row.get("positives")
    if not isinstance(positives, list) or not positives or not all(is_id(p) for p in positives):
        raise InputError(f"{where}: 'positives' must be a non-empty list of ids")
    return str(qid), Label(source, _dedupe(positives))


def load_labels(path: str | Path) -> dict[str, Label]:
    """Read labels, detecting the format from content: a JSON list (CIRCO val.json or
    CIRR cap.rc2.val.json entries) or JSONL rows {query_id, source, positives}."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    pairs: list[tuple[str, Label, str]] = []
    if text.lstrip().startswith("["):  # official annotation files are one JSON list
        try:
            entries = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{e.lineno}: malformed JSON ({e.msg})") from None
        for n, entry in enumerate(entries):
            where = f"{path}: entry {n}"
            pairs.append((*_label_from_official(entry, where), where))
    else:
        for lineno, row in _jsonl_objects(path):
            where = f"{path}:{lineno}"
            pairs.append((*_label_from_row(row, where), where))
    if not pairs:
        raise InputError(f"{path}: no labels")
    out: dict[str, Label] = {}
    for qid, label, where in pairs:
        if qid in out:
            raise InputError(f"{where}: duplicate query_id {qid}")
        out[qid] = label
    return out


def load_label_files(paths: Iterable[str | Path]) -> dict[str, Label]:
    """Merge several label files; a query id defined twice is an error."""
    merged: dict[str, Label] = {}
    for path in paths:
        for qid, label in load_labels(path).items():
            if qid in merged:
                raise InputError(f"{path}: query_id {qid} is already labelled by an earlier file")
            merged[qid] = label
    return merged


# ---------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    from engine.cli import ArgumentParser, debug_flag, debugging

    parser = debug_flag(ArgumentParser(
        prog="python -m evaluator.score_retrieval", description=__doc__.split("\n\n")[0]
    ))
    parser.add_argument("--results", required=True, type=Path, help="run output, JSONL")
    parser.add_argument(
        "--labels", required=True, type=Path, action="append", help="labels file (repeatable)"
    )
    parser.add_argument("--queries", type=Path,
                        help="the request file (JSONL, or CIRCO/CIRR annotation JSON): gives each query's "
                             "reference image id (default: none, the reference check is skipped)")
    parser.add_argument("--out", type=Path, help="also write the JSON report here (default: not written)")
    args = parser.parse_args(argv)
    try:
        labels = load_label_files(args.labels)
        references = load_references(args.queries) if args.queries is not None else None
        results = read_results(args.results, references)
    except (InputError, OSError, UnicodeDecodeError) as e:
        if debugging(args.debug):
            raise
        print(f"score_retrieval: error: {e}", file=sys.stderr)
        return 2
    report = score_file(results, labels)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        try:
            args.out.write_text(text + "\n", encoding="utf-8")
        except OSError as e:
            print(f"score_retrieval: error: --out {args.out}: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
