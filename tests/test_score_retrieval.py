"""Tests of the CIR scorer: hand-computed metrics, the task's reward map, row validity as the
verifier sees it, official formats, CLI, error paths."""

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from evaluator.cir.score import (
    INVALID_KINDS,
    InputError,
    Label,
    average_precision_at_k,
    check_results,
    load_label_files,
    load_labels,
    load_references,
    load_results,
    main,
    read_results,
    recall_at_k,
    reward,
    reward_rule,
    score,
    score_file,
)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "cir"
CIRCO_EXCERPT = FIXTURES / "circo_val.excerpt.json"
CIRR_EXCERPT = FIXTURES / "cirr_cap.rc2.val.excerpt.json"
B = 0.26812065144613684


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def row(qid, ids):
    """A results row with strictly decreasing scores."""
    return {"query_id": qid, "results": [{"image_id": i, "score": 1.0 - 0.01 * n} for n, i in enumerate(ids)]}


def rule_reward(q: float) -> float:
    """The task's map written out independently: 0.2 q / b up to b, then 0.2 + 0.8 (q - b) / (1 - b)."""
    return 0.2 * q / B if q <= B else 0.2 + 0.8 * (q - B) / (1 - B)


# ---------------------------------------------------------------- AP@k


def test_ap_hand_computed():
    # positives {a,b,c}, ranking [a,x,b,y,z]: hits at ranks 1 and 3
    # AP@5 = (1/1 + 2/3) / min(5, 3) = (5/3) / 3 = 5/9
    assert average_precision_at_k(["a", "x", "b", "y", "z"], {"a", "b", "c"}, 5) == pytest.approx(5 / 9)
    # AP@2 = (1/1) / min(2, 3) = 1/2  (b at rank 3 is outside the top 2)
    assert average_precision_at_k(["a", "x", "b", "y", "z"], {"a", "b", "c"}, 2) == pytest.approx(1 / 2)
    # AP@1 = (1/1) / min(1, 3) = 1
    assert average_precision_at_k(["a", "x", "b"], {"a", "b", "c"}, 1) == pytest.approx(1.0)


def test_ap_min_k_gt_divisor():
    # 7 positives p0..p6, ranking [p0, x, p1, p2, x, ...]
    # AP@5 = (1/1 + 2/3 + 3/4) / min(5, 7) = (29/12) / 5 = 29/60 (divisor is k, not #gt)
    pos = [f"p{i}" for i in range(7)]
    ranking = ["p0", "x", "p1", "p2", "y", "p3"]
    assert average_precision_at_k(ranking, pos, 5) == pytest.approx(29 / 60)
    # AP@10 on the same list: hits at 1, 3, 4, 6 -> (1 + 2/3 + 3/4 + 4/6) / min(10, 7) = (37/12) / 7
    assert average_precision_at_k(ranking, pos, 10) == pytest.approx(37 / 12 / 7)


def test_ap_k_larger_than_list():
    # positives {a, b}, ranking [x, a] only 2 long, k = 50
    # AP@50 = (1/2) / min(50, 2) = 1/4; the missing positive b just never counts
    assert average_precision_at_k(["x", "a"], ["a", "b"], 50) == pytest.approx(1 / 4)
    assert average_precision_at_k([], ["a"], 50) == 0.0


def test_ap_none_found_and_all_found():
    assert average_precision_at_k(["x", "y", "z"], ["a", "b"], 5) == 0.0
    # all positives at the top: (1/1 + 2/2 + 3/3) / 3 = 1
    assert average_precision_at_k(["c", "a", "b", "x"], ["a", "b", "c"], 5) == pytest.approx(1.0)
    # all found but late: ranking [x, a, y, b] -> (1/2 + 2/4) / 2 = 1/2
    assert average_precision_at_k(["x", "a", "y", "b"], ["a", "b"], 5) == pytest.approx(1 / 2)


def test_ap_ids_compared_as_strings():
    # CIRCO ids are ints in val.json; runs may write them as str or int
    assert average_precision_at_k(["355099", 1, 528417], [355099, 528417, 534704], 5) == pytest.approx(
        (1 / 1 + 2 / 3) / 3
    )


def test_ap_rejects_bad_arguments():
    with pytest.raises(ValueError):
        average_precision_at_k(["a"], [], 5)
    with pytest.raises(ValueError):
        average_precision_at_k(["a"], ["a"], 0)


