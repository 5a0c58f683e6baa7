"""Score composed-image-retrieval runs: CIRCO mAP@k, CIRR Recall@k, raw quality, reward.

    python -m evaluator.score_retrieval --results RUN.jsonl --labels L1 [--labels L2 ...] [--out R.json]

Producing answers and scoring them are separate tools: this module only reads files.

Metrics (fractions internally; the report prints fractions and percent, both labelled):
- CIRCO, official miccunifi/CIRCO `src/evaluation.py`: AP@k = (sum over ranks i <= k that
  hold a positive of precision@i) / min(k, #positives); mAP@k = mean over queries, for
  k in 5/10/25/50.
- CIRR, official Cuberick-Orion/CIRR: Recall@k = 1 if `target_hard` is in the top k, for
  k in 1/5/10/50. The run already excludes the reference image; nothing is removed here.
- raw = (mean of the four CIRCO mAPs + mean of the four CIRR recalls) / 2, the two sources
  weighted equally. With labels of one source only, raw = that source's mean (the report
  says so in `raw_note`).
- reward = 1 / (1 + exp(-a * (raw - b))), a = 20, b = 0.26812065144613684: the task's
  logistic mapping of raw quality.

Choices:
- Ids are compared as strings (CIRCO ids are ints, CIRR ids strings): str() everywhere.
- Rank = position in the row's `results` list; scores are checked finite but not re-sorted.
- Duplicated ids in a results row are scored like the official CIRCO script does: every
  position counts, so a duplicated positive counts twice (AP can then exceed 1). The ABI
  forbids duplicates; the report counts such rows in `rows_with_duplicates`.
- A labelled query without a results row scores zero and is counted in `missing`; a
  results row without a label is ignored and counted in `unlabeled`.
- Bad input raises InputError naming file and line (the CLI exits with status 2).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

CIRCO_KS = (5, 10, 25, 50)
CIRR_KS = (1, 5, 10, 50)
SOURCES = ("circo", "cirr")
REWARD_B = 0.26812065144613684
REWARD_A = 20.0


class InputError(ValueError):
    """A malformed results or labels file; the message names the file and line."""


@dataclass(frozen=True)
class Label:
    """Ground truth of one query: its benchmark and its positive image ids (as str)."""

    source: str  # "circo" | "cirr"
    positives: tuple[str, ...]  # CIRCO: gt_img_ids; CIRR: (target_hard,)


# ---------------------------------------------------------------- metrics (pure)


def average_precision_at_k(ranking: Sequence, positives: Collection, k: int) -> float:
    """CIRCO AP@k of one ranked list: sum of precision@i at each hit in the top k,
    divided by min(k, number of distinct positives). Duplicates in `ranking` count
    at every position, as in the official script."""
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
    """The task's reward mapping of raw quality: logistic 1 / (1 + exp(-a * (raw - b)))."""
    if not math.isfinite(raw):
        raise ValueError(f"raw quality must be finite, got {raw}")
    z = a * (raw - b)
    if z >= 0:  # two branches so exp never overflows
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def reward_formula(b: float = REWARD_B, a: float = REWARD_A) -> str:
    """The reward mapping written out, for reports."""
    return f"1/(1+exp(-{a:g}*(raw-{b!r})))"


def _metric_names(source: str) -> list[str]:
    return [f"mAP@{k}" for k in CIRCO_KS] if source == "circo" else [f"R@{k}" for k in CIRR_KS]


def _query_metrics(source: str, ranking: Sequence[str], positives: Collection[str]) -> list[float]:
    if source == "circo":
        return [average_precision_at_k(ranking, positives, k) for k in CIRCO_KS]
    return [recall_at_k(ranking, positives, k) for k in CIRR_KS]


def score(results: Mapping[str, Sequence], labels: Mapping[str, Label]) -> dict:
    """Score rankings {query_id: [image_id, ...]} against labels {query_id: Label}.

    Returns the report dict: per source the query count, `missing`, metrics as fractions
    and as percent and their mean; then `raw`, `reward`, `missing`, `unlabeled`.
    """
    if not labels:
        raise ValueError("no labels to score against")
    results = {str(q): [str(i) for i in r] for q, r in results.items()}
    sums: dict[str, list[float]] = {}
    counts: dict[str, dict[str, int]] = {}
    for qid, label in labels.items():
        if label.source not in SOURCES:
            raise ValueError(f"query {qid}: unknown source {label.source!r}")
        n_metrics = len(CIRCO_KS) if label.source == "circo" else len(CIRR_KS)
        acc = sums.setdefault(label.source, [0.0] * n_metrics)
        cnt = counts.setdefault(label.source, {"queries": 0, "missing": 0, "rows_with_duplicates": 0})
        cnt["queries"] += 1
        ranking = results.get(str(qid))
        if ranking is None:
            cnt["missing"] += 1  # scores zero on every metric
            continue
        if len(set(ranking)) != len(ranking):
            cnt["rows_with_duplicates"] += 1
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
        queries=len(labels),
        missing=sum(c["missing"] for c in counts.values()),
        unlabeled=sum(1 for q in results if q not in labelled),
    )
    return report


