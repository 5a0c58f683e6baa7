"""The contest gate's records at their edges: one row, no row, the rate of an empty gate.
Cases the agreement tool's mutation run found untested."""
from __future__ import annotations

from evaluator.contest.agreement import Agreement, ContestGate


def test_a_single_matching_row_passes_and_no_row_fails():
    assert Agreement(1, 1, 0, 0.99).passed and ContestGate(1, 1, 0, 0.99).passed
    assert not Agreement(0, 0, 0, 0.99).passed and not ContestGate(0, 0, 0, 0.99).passed


def test_the_rate_of_an_empty_gate_is_zero():
    assert Agreement(0, 0, 3, 0.99).rate == 0.0 and ContestGate(0, 0, 0, 0.99).rate == 0.0
    assert ContestGate(3, 4, 1, 0.99).rate == 0.75 and Agreement(3, 4, 1, 0.99).rate == 0.75


def test_read_i32_names_the_first_value_out_of_range(tmp_path):
    import numpy as np
    import pytest

    from evaluator.contest.agreement import read_i32

    ok = tmp_path / "ok.i32"
    np.array([0, 999, 5], "<i4").tofile(ok)
    assert read_i32(ok).tolist() == [0, 999, 5]                    # both ends are classes
    for values, bad, row in (([0, 999, 1000, -1], 1000, 3), ([5, 0, -1, 1000], -1, 3), ([999, 1000], 1000, 2)):
        path = tmp_path / "bad.i32"
        np.array(values, "<i4").tofile(path)
        with pytest.raises(ValueError, match=rf"value {bad} at row {row} is outside \[0, 999\]"):
            read_i32(path)


def test_tsv_classes_are_0_to_999_inclusive(tmp_path):
    import pytest

    from evaluator.contest.agreement import read_tsv_answers

    ok = tmp_path / "ok.tsv"
    ok.write_text("a\t0\nb\t999\n")
    assert read_tsv_answers(ok) == {"a": 0, "b": 999}
    for value in (-1, 1000):
        bad = tmp_path / "bad.tsv"
        bad.write_text(f"a\t5\nb\t{value}\n")
        with pytest.raises(ValueError, match=rf"bad.tsv:2: class {value} is outside \[0, 999\]"):
            read_tsv_answers(bad)


def test_every_verdict_refuses_predictions_and_references_of_different_lengths():
    import numpy as np
    import pytest

    from evaluator.contest.agreement import agreement, contest_gate, judge

    pred, ref = np.array([1, 2, 3], np.int32), np.array([1, 2], np.int32)
    for call in (lambda: judge(pred, ref, np.zeros(2, bool)), lambda: agreement(pred, ref),
                 lambda: contest_gate(pred, ref)):
        with pytest.raises(ValueError, match="3 predictions vs 2 reference answers"):
            call()


def test_cli_bounds_of_gate_and_expect_rows(tmp_path, capsys):
    import argparse

    import numpy as np
    import pytest

    from evaluator.contest.agreement import _gate_value, _rows_value, main

    assert _gate_value("1.0") == 1.0 and _rows_value("1") == 1                 # the inclusive ends
    for parse, text in ((_gate_value, "0"), (_gate_value, "1.01"), (_rows_value, "0")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
    p = tmp_path / "p.i32"
    np.array([3], "<i4").tofile(p)
    assert main(["--predictions", str(p), "--reference", str(p), "--gate", "1.0", "--expect-rows", "1"]) == 0
    for missing in ("--predictions", "--reference"):                          # both are required
        argv = ["--predictions", str(p), "--reference", str(p)]
        i = argv.index(missing)
        with pytest.raises(SystemExit) as e:
            main(argv[:i] + argv[i + 2:])
        assert e.value.code == 2 and f"{missing}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "Top-1 agreement of predictions with reference answers, and the contest gate." in capsys.readouterr().out