# ---------------------------------------------------------------- Recall@k


def test_recall_cases():
    ranking = ["x", "y", "t", "z"]
    assert recall_at_k(ranking, ["t"], 1) == 0.0  # target at rank 3
    assert recall_at_k(ranking, ["t"], 2) == 0.0
    assert recall_at_k(ranking, ["t"], 3) == 1.0
    assert recall_at_k(ranking, ["t"], 50) == 1.0  # k beyond the list
    assert recall_at_k(["t"], ["t"], 1) == 1.0
    assert recall_at_k([], ["t"], 10) == 0.0
    assert recall_at_k(["dev-1-img0"], ["dev-1-img0"], 1) == 1.0


# ---------------------------------------------------------------- reward


@pytest.mark.parametrize("q, expected", [
    (0.0, 0.0),                                  # 0 -> 0
    (B, 0.2),                                    # b -> a / 100
    (0.3, 0.2 + 0.8 * (0.3 - B) / (1 - B)),      # just above b: the upper line
    (1.0, 1.0),                                  # 1 -> 1
    (0.42, 0.2 + 0.8 * (0.42 - B) / (1 - B)),    # 0.366
    (0.1, 0.2 * 0.1 / B),                        # below b: the lower line
])
def test_reward_is_the_piecewise_linear_map(q, expected):
    assert reward(q) == pytest.approx(expected, abs=1e-15)
    assert reward(q) == pytest.approx(rule_reward(q), abs=1e-15)


def test_reward_worked_values_and_continuity():
    assert reward(0.42) == pytest.approx(0.36601, abs=1e-5)
    assert reward(0.3) == pytest.approx(0.23485, abs=1e-5)
    assert reward(B - 1e-12) == pytest.approx(0.2, abs=1e-9) and reward(B + 1e-12) == pytest.approx(0.2, abs=1e-9)
    # slopes on each side: 0.2 / b below, 0.8 / (1 - b) above
    assert (reward(0.2) - reward(0.1)) / 0.1 == pytest.approx(0.2 / B)
    assert (reward(0.9) - reward(0.8)) / 0.1 == pytest.approx(0.8 / (1 - B))


@pytest.mark.parametrize("q", [float("nan"), float("inf"), -0.01, 1.01])
def test_reward_refuses_values_outside_0_1(q):
    with pytest.raises(ValueError):
        reward(q)


def test_reward_rule_names_its_formula():
    rule = reward_rule()
    assert rule["name"] == "piecewise-linear" and rule["b"] == B and rule["a"] == 20
    assert "piecewise linear" in rule["formula"] and "0.26812065144613684" in rule["formula"]
    assert "exp" not in rule["formula"]


# ---------------------------------------------------------------- score()


def test_score_both_sources_hand_computed():
    labels = {
        "c1": Label("circo", ("a", "b", "c")),
        "c2": Label("circo", ("d",)),
        "r1": Label("cirr", ("t",)),
        "r2": Label("cirr", ("u",)),
    }
    results = {
        "c1": ["a", "x", "b"],  # AP@5 = AP@10 = AP@25 = AP@50 = (1 + 2/3)/3 = 5/9
        # c2 missing -> 0 on every metric
        "r1": ["x", "t"],  # R@1 = 0, R@5 = R@10 = R@50 = 1
        "r2": ["u"],  # all 1
        "zz": ["a"],  # unlabeled, ignored
    }
    rep = score(results, labels)
    circo = rep["sources"]["circo"]
    assert circo["queries"] == 2 and circo["missing"] == 1 and circo["answered"] == 1
    # mAP@k = (5/9 + 0) / 2 = 5/18 for every k
    for k in (5, 10, 25, 50):
        assert circo["fraction"][f"mAP@{k}"] == pytest.approx(5 / 18)
        assert circo["percent"][f"mAP@{k}"] == pytest.approx(500 / 18)
    assert circo["mean_fraction"] == pytest.approx(5 / 18)
    cirr = rep["sources"]["cirr"]
    # R@1 = (0 + 1)/2 = 1/2; R@5/10/50 = 1; mean = (1/2 + 3)/4 = 7/8
    assert cirr["fraction"] == pytest.approx({"R@1": 0.5, "R@5": 1.0, "R@10": 1.0, "R@50": 1.0})
    assert cirr["mean_fraction"] == pytest.approx(7 / 8)
    # raw = (5/18 + 7/8) / 2, sources weighted equally
    assert rep["raw"] == pytest.approx((5 / 18 + 7 / 8) / 2)
    assert rep["raw_sources"] == ["circo", "cirr"]
    assert rep["missing"] == 1 and rep["unlabeled"] == 1 and rep["queries"] == 4 and rep["invalid"] == 0
    assert rep["reward"] == pytest.approx(rule_reward(rep["raw"]))
    assert rep["reward_rule"]["name"] == "piecewise-linear" and "0.26812065144613684" in rep["reward_mapping"]


