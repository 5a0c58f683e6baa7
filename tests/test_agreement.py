"""evaluator.contest.agreement: the contest gate over every row, agreement over answered rows,
the file readers and the CLI."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from evaluator.contest.agreement import (
    GATE,
    ContestGate,
    agreement,
    contest_gate,
    judge,
    main,
    read_frozen_reference,
    read_i32,
    read_reference,
    threshold,
)


def _i32(path: Path, values) -> Path:
    path.write_bytes(np.asarray(values, "<i4").tobytes())
    return path


def test_agreement_counts_only_rows_with_a_reference():
    pred = np.array([1, 2, 3, 4, 5], np.int32)
    ref = np.array([1, -1, 3, 9, -1], np.int32)
    a = agreement(pred, ref)
    assert (a.matches, a.total, a.unreadable, a.gate) == (2, 3, 2, GATE)
    assert a.rate == pytest.approx(2 / 3) and not a.passed


def test_agreement_gate_is_inclusive():
    pred = np.arange(100, dtype=np.int32)
    ref = pred.copy()
    ref[7] = 500
    a = agreement(pred, ref)
    assert (a.matches, a.total) == (99, 100) and a.rate == 0.99 and a.passed
    assert not agreement(pred, ref, gate=0.995).passed
    ref[8] = 500
    assert not agreement(pred, ref).passed


def test_all_unreadable_never_passes():
    a = agreement(np.zeros(3, np.int32), np.full(3, -1, np.int32), gate=0.0)
    assert (a.total, a.unreadable, a.rate, a.passed) == (0, 3, 0.0, False)


def test_agreement_length_mismatch():
    with pytest.raises(ValueError, match="3 predictions vs 2 reference answers"):
        agreement(np.zeros(3, np.int32), np.zeros(2, np.int32))


def test_read_i32_round_trip(tmp_path):
    p = _i32(tmp_path / "p.i32", [0, 999, 5])
    a = read_i32(p, 3)
    assert a.dtype == np.dtype("<i4") and a.tolist() == [0, 999, 5]
    assert read_i32(_i32(tmp_path / "e.i32", []), 0).tolist() == []


def test_read_i32_is_little_endian(tmp_path):
    p = tmp_path / "le.i32"
    p.write_bytes(b"\x01\x02\x00\x00")
    assert read_i32(p).tolist() == [0x0201]


def test_read_i32_length(tmp_path):
    with pytest.raises(ValueError, match="3 predictions, expected 4"):
        read_i32(_i32(tmp_path / "p.i32", [1, 2, 3]), 4)


@pytest.mark.parametrize("values, bad, row", [([1, 1000, 2], 1000, 2), ([-1, 0], -1, 1), ([5, 6, 7, -2**31], -2**31, 4)])
def test_read_i32_range(tmp_path, values, bad, row):
    p = _i32(tmp_path / "p.i32", values)
    with pytest.raises(ValueError, match=rf"value {bad} at row {row} is outside \[0, 999\]"):
        read_i32(p)
    assert read_i32(p, check_range=False).tolist() == values


@pytest.mark.parametrize("extra", [1, 2, 3])
def test_read_i32_partial_int(tmp_path, extra):
    p = tmp_path / "p.i32"
    p.write_bytes(np.arange(3, dtype="<i4").tobytes() + b"\x00" * extra)
    with pytest.raises(ValueError, match=f"{12 + extra} bytes is not a whole number of int32"):
        read_i32(p)


@pytest.fixture
def manifest(tmp_path) -> Path:
    p = tmp_path / "manifest.tsv"
    p.write_text("".join(f"id{i:02d}\timages/{i}.JPEG\n" for i in (5, 3, 9, 1, 7)))
    return p


def test_tsv_reference_is_aligned_through_the_manifest(tmp_path, manifest):
    ref = tmp_path / "ref.tsv"
    # shuffled relative to the manifest, CRLF, a blank line, extra columns, and id07 missing
    ref.write_bytes(b"id01\t11\r\nid09\t99\textra\n\nid05\t55\nid03\t33\n")
    assert read_reference(ref, manifest, 5).tolist() == [55, 33, 99, 11, -1]


def test_tsv_reference_needs_the_manifest(tmp_path):
    ref = tmp_path / "ref.tsv"
    ref.write_text("id01\t1\n")
    with pytest.raises(ValueError, match="needs --manifest"):
        read_reference(ref, None, 1)


@pytest.mark.parametrize("line", ["id01 1", "id01\tcat", "id01"])
def test_tsv_reference_bad_line(tmp_path, manifest, line):
    ref = tmp_path / "ref.tsv"
    ref.write_text(f"id05\t5\n{line}\n")
    with pytest.raises(ValueError, match=f"{ref}:2: expected request_id<TAB>class"):
        read_reference(ref, manifest, 5)


def test_tsv_reference_row_count_mismatch(tmp_path, manifest):
    ref = tmp_path / "ref.tsv"
    ref.write_text("id05\t5\n")
    with pytest.raises(ValueError, match="manifest has 5 rows, predictions have 4"):
        read_reference(ref, manifest, 4)


def test_i32_reference_allows_unreadable_rows(tmp_path):
    ref = _i32(tmp_path / "ref.i32", [3, -1, 4])
    assert read_reference(ref, None, 3).tolist() == [3, -1, 4]
    with pytest.raises(ValueError, match=r"ref.i32: 3 reference answers, expected 2"):
        read_reference(ref, None, 2)


# ---- the contest gate -------------------------------------------------------------------------


@pytest.mark.parametrize("rows, needed", [(10_000, 9_900), (9_800, 9_702), (100, 99), (64, 64), (1, 1), (101, 100)])
def test_threshold_is_ceil_of_99_percent_of_rows(rows, needed):
    assert threshold(rows) == needed == -(-99 * rows // 100)  # integer ceil, no float rounding


def test_9710_true_matches_of_10000_rows_fail():
    # 9,800 rows answered, 9,710 of them match; 200 rows have no reference answer
    ref = np.arange(10_000, dtype=np.int32) % 1000
    pred = ref.copy()
    pred[:90] = (pred[:90] + 1) % 1000    # 90 answered rows wrong
    ref[-200:] = -1                        # 200 rows without an answer: misses
    g = contest_gate(pred, ref)
    assert (g.matches, g.rows, g.unanswered, g.threshold) == (9_710, 10_000, 200, 9_900)
    assert not g.passed and g.rate == pytest.approx(0.971)
    # the measure over answered rows alone would have said 9710/9800 = 99.08 % PASS
    a = agreement(pred, ref)
    assert (a.matches, a.total) == (9_710, 9_800) and a.passed


def test_two_percent_unanswered_fails_even_when_every_answer_matches():
    ref = np.arange(1_000, dtype=np.int32) % 1000
    pred = ref.copy()
    ref[::50] = -1                         # 20 of 1,000 rows (2 %) have no answer
    g = contest_gate(pred, ref)
    assert (g.matches, g.rows, g.unanswered) == (980, 1_000, 20) and not g.passed


def test_gate_is_inclusive_at_the_threshold():
    ref = np.zeros(10_000, np.int32)
    pred = ref.copy()
    pred[:100] = 1                          # 9,900 matches: exactly the threshold
    assert contest_gate(pred, ref).passed
    pred[100] = 1                           # 9,899
    assert not contest_gate(pred, ref).passed


def test_a_gate_that_saw_no_row_fails():
    g = contest_gate(np.zeros(0, np.int32), np.zeros(0, np.int32))
    assert (g.rows, g.threshold, g.passed) == (0, 0, False)


def test_gate_line_names_matches_rows_threshold_and_misses():
    g = ContestGate(9_710, 10_000, 200, GATE)
    assert g.line() == ("9710/10000 (97.10 %) FAIL at the 99 % gate (threshold 9900 of 10000 rows); "
                        "200 rows without a reference answer count as misses")


def test_frozen_reference_marks_minus_one_in_an_i32_unreadable(tmp_path):
    ref, unreadable = read_frozen_reference(_i32(tmp_path / "ref.i32", [3, -1, 4, -1]), None, 4)
    assert ref.tolist() == [3, -1, 4, -1] and unreadable.tolist() == [False, True, False, True]
    with pytest.raises(ValueError, match=r"class 1000 at row 1 is outside \[0, 999\]"):
        read_frozen_reference(_i32(tmp_path / "big.i32", [1000]), None, 1)
    with pytest.raises(ValueError, match=r"class -2 at row 2 is outside \[0, 999\]"):
        read_frozen_reference(_i32(tmp_path / "neg.i32", [0, -2]), None, 2)
    ref, unreadable = read_frozen_reference(_i32(tmp_path / "ok.i32", [0, 999]), None, None)  # rows from the file
    assert ref.tolist() == [0, 999] and not unreadable.any()


def test_judge_leaves_unreadable_rows_out_of_the_verdict_and_reports_them_apart():
    ref = np.arange(200, dtype=np.int32)
    ref[[10, 50, 90]] = -1                    # 3 images the reference could not read
    pred = np.arange(200, dtype=np.int32)     # every answered row matches
    v = judge(pred, ref, ref == -1)
    assert (v.judged.matches, v.judged.rows, v.judged.threshold, v.passed) == (197, 197, 196, True)
    assert (v.all_rows.matches, v.all_rows.rows, v.all_rows.passed, v.unreadable) == (197, 200, False, 3)
    first, second = v.lines()
    assert first.startswith("197/197 (100.00 %) PASS") and "3 rows the reference could not read (-1)" in first
    assert second.startswith("over all 200 rows") and "197/200 (98.50 %) FAIL" in second
    pred[:2] = 999                            # 2 answered rows wrong: 195/197 < 196
    assert not judge(pred, ref, ref == -1).passed
    assert judge(pred, ref, np.zeros(200, bool)).unreadable == 0   # a TSV's unnamed rows stay misses


def test_frozen_tsv_reference_leaves_unnamed_rows_as_misses(tmp_path, manifest):
    ref = tmp_path / "ref.tsv"
    ref.write_text("id05\t5\nid03\t3\n")
    answers, unreadable = read_frozen_reference(ref, manifest, 5)
    assert answers.tolist() == [5, 3, -1, -1, -1] and not unreadable.any()
    ref.write_text("id05\t-1\n")
    with pytest.raises(ValueError, match=r"ref.tsv:1: class -1 is outside \[0, 999\]"):
        read_frozen_reference(ref, manifest, 5)
    ref.write_text("id05\t5\nid05\t6\n")
    with pytest.raises(ValueError, match="answered twice"):
        read_frozen_reference(ref, manifest, 5)


# ---- CLI --------------------------------------------------------------------------------------

LINE = re.compile(r"^(\d+)/(\d+) \((\d+\.\d\d) %\) (PASS|FAIL) at the ([\d.]+) % gate \(threshold (\d+) of (\d+) rows\)")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_pass(tmp_path, capsys):
    pred = _i32(tmp_path / "p.i32", list(range(200)))
    ref = _i32(tmp_path / "r.i32", list(range(198)) + [0, 0])
    rc, out, err = _run(capsys, "--predictions", pred, "--reference", ref)
    assert rc == 0 and err == ""
    m = LINE.match(out)
    assert m and m.groups() == ("198", "200", "99.00", "PASS", "99", "198", "200"), out
    assert "without a reference answer" not in out


def test_cli_fail(tmp_path, capsys):
    pred = _i32(tmp_path / "p.i32", [0] * 98 + [1, 1])
    ref = _i32(tmp_path / "r.i32", [0] * 100)
    rc, out, _ = _run(capsys, "--predictions", pred, "--reference", ref)
    assert rc == 1
    assert LINE.match(out).groups() == ("98", "100", "98.00", "FAIL", "99", "99", "100"), out
    # the same rows pass a lower gate
    rc, out, _ = _run(capsys, "--predictions", pred, "--reference", ref, "--gate", "0.98")
    assert rc == 0 and LINE.match(out).group(4) == "PASS" and LINE.match(out).group(6) == "98"


def test_cli_tsv_with_manifest_counts_unnamed_rows_as_misses(tmp_path, manifest, capsys):
    pred = _i32(tmp_path / "p.i32", [55, 33, 99, 11, 77])
    ref = tmp_path / "ref.tsv"
    ref.write_text("id01\t11\nid09\t99\nid05\t55\nid03\t33\n")   # id07 has no answer
    rc, out, _ = _run(capsys, "--predictions", pred, "--reference", ref, "--manifest", manifest)
    assert rc == 1 and LINE.match(out).groups()[:4] == ("4", "5", "80.00", "FAIL")
    assert "1 rows without a reference answer count as misses" in out


def test_cli_two_percent_unanswered_fails_though_every_answer_matches(tmp_path, capsys):
    """The Done-when case: 2 % of rows have no answer (a TSV that does not name them), every other row matches."""
    rows = 500
    man = tmp_path / "m.tsv"
    man.write_text("".join(f"r{i}\tx/{i}.JPEG\n" for i in range(rows)))
    classes = [i % 1000 for i in range(rows)]
    pred = _i32(tmp_path / "p.i32", classes)
    ref = tmp_path / "ref.tsv"
    ref.write_text("".join(f"r{i}\t{classes[i]}\n" for i in range(rows) if i % 50 != 7))  # 10 rows left out
    rc, out, _ = _run(capsys, "--predictions", pred, "--reference", ref, "--manifest", man)
    assert rc == 1, out
    assert LINE.match(out).groups() == ("490", "500", "98.00", "FAIL", "99", "495", "500")


def test_cli_accepts_the_kits_own_reference_with_unreadable_rows(tmp_path, capsys):
    """The reference path writes -1 for the planted broken files: reported apart, never refused."""
    classes = [i % 1000 for i in range(200)]
    pred = _i32(tmp_path / "p.i32", classes)
    ref = _i32(tmp_path / "r.i32", [-1 if i in (37, 120, 150) else c for i, c in enumerate(classes)])
    rc, out, err = _run(capsys, "--predictions", pred, "--reference", ref)
    assert rc == 0 and err == "", err
    first, second = out.strip().splitlines()
    assert LINE.match(first).groups() == ("197", "197", "100.00", "PASS", "99", "196", "197"), first
    assert "3 rows the reference could not read (-1) are left out" in first
    assert second.startswith("over all 200 rows") and "197/200 (98.50 %) FAIL" in second
    rc, out, _ = _run(capsys, "--predictions", pred, "--reference", ref, "--json")
    d = json.loads(out)
    assert (rc, d["verdict"], d["unreadable"], d["rows"], d["all_rows"]["rows"], d["all_rows"]["passed"]) == \
        (0, "PASS", 3, 197, 200, False)


def test_cli_truncated_predictions_name_the_file_and_the_right_counts(tmp_path, manifest, capsys):
    pred = _i32(tmp_path / "pred.i32", [1] * 100)
    ref = _i32(tmp_path / "ref0.i32", [1] * 200)
    rc, out, err = _run(capsys, "--predictions", pred, "--reference", ref)
    assert rc == 2 and out == ""
    assert f"{pred}: 100 predictions, expected 200 (one per row of the reference {ref})" in err, err
    _i32(pred, [1] * 4)
    _i32(ref, [1] * 5)
    rc, _, err = _run(capsys, "--predictions", pred, "--reference", ref, "--manifest", manifest)
    assert rc == 2 and f"{pred}: 4 predictions, expected 5" in err and "manifest" in err, err
    _i32(ref, [1] * 6)
    rc, _, err = _run(capsys, "--predictions", pred, "--reference", ref, "--manifest", manifest)
    assert rc == 2 and f"{ref}: 6 reference answers, expected 5" in err, err


def test_cli_expect_rows(tmp_path, capsys):
    pred = _i32(tmp_path / "p.i32", [7] * 10)
    ref = _i32(tmp_path / "r.i32", [7] * 10)
    assert _run(capsys, "--predictions", pred, "--reference", ref, "--expect-rows", "10")[0] == 0
    rc, out, _ = _run(capsys, "--predictions", pred, "--reference", ref, "--expect-rows", "10000")
    assert rc == 1 and LINE.match(out).group(4) == "PASS"  # every row matches, but not the contest's cohort
    assert "FAIL: the cohort has 10 rows, expected 10000 (--expect-rows)" in out
    rc, out, _ = _run(capsys, "--predictions", pred, "--reference", ref, "--expect-rows", "10000", "--json")
    assert rc == 1 and json.loads(out)["verdict"] == "FAIL" and json.loads(out)["expect_rows"] == 10000


def test_cli_expect_rows_counts_rows_not_matches(tmp_path, capsys):
    """Mismatching predictions and unreadable rows change the matches, never the row count --expect-rows checks."""
    pred = _i32(tmp_path / "p.i32", [7] * 8 + [1, 1])      # 2 of 10 rows wrong
    ref = _i32(tmp_path / "r.i32", [7] * 9 + [-1])           # 1 row the reference could not read
    rc, out, _ = _run(capsys, "--predictions", pred, "--reference", ref, "--expect-rows", "10")
    assert rc == 1 and "--expect-rows" not in out            # fails on agreement (8/9), not on the row count
    assert LINE.match(out).groups()[:4] == ("8", "9", "88.89", "FAIL")
    rc, out, _ = _run(capsys, "--predictions", pred, "--reference", ref, "--expect-rows", "8", "--gate", "0.5")
    assert rc == 1 and "FAIL: the cohort has 10 rows, expected 8 (--expect-rows)" in out
    rc, out, _ = _run(capsys, "--predictions", pred, "--reference", ref, "--expect-rows", "10", "--gate", "0.5")
    assert rc == 0, out


def test_cli_json(tmp_path, capsys):
    pred = _i32(tmp_path / "p.i32", [1, 2, 3, 4])
    ref = _i32(tmp_path / "r.i32", [1, 2, 3, 5])
    rc, out, _ = _run(capsys, "--predictions", pred, "--reference", ref, "--json", "--gate", "0.75")
    assert rc == 0
    d = json.loads(out)
    assert d == {"matches": 3, "rows": 4, "unanswered": 0, "gate": 0.75, "threshold": 3, "rate": 0.75,
                 "unreadable": 0, "all_rows": {"matches": 3, "rows": 4, "unanswered": 0, "gate": 0.75,
                                               "threshold": 3, "passed": True},
                 "expect_rows": None, "verdict": "PASS"}
    assert set(d) == set(ContestGate.__dataclass_fields__) | {"threshold", "rate", "unreadable", "all_rows",
                                                               "expect_rows", "verdict"}


@pytest.mark.parametrize("case", ["missing_pred", "partial_int", "out_of_range", "length", "tsv_no_manifest",
                                  "bad_manifest", "manifest_rows", "below_minus_one"])
def test_cli_bad_input_exits_2(tmp_path, manifest, capsys, case):
    pred = _i32(tmp_path / "p.i32", [1, 2, 3, 4, 5])
    ref = _i32(tmp_path / "r.i32", [1, 2, 3, 4, 5])
    args = ["--predictions", pred, "--reference", ref]
    if case == "missing_pred":
        args[1] = tmp_path / "absent.i32"
    elif case == "partial_int":
        pred.write_bytes(pred.read_bytes() + b"\x00")
    elif case == "out_of_range":
        _i32(pred, [1, 2, 3, 4, 1000])
    elif case == "length":
        _i32(ref, [1, 2, 3])
    elif case == "tsv_no_manifest":
        args[3] = tmp_path / "ref.tsv"
        args[3].write_text("id01\t1\n")
    elif case == "bad_manifest":
        (tmp_path / "bad.tsv").write_text("no tab\n")
        args += ["--manifest", tmp_path / "bad.tsv"]
    elif case == "manifest_rows":
        _i32(pred, [1, 2, 3])
        args += ["--manifest", manifest]
    elif case == "below_minus_one":
        _i32(ref, [1, 2, -7, 4, 5])
    rc, out, err = _run(capsys, *args)
    assert rc == 2 and out == ""
    assert err.startswith("agreement: error:") and len(err.strip().splitlines()) == 1, err


def test_cli_debug_shows_the_error_instead_of_one_line(tmp_path):
    """--debug: the bad input's own exception (its traceback), not the one-line error."""
    ref = _i32(tmp_path / "r.i32", [1, 2, 3])
    with pytest.raises(OSError):
        main(["--predictions", str(tmp_path / "absent.i32"), "--reference", str(ref), "--debug"])