# ---------------------------------------------------------------- loaders


def _is_id(value) -> bool:
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def _is_score(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _jsonl_objects(path: Path) -> Iterable[tuple[int, dict]]:
    """Yield (line number, object) for each non-blank line of a JSONL file."""
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


def load_results(path: str | Path) -> dict[str, list[str]]:
    """Read a run's JSONL output into {query_id: [image_id, ...]} (ids as str, rank order)."""
    path = Path(path)
    out: dict[str, list[str]] = {}
    for lineno, row in _jsonl_objects(path):
        where = f"{path}:{lineno}"
        qid = row.get("query_id")
        if not _is_id(qid):
            raise InputError(f"{where}: missing or invalid query_id")
        items = row.get("results")
        if not isinstance(items, list):
            raise InputError(f"{where}: query {qid}: 'results' must be a list")
        ranking = []
        for pos, item in enumerate(items):
            if not isinstance(item, dict) or not _is_id(item.get("image_id")):
                raise InputError(f"{where}: query {qid}: result {pos} has no valid image_id")
            if not _is_score(item.get("score")):
                raise InputError(
                    f"{where}: query {qid}: result {pos} score {item.get('score')!r} is not a finite number"
                )
            ranking.append(str(item["image_id"]))
        if str(qid) in out:
            raise InputError(f"{where}: duplicate row for query {qid}")
        out[str(qid)] = ranking
    return out


def _dedupe(ids: Iterable) -> tuple[str, ...]:
    return tuple(dict.fromkeys(str(i) for i in ids))


def _label_from_official(entry, where: str) -> tuple[str, Label]:
    """One entry of CIRCO val.json or CIRR cap.rc2.val.json -> (query_id, Label)."""
    if not isinstance(entry, dict):
        raise InputError(f"{where}: expected a JSON object")
    if "pairid" in entry:  # CIRR captions file
        if not _is_id(entry["pairid"]):
            raise InputError(f"{where}: invalid pairid")
        if not _is_id(entry.get("target_hard")):
            raise InputError(f"{where}: CIRR entry without target_hard (test split has no public labels)")
        return str(entry["pairid"]), Label("cirr", (str(entry["target_hard"]),))
    if "reference_img_id" in entry or "gt_img_ids" in entry:  # CIRCO annotations
        if not _is_id(entry.get("id")):
            raise InputError(f"{where}: CIRCO entry without a valid id")
        gts = entry.get("gt_img_ids")
        if not isinstance(gts, list) or not gts or not all(_is_id(g) for g in gts):
            raise InputError(f"{where}: CIRCO entry without gt_img_ids (test split has no public labels)")
        return str(entry["id"]), Label("circo", _dedupe(gts))
    if "query_id" in entry:
        return _label_from_row(entry, where)
    raise InputError(f"{where}: not a CIRCO, CIRR or {{query_id, source, positives}} entry")


def _label_from_row(row: dict, where: str) -> tuple[str, Label]:
    """One JSONL label row {query_id, source, positives} -> (query_id, Label)."""
    qid = row.get("query_id")
    if not _is_id(qid):
        raise InputError(f"{where}: missing or invalid query_id")
    source = row.get("source")
    if source not in SOURCES:
        raise InputError(f"{where}: source must be one of {SOURCES}, got {source!r}")
    positives = row.get("positives")
    if not isinstance(positives, list) or not positives or not all(_is_id(p) for p in positives):
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
    parser = argparse.ArgumentParser(
        prog="python -m evaluator.score_retrieval", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--results", required=True, type=Path, help="run output, JSONL")
    parser.add_argument(
        "--labels", required=True, type=Path, action="append", help="labels file (repeatable)"
    )
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    args = parser.parse_args(argv)
    try:
        labels = load_label_files(args.labels)
        results = load_results(args.results)
    except (InputError, OSError, UnicodeDecodeError) as e:
        print(f"score_retrieval: error: {e}", file=sys.stderr)
        return 2
    report = score(results, labels)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