def test_score_single_source_says_so():
    rep = score({"r1": ["t"]}, {"r1": Label("cirr", ("t",))})
    assert rep["raw"] == pytest.approx(1.0) and rep["reward"] == pytest.approx(1.0)
    assert rep["raw_sources"] == ["cirr"]
    assert "only cirr" in rep["raw_note"]
    assert "circo" not in rep["sources"]


def test_score_counts_rankings_that_break_the_id_rules_as_invalid():
    # a repeated id (AP would be 1 by the official arithmetic) and 51 results both score zero
    labels = {"c": Label("circo", ("a", "b")), "d": Label("circo", ("a",))}
    rep = score({"c": ["a", "a"], "d": ["a"] + [f"x{i}" for i in range(50)]}, labels)
    assert rep["raw"] == 0.0 and rep["invalid"] == 2 and rep["sources"]["circo"]["answered"] == 0


def test_score_given_invalid_queries_scores_them_zero():
    labels = {"c": Label("circo", ("a",)), "d": Label("circo", ("a",))}
    rep = score({"d": ["a"]}, labels, invalid={"c": "rising_scores"})
    assert rep["raw"] == pytest.approx(0.5)  # c: 0, d: 1
    assert rep["sources"]["circo"]["invalid"] == 1 and rep["missing"] == 0


def test_score_needs_labels():
    with pytest.raises(ValueError):
        score({"q": ["a"]}, {})


# ---------------------------------------------------------------- row validity


def items(ids, scores=None):
    scores = scores if scores is not None else [1.0 - 0.01 * n for n in range(len(ids))]
    return [{"image_id": i, "score": s} for i, s in zip(ids, scores)]


@pytest.mark.parametrize("value, kind, words", [
    ({}, "bad_results", "not a list"),
    ([{"score": 1.0}], "bad_results", "result 1 has no valid image_id"),
    ([{"image_id": "a", "score": "1"}], "bad_results", "not a number"),
    ([{"image_id": "a", "score": True}], "bad_results", "not a number"),
    ([{"image_id": "a"}], "bad_results", "not a number"),
    (["a"], "bad_results", "no valid image_id"),
    (items(["a", "b"], [1.0, float("nan")]), "non_finite_score", "rank 2 is not finite"),
    (items(["a"], [float("-inf")]), "non_finite_score", "not finite"),
    (items([f"i{n}" for n in range(51)]), "too_many_results", "51 results (at most 50)"),
    (items(["a", "b", "a"]), "duplicate_ids", "'a' appears more than once (ranks 1 and 3)"),
    (items([1, "1"]), "duplicate_ids", "appears more than once"),  # ids compare as strings
    (items(["a", "b", "c"], [0.9, 0.8, 0.85]), "rising_scores", "scores increase at rank 3"),
    (items(["a", "ref", "c"]), "reference_image", "reference image 'ref' is in its results (rank 2)"),
])
def test_check_results_kinds(value, kind, words):
    got = check_results(value, reference="ref")
    assert got is not None and got[0] == kind and words in got[1], got


def test_check_results_accepts_valid_rows():
    assert check_results([]) is None
    assert check_results(items([f"i{n}" for n in range(50)])) is None  # exactly 50
    assert check_results(items(["a", "b", "c"], [0.5, 0.5, 0.1])) is None  # ties are non-increasing
    assert check_results(items(["a", "b"], [3, -2])) is None  # ints are numbers
    assert check_results(items(["ref"])) is None  # no reference given: not checked


def test_every_invalid_kind_has_a_description():
    assert set(INVALID_KINDS) == {
        "torn_last_line", "malformed_json", "not_an_object", "bad_query_id", "duplicate_query", "bad_results",
        "non_finite_score", "too_many_results", "duplicate_ids", "rising_scores", "reference_image"}