@pytest.mark.parametrize("flag, value", [("--gate", "1.5"), ("--gate", "0"), ("--gate", "x"), ("--expect-rows", "0")])
def test_cli_bad_flag_values_exit_2(tmp_path, capsys, flag, value):
    pred = _i32(tmp_path / "p.i32", [1])
    with pytest.raises(SystemExit) as info:
        main(["--predictions", str(pred), "--reference", str(pred), flag, value])
    assert info.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.abi
def test_cli_as_a_process(tmp_path):
    pred = _i32(tmp_path / "p.i32", [7] * 10)
    ok = _i32(tmp_path / "ok.i32", [7] * 10)
    bad = _i32(tmp_path / "bad.i32", [7] * 9 + [8])
    cmd = [sys.executable, "-m", "evaluator.agreement", "--predictions", str(pred), "--reference"]
    runs = {name: subprocess.run(cmd + [str(ref)], cwd=REPO, capture_output=True, text=True, timeout=60)
            for name, ref in (("ok", ok), ("bad", bad), ("missing", tmp_path / "nope.i32"))}
    assert runs["ok"].returncode == 0 and runs["ok"].stdout.startswith("10/10 (100.00 %) PASS")
    assert runs["bad"].returncode == 1 and runs["bad"].stdout.startswith("9/10 (90.00 %) FAIL")
    assert runs["missing"].returncode == 2 and "Traceback" not in runs["missing"].stderr
