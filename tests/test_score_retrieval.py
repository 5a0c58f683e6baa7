"""Tests of the CIR scorer: hand-computed metrics, official formats, CLI, error paths."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from evaluator.cir.score import (
    InputError,
    Label,
    average_precision_at_k,
    load_label_files,
    load_labels,
    load_results,
    main,
    recall_at_k,
    reward,
    score,
)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "cir"
CIRCO_EXCERPT = FIXTURES / "circo_val.excerpt.json"
CIRR_EXCERPT = FIXTURES / "cirr_cap.rc2.val.excerpt.json"


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def row(qid, ids):
    """A results row with strictly decreasing scores."""
    return {"query_id": qid, "results": [{"image_id": i, "score": 1.0 - 0.01 * n} for n, i in enumerate(ids)]}


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


def test_ap_duplicates_count_twice_like_official():
    # ranking [a, a] with positives {a, b}: official cumsum counts both positions
    # AP@5 = (1/1 + 2/2) / min(5, 2) = 1  (the ABI forbids duplicates; this pins the arithmetic)
    assert average_precision_at_k(["a", "a"], ["a", "b"], 5) == pytest.approx(1.0)


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
    assert circo["queries"] == 2 and circo["missing"] == 1
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
    assert rep["missing"] == 1 and rep["unlabeled"] == 1 and rep["queries"] == 4
    assert rep["reward"] == pytest.approx(1 / (1 + math.exp(-20 * (rep["raw"] - 0.26812065144613684))))
    assert "0.26812065144613684" in rep["reward_mapping"] and "20" in rep["reward_mapping"]


def test_score_single_source_says_so():
    rep = score({"r1": ["t"]}, {"r1": Label("cirr", ("t",))})
    assert rep["raw"] == pytest.approx(1.0)
    assert rep["raw_sources"] == ["cirr"]
    assert "only cirr" in rep["raw_note"]
    assert "circo" not in rep["sources"]


def test_score_counts_duplicate_rows():
    rep = score({"c": ["a", "a"]}, {"c": Label("circo", ("a", "b"))})
    assert rep["sources"]["circo"]["rows_with_duplicates"] == 1


def test_score_needs_labels():
    with pytest.raises(ValueError):
        score({"q": ["a"]}, {})


def test_reward_mapping():
    b = 0.26812065144613684
    assert reward(b) == pytest.approx(0.5)
    assert reward(b + 0.1) == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert reward(b - 0.1) == pytest.approx(1 / (1 + math.exp(2.0)))
    assert reward(0.0) < reward(0.3) < reward(1.0) < 1.0
    assert reward(-1e6) == 0.0 and reward(1e6) == 1.0  # no overflow
    with pytest.raises(ValueError):
        reward(float("nan"))


# ---------------------------------------------------------------- loaders


def test_load_circo_official_excerpt():
    labels = load_labels(CIRCO_EXCERPT)
    assert len(labels) == 8
    # first entry of val.json: id 0, gt_img_ids [355099, 528417, 534704]
    assert labels["0"] == Label("circo", ("355099", "528417", "534704"))
    assert all(lab.source == "circo" for lab in labels.values())


def test_load_cirr_official_excerpt():
    labels = load_labels(CIRR_EXCERPT)
    assert len(labels) == 8
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
    assert len(merged) == 18
    with pytest.raises(InputError, match="already labelled"):
        load_label_files([CIRCO_EXCERPT, CIRCO_EXCERPT])


def test_official_excerpts_score_perfect_and_reference_only(tmp_path):
    circo = json.loads(CIRCO_EXCERPT.read_text())
    cirr = json.loads(CIRR_EXCERPT.read_text())
    labels = load_label_files([CIRCO_EXCERPT, CIRR_EXCERPT])
    # perfect run: all positives first -> every mAP and recall is 1
    perfect = {str(e["id"]): e["gt_img_ids"] for e in circo}
    perfect.update({e["pairid"]: [e["target_hard"]] for e in cirr})
    assert score(perfect, labels)["raw"] == pytest.approx(1.0)
    # a run returning only each reference image finds nothing
    useless = {str(e["id"]): [e["reference_img_id"]] for e in circo}
    useless.update({str(e["pairid"]): [e["reference"]] for e in cirr})
    rep = score(useless, labels)
    assert rep["raw"] == 0.0 and rep["missing"] == 0


def test_load_results(tmp_path):
    p = tmp_path / "run.jsonl"
    p.write_text(json.dumps(row(1, [5, "a"])) + "\n\n" + json.dumps(row("q", [])) + "\n")
    assert load_results(p) == {"1": ["5", "a"], "q": []}


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"query_id": 1, "results": [', "malformed JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"results": []}', "query_id"),
        ('{"query_id": 1, "results": {}}', "must be a list"),
        ('{"query_id": 1, "results": [{"score": 1.0}]}', "image_id"),
        ('{"query_id": 1, "results": [{"image_id": "a", "score": NaN}]}', "finite"),
        ('{"query_id": 1, "results": [{"image_id": "a", "score": Infinity}]}', "finite"),
        ('{"query_id": 1, "results": [{"image_id": "a", "score": "1"}]}', "finite"),
        ('{"query_id": 1, "results": [{"image_id": "a"}]}', "finite"),
    ],
)
def test_load_results_errors_name_file_and_line(tmp_path, line, message):
    p = tmp_path / "run.jsonl"
    p.write_text(json.dumps(row(0, ["a"])) + "\n" + line + "\n")
    with pytest.raises(InputError, match=message) as info:
        load_results(p)
    assert f"{p}:2" in str(info.value)


def test_load_results_duplicate_query(tmp_path):
    p = write_jsonl(tmp_path / "run.jsonl", [row(0, ["a"]), row("0", ["b"])])
    with pytest.raises(InputError, match=r"run.jsonl:2: duplicate row"):
        load_results(p)


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


def test_cli_end_to_end(tmp_path):
    # CIRCO query 0 (gt 355099, 528417, 534704): ranking [355099, 1, 528417]
    #   AP@k = (1/1 + 2/3) / 3 = 5/9 for every k; the other 7 CIRCO queries are missing (0)
    #   -> mAP@k = (5/9) / 8 = 5/72
    # CIRR 12060 (target dev-1028-1-img1) at rank 2 -> R@1 = 0, R@5+ = 1; 7 others missing
    #   -> R@1 = 0, R@5 = R@10 = R@50 = 1/8, mean = 3/32
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
    assert rep["sources"]["circo"]["fraction"]["mAP@5"] == pytest.approx(5 / 72)
    assert rep["sources"]["cirr"]["fraction"]["R@1"] == 0.0
    assert rep["sources"]["cirr"]["fraction"]["R@5"] == pytest.approx(1 / 8)
    assert rep["raw"] == pytest.approx((5 / 72 + 3 / 32) / 2)
    assert rep["missing"] == 14 and rep["unlabeled"] == 1
    assert 0.0 < rep["reward"] < 0.5


def test_cli_bad_input_exits_2(tmp_path):
    results = tmp_path / "run.jsonl"
    results.write_text(
        json.dumps(row(0, ["a"])) + "\n" + '{"query_id": 1, "results": [{"image_id": 2, "score": NaN}]}\n'
    )
    proc = run_cli("--results", results, "--labels", CIRCO_EXCERPT)
    assert proc.returncode == 2
    assert f"{results}:2" in proc.stderr and "finite" in proc.stderr
    assert proc.stdout == ""


def test_main_missing_file_exits_2(tmp_path, capsys):
    assert main(["--results", str(tmp_path / "nope.jsonl"), "--labels", str(CIRR_EXCERPT)]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