def test_read_results_records_every_invalid_line(tmp_path):
    p = tmp_path / "run.jsonl"
    lines = [
        json.dumps(row(1, ["a", 5])),                                           # 1 valid
        "",                                                                     # 2 blank: not a row
        '{"query_id": 2, "results": [',                                         # 3 malformed
        "[1, 2]",                                                               # 4 not an object
        json.dumps({"results": []}),                                            # 5 no query_id
        json.dumps(row(1, ["zz"])),                                             # 6 second row for 1
        '{"query_id": 3, "results": [{"image_id": "a", "score": NaN}]}',         # 7 NaN
        json.dumps(row("q", [])),                                               # 8 valid, empty
        '{"query_id": 4, "results": [{"image_id": "a", "sc',                    # 9 torn (no newline)
    ]
    p.write_bytes(("\n".join(lines)).encode() + b"")  # no newline at the end: line 9 is the torn last line
    rf = read_results(p)
    assert rf.rankings == {"1": ["a", "5"], "q": []} and rf.rows == 8
    assert [(r.line, r.query_id, r.kind) for r in rf.invalid] == [
        (3, None, "malformed_json"), (4, None, "not_an_object"), (5, None, "bad_query_id"),
        (6, "1", "duplicate_query"), (7, "3", "non_finite_score"), (9, None, "torn_last_line")]
    assert rf.invalid_queries == {"3": "non_finite_score"}
    assert "skipped" in rf.reference_check
    assert load_results(p) == rf.rankings


def test_first_row_of_a_query_decides_even_when_invalid(tmp_path):
    bad_first = {"query_id": 7, "results": items(["a", "b"], [0.1, 0.9])}  # rising: invalid
    p = write_jsonl(tmp_path / "run.jsonl", [bad_first, row(7, ["t"])])
    rf = read_results(p)
    assert rf.rankings == {} and rf.invalid_queries == {"7": "rising_scores"}
    assert [r.kind for r in rf.invalid] == ["rising_scores", "duplicate_query"]
    rep = score_file(rf, {"7": Label("cirr", ("t",))})
    assert rep["raw"] == 0.0 and rep["invalid"] == 1 and rep["missing"] == 0


def test_bad_utf8_and_crlf_lines(tmp_path):
    p = tmp_path / "run.jsonl"
    p.write_bytes(json.dumps(row(1, ["a"])).encode() + b"\r\n" + b'{"query_id": 2, "results": [\xff]}\n')
    rf = read_results(p)
    assert rf.rankings == {"1": ["a"]}
    assert [(r.line, r.kind) for r in rf.invalid] == [(2, "malformed_json")] and "UTF-8" in rf.invalid[0].reason


def test_reference_check_uses_the_requests_file(tmp_path):
    reqs = write_jsonl(tmp_path / "requests.jsonl", [
        {"query_id": 1, "reference_image_id": 555, "modification": "x"},
        {"query_id": "r", "reference_image_id": "dev-1", "modification": "y"}])
    run = write_jsonl(tmp_path / "run.jsonl", [row(1, ["a", 555]), row("r", ["dev-2"])])
    refs = load_references(reqs)
    assert refs == {"1": "555", "r": "dev-1"}
    rf = read_results(run, refs)
    assert rf.rankings == {"r": ["dev-2"]} and [r.kind for r in rf.invalid] == ["reference_image"]
    assert "checked" in rf.reference_check
    assert read_results(run).rankings == {"1": ["a", "555"], "r": ["dev-2"]}  # without it: not checked


def test_references_from_the_official_annotation_files():
    circo = load_references(CIRCO_EXCERPT)
    cirr = load_references(CIRR_EXCERPT)
    assert circo["0"] == "271520" and len(circo) == 100  # CIRCO id 0: reference_img_id 271520
    assert cirr["12060"] == "dev-244-0-img0" and len(cirr) == 200


# ---------------------------------------------------------------- Done when: official annotations, every kind planted


def oracle_metrics(ranking: list[str], positives: list[str], source: str) -> list[float]:
    """The official scripts' arithmetic, written independently of the scorer (numpy, as upstream)."""
    if source == "circo":
        out = []
        for k in (5, 10, 25, 50):
            hits = np.isin(np.array(ranking[:k], dtype=object), np.array(positives, dtype=object)).astype(float)
            precision = np.cumsum(hits) / np.arange(1, len(hits) + 1) if len(hits) else hits
            out.append(float((precision * hits).sum() / min(k, len(positives))))
        return out
    return [float(positives[0] in ranking[:k]) for k in (1, 5, 10, 50)]


def build_run(quality: str, seed: int):
    """(requests, labels, result lines, planted kinds, expected raw) from the official excerpts.

    Rankings are drawn around each query's positives (never its reference); invalid rows of every
    kind are planted on chosen queries, whose expected contribution is zero."""
    circo = json.loads(CIRCO_EXCERPT.read_text())
    cirr = json.loads(CIRR_EXCERPT.read_text())
    rng = random.Random(seed)
    distractors = [f"coco-{i}" for i in range(400)] + [f"dev-x-{i}" for i in range(400)]
    queries = []  # (query_id as written, source, reference, positives as str)
    for e in circo:
        queries.append((e["id"], "circo", str(e["reference_img_id"]), [str(g) for g in e["gt_img_ids"]]))
    for e in cirr:
        queries.append((e["pairid"], "cirr", e["reference"], [e["target_hard"]]))
    requests = [{"query_id": q, "reference_image_id": ref, "modification": "m"} for q, _, ref, _ in queries]

    def ranking_for(positives: list[str]) -> list[str]:
        n = rng.randint(0, 50)
        pool = rng.sample(distractors, n)
        for p in positives:
            if quality == "high" or rng.random() < 0.4:
                spot = rng.randint(0, 3) if quality == "high" else rng.randint(0, 60)
                if spot < 50:
                    pool.insert(spot, p)
        return list(dict.fromkeys(pool))[:50]

    def ok_row(qid, ids):
        return json.dumps({"query_id": qid, "results": items(ids)})

    lines, planted, zero = [], [], set()
    plan = {  # query index -> kind planted on its row (both sources get several)
        3: "malformed_json", 5: "not_an_object", 7: "bad_query_id", 9: "bad_results", 11: "bad_results",
        13: "non_finite_score", 15: "non_finite_score", 17: "too_many_results", 19: "duplicate_ids",
        21: "rising_scores", 23: "reference_image", 25: "duplicate_query", 27: "invalid_then_valid",
        110: "malformed_json", 120: "bad_results", 130: "non_finite_score", 140: "too_many_results",
        150: "duplicate_ids", 160: "rising_scores", 170: "reference_image", 180: "duplicate_query",
        190: "invalid_then_valid", 200: "bad_utf8", 210: "missing",
    }
    rankings = {}
    for n, (qid, _source, ref, positives) in enumerate(queries):
        ids = ranking_for(positives)
        kind = plan.get(n)
        if kind is None:
            lines.append(ok_row(qid, ids))
            rankings[str(qid)] = ids
            continue
        if kind == "missing":
            zero.add(str(qid))
            continue
        if kind == "duplicate_query":  # the first row counts, the second (a perfect one) does not
            lines.append(ok_row(qid, ids))
            lines.append(ok_row(qid, positives))
            rankings[str(qid)] = ids
            planted.append("duplicate_query")
            continue
        zero.add(str(qid))
        if kind == "invalid_then_valid":  # the first row decides: an invalid first row, then a perfect one
            lines.append(json.dumps({"query_id": qid, "results": items(["late", "later"], [0.1, 0.9])}))
            lines.append(ok_row(qid, positives))
            planted += ["rising_scores", "duplicate_query"]
            continue
        res = items(ids)
        if kind == "malformed_json":
            lines.append(ok_row(qid, ids)[:-7])
        elif kind == "bad_utf8":
            lines.append('{"query_id": %s, "results": [\udcff]}' % json.dumps(qid))
            kind = "malformed_json"
        elif kind == "not_an_object":
            lines.append(json.dumps([qid, res]))
        elif kind == "bad_query_id":
            lines.append(json.dumps({"query": qid, "results": res}))
        elif kind == "bad_results":
            lines.append(json.dumps({"query_id": qid, "results": {"image_id": "a", "score": 1}}))
        elif kind == "non_finite_score":
            lines.append(json.dumps({"query_id": qid, "results": items(positives + ["z"], [1.0] * len(positives)
                                                                         + [float("nan")])}))
        elif kind == "too_many_results":
            lines.append(ok_row(qid, positives + distractors[:51 - len(positives)]))
        elif kind == "duplicate_ids":
            lines.append(ok_row(qid, positives + [positives[0]]))
        elif kind == "rising_scores":
            lines.append(json.dumps({"query_id": qid, "results": items(positives + ["z"],
                                                                         [0.5] * len(positives) + [0.7])}))
        elif kind == "reference_image":
            lines.append(ok_row(qid, positives + [ref]))
        planted.append(kind)
    # the torn last line: what a timeout leaves (the query it was answering scores zero)
    qid, source, ref, positives = queries[-1]
    lines = [ln for ln in lines if not ln.startswith('{"query_id": %s,' % json.dumps(qid))]
    rankings.pop(str(qid), None)
    zero.add(str(qid))
    lines.append(ok_row(qid, positives)[:25])
    planted.append("torn_last_line")

    sums = {"circo": np.zeros(4), "cirr": np.zeros(4)}
    count = {"circo": 0, "cirr": 0}
    for qid, source, _ref, positives in queries:
        count[source] += 1
        if str(qid) in rankings and str(qid) not in zero:
            sums[source] += oracle_metrics(rankings[str(qid)], positives, source)
    expected = (sums["circo"].mean() / count["circo"] + sums["cirr"].mean() / count["cirr"]) / 2
    return requests, lines, planted, float(expected)


@pytest.mark.abi
@pytest.mark.parametrize("quality, seed", [("low", 1), ("high", 2)])
def test_official_annotations_with_every_invalid_kind_planted(tmp_path, quality, seed):
    requests, lines, planted, expected = build_run(quality, seed)
    reqs = write_jsonl(tmp_path / "requests.jsonl", requests)
    run = tmp_path / "run.jsonl"
    data = "\n".join(lines).encode("utf-8", errors="surrogateescape")  # the torn last line has no newline
    run.write_bytes(data)
    assert b"\xff" in data and not data.endswith(b"\n")
    out = tmp_path / "report.json"
    proc = run_cli("--results", run, "--labels", CIRCO_EXCERPT, "--labels", CIRR_EXCERPT,
                   "--queries", reqs, "--out", out)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    # raw quality = the rules' value: invalid and missing rows 0, valid rows as usual
    assert abs(rep["raw"] - expected) <= 1e-9, (rep["raw"], expected)
    assert (rep["raw"] < B) if quality == "low" else (rep["raw"] > B)  # both sides of b
    assert abs(rep["reward"] - rule_reward(expected)) <= 1e-9
    v = rep["validity"]
    counts = {k: planted.count(k) for k in set(planted)}
    assert v["invalid_by_kind"] == counts and set(counts) == set(INVALID_KINDS)
    assert v["invalid_rows"] == len(planted) and v["valid_rows"] == v["rows_read"] - len(planted)
    assert "checked" in v["reference_check"]
    first = v["invalid_examples"][0]
    assert set(first) == {"line", "query_id", "kind", "reason"} and first["line"] >= 1
    assert rep["queries"] == 300 and rep["missing"] + rep["invalid"] + rep["answered"] == 300
    assert json.loads(out.read_text()) == rep


def test_without_queries_the_reference_check_is_skipped_and_said(tmp_path):
    circo = json.loads(CIRCO_EXCERPT.read_text())[0]
    run = write_jsonl(tmp_path / "run.jsonl", [row(circo["id"], [circo["reference_img_id"], *circo["gt_img_ids"]])])
    rep = score_file(read_results(run), load_labels(CIRCO_EXCERPT))
    assert rep["validity"]["reference_check"].startswith("skipped")
    assert rep["answered"] == 1 and rep["invalid"] == 0


# ---------------------------------------------------------------- loaders


def test_load_circo_official_excerpt():
    labels = load_labels(CIRCO_EXCERPT)
    assert len(labels) == 100
    # first entry of val.json: id 0, gt_img_ids [355099, 528417, 534704]
    assert labels["0"] == Label("circo", ("355099", "528417", "534704"))
    assert all(lab.source == "circo" for lab in labels.values())


def test_load_cirr_official_excerpt():
    labels = load_labels(CIRR_EXCERPT)
    assert len(labels) == 200
    # first entry of cap.rc2.val.json: pairid 12060, target_hard dev-1028-1-img1
    assert labels["12060"] == Label("cirr", ("dev-1028-1-img1",))
    assert all(lab.source == "cirr" for lab in labels.values())


def test_load_jsonl_labels_and_merge(tmp_path):
    p = write_jsonl(
        tmp_path / "labels.jsonl",
        [
            {"query_id": "q1", "source": "circo", "positives": [1, 2, 2]},
            {"query_id": 9007, "source": "cirr", "positives": ["dev-1-img0"]},
        ],
    )
    labels = load_labels(p)
    assert labels == {"q1": Label("circo", ("1", "2")), "9007": Label("cirr", ("dev-1-img0",))}
    merged = load_label_files([CIRCO_EXCERPT, CIRR_EXCERPT, p])
    assert len(merged) == 302
    with pytest.raises(InputError, match="already labelled"):
        load_label_files([CIRCO_EXCERPT, CIRCO_EXCERPT])


def test_official_excerpts_score_perfect_and_reference_only():
    circo = json.loads(CIRCO_EXCERPT.read_text())
    cirr = json.loads(CIRR_EXCERPT.read_text())
    labels = load_label_files([CIRCO_EXCERPT, CIRR_EXCERPT])
    # perfect run: all positives first -> every mAP and recall is 1
    perfect = {str(e["id"]): e["gt_img_ids"] for e in circo}
    perfect.update({e["pairid"]: [e["target_hard"]] for e in cirr})
    rep = score(perfect, labels)
    assert rep["raw"] == pytest.approx(1.0) and rep["reward"] == pytest.approx(1.0)
    # a run returning only each reference image finds nothing
    useless = {str(e["id"]): [e["reference_img_id"]] for e in circo}
    useless.update({str(e["pairid"]): [e["reference"]] for e in cirr})
    rep = score(useless, labels)
    assert rep["raw"] == 0.0 and rep["reward"] == 0.0 and rep["missing"] == 0


@pytest.mark.parametrize(
    "content, message",
    [
        ('[{"id": 0, "reference_img_id": 1, "relative_caption": "x", "shared_concept": "y"}]', "gt_img_ids"),
        ('[{"pairid": 1, "reference": "a", "caption": "x"}]', "target_hard"),
        ('[{"foo": 1}]', "not a CIRCO, CIRR"),
        ("[1", "malformed JSON"),
        ('{"query_id": 1, "source": "coco", "positives": [1]}\n', "source"),
        ('{"query_id": 1, "source": "cirr", "positives": []}\n', "positives"),
        ("", "no labels"),
    ],
)
def test_load_labels_errors(tmp_path, content, message):
    p = tmp_path / "labels.json"
    p.write_text(content)
    with pytest.raises(InputError, match=message) as info:
        load_labels(p)
    assert str(p) in str(info.value)


# ---------------------------------------------------------------- CLI


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "evaluator.score_retrieval", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.abi
def test_cli_end_to_end(tmp_path):
    # CIRCO query 0 (gt 355099, 528417, 534704): ranking [355099, 1, 528417]
    #   AP@k = (1/1 + 2/3) / 3 = 5/9 for every k; the other 99 CIRCO queries are missing (0)
    #   -> mAP@k = (5/9) / 100
    # CIRR 12060 (target dev-1028-1-img1) at rank 2 -> R@1 = 0, R@5+ = 1; 199 others missing
    #   -> R@1 = 0, R@5 = R@10 = R@50 = 1/200, mean = 3/800
    results = write_jsonl(
        tmp_path / "run.jsonl",
        [
            row(0, [355099, 1, 528417]),
            row(12060, ["dev-244-0-img0x", "dev-1028-1-img1"]),
            row("not-a-query", ["a"]),
        ],
    )
    out = tmp_path / "report.json"
    proc = run_cli("--results", results, "--labels", CIRCO_EXCERPT, "--labels", CIRR_EXCERPT, "--out", out)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep == json.loads(out.read_text())
    assert rep["sources"]["circo"]["fraction"]["mAP@5"] == pytest.approx(5 / 9 / 100)
    assert rep["sources"]["cirr"]["fraction"]["R@1"] == 0.0
    assert rep["sources"]["cirr"]["fraction"]["R@5"] == pytest.approx(1 / 200)
    assert rep["raw"] == pytest.approx((5 / 9 / 100 + 3 / 800) / 2)
    assert rep["missing"] == 298 and rep["unlabeled"] == 1
    assert rep["reward"] == pytest.approx(rule_reward(rep["raw"]))


@pytest.mark.abi
def test_cli_scores_despite_bad_rows(tmp_path):
    results = tmp_path / "run.jsonl"
    results.write_text(
        json.dumps(row(0, [355099])) + "\n" + '{"query_id": 1, "results": [{"image_id": 2, "score": NaN}]}\n'
    )
    proc = run_cli("--results", results, "--labels", CIRCO_EXCERPT)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["validity"]["invalid_by_kind"] == {"non_finite_score": 1}
    assert rep["validity"]["invalid_examples"][0]["line"] == 2 and rep["invalid"] == 1


@pytest.mark.parametrize("case", ["missing_results", "results_is_dir", "missing_labels", "bad_labels",
                                  "missing_queries"])
def test_cli_exits_2_only_when_a_file_cannot_be_read(tmp_path, capsys, case):
    results = write_jsonl(tmp_path / "run.jsonl", [row(0, [1])])
    args = {"--results": results, "--labels": CIRR_EXCERPT}
    if case == "missing_results":
        args["--results"] = tmp_path / "nope.jsonl"
    elif case == "results_is_dir":
        args["--results"] = tmp_path
    elif case == "missing_labels":
        args["--labels"] = tmp_path / "nolabels.json"
    elif case == "bad_labels":
        args["--labels"] = tmp_path / "bad.json"
        args["--labels"].write_text("[1")
    elif case == "missing_queries":
        args["--queries"] = tmp_path / "noqueries.jsonl"
    assert main([str(x) for kv in args.items() for x in kv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("score_retrieval: error:") and len(err.strip().splitlines()) == 1


def test_cli_empty_results_file_scores_zero(tmp_path, capsys):
    empty = tmp_path / "run.jsonl"
    empty.write_bytes(b"")
    assert main(["--results", str(empty), "--labels", str(CIRR_EXCERPT)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["raw"] == 0.0 and rep["missing"] == 200 and rep["validity"]["rows_read"] == 0
    assert math.isclose(rep["reward"], 0.0)


# ---------------------------------------------------------------- boundaries the mutation run found untested


def test_recall_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least one positive"):
        recall_at_k(["a"], [], 5)
    with pytest.raises(ValueError, match="k must be >= 1, got 0"):
        recall_at_k(["a"], ["a"], 0)
    assert recall_at_k(["a"], ["a"], 1) == 1.0  # k = 1 is the smallest k


def test_reward_tolerates_only_rounding_above_1():
    assert reward(1.0 + 1e-12) == 1.0  # a rounding error above 1 maps to 1
    with pytest.raises(ValueError):
        reward(1.0 + 1.5e-12)  # the tolerance is 1e-12


def test_report_names_the_first_ten_invalid_rows(tmp_path):
    lines = [json.dumps({"query_id": i, "results": "no"}) for i in range(12)]
    p = tmp_path / "run.jsonl"
    p.write_text("\n".join(lines) + "\n")
    rep = score_file(read_results(p), {"0": Label("cirr", ("t",))})
    assert rep["validity"]["invalid_rows"] == 12
    assert [e["line"] for e in rep["validity"]["invalid_examples"]] == list(range(1, 11))


def test_score_refuses_a_label_of_an_unknown_source():
    with pytest.raises(ValueError, match="query q: unknown source 'fashioniq'"):
        score({"q": ["t"]}, {"q": Label("fashioniq", ("t",))})


@pytest.mark.parametrize("source, metrics", [("circo", "mAP@5/10/25/50"), ("cirr", "R@1/5/10/50")])
def test_single_source_note_names_its_metrics_and_percent_is_100x(source, metrics):
    rep = score({"q": ["a", "t"]}, {"q": Label(source, ("t",))})
    assert rep["raw_note"] == f"only {source} labels given: raw = {source} mean {metrics}"
    block = rep["sources"][source]
    assert all(block["percent"][k] == pytest.approx(100 * v) for k, v in block["fraction"].items())
    assert block["mean_percent"] == pytest.approx(100 * block["mean_fraction"]) and 0 < block["mean_fraction"] < 1
