"""Every promotion rule, one at a time: a campaign that meets them all is promoted, and each
single fault (changed SHA, changed fingerprint, two backends, two devices, no fingerprint,
undefined or high CV, unbound source, ...) adds exactly its own reason. The timing
statistics and the contest gate of the campaign are checked at their boundaries.
Facts are built directly (no process, no model), so these run in well under a second."""
from __future__ import annotations

import dataclasses
import statistics

import numpy as np
import pytest

from evaluator.evidence import disclosure
from evaluator.evidence.disclosure import CampaignFacts, promotion_reasons, summary
from evaluator.evidence.runs import PROFILES, RunRecord
from evaluator.evidence.workloads import WORKLOADS, eva02

FP = {"cpu": {"model": "x", "cores": 16}, "gpu": {"name": "H200", "driver": "1"}, "torch": "2"}


def run(index: int, wall: float = 10.0, ok: bool = True, device: str = "cuda:0", backend: str = "trt",
        matches: int = 100, total: int = 100) -> RunRecord:
    return RunRecord(index=index, ok=ok, reason=None if ok else "exit status 1", wall_s=wall if ok else None,
                     exit_code=0 if ok else 1, timed_out=False, matches=matches, total=total,
                     timing={"device": device, "backend": backend})


def facts(**changes) -> CampaignFacts:
    """A max-profile eva02 campaign that meets every rule; `changes` replace fields."""
    walls = [10.0, 10.1, 9.9, 10.05, 9.95]  # CV ~0.8 %
    base = CampaignFacts(
        workload=WORKLOADS["eva02-imagenet1k"], profile=PROFILES["max"], runs_requested=5,
        runs=[run(i + 1, w) for i, w in enumerate(walls)],
        dataset={"mode": "real", "split": "val", "version": "2012", "rows": 100},
        digests_before={"manifest": "a" * 64, "artifact": "b" * 64},
        digests_after={"manifest": "a" * 64, "artifact": "b" * 64},
        artifact_manifest={"device": "cuda"}, fingerprint_before=FP,
        fingerprint_after={k: (dict(v) if isinstance(v, dict) else v) for k, v in FP.items()},
        git_before={"sha": "1" * 40, "dirty": False}, git_after={"sha": "1" * 40, "dirty": False},
        runner=["scripts/run"], runner_is_abi=True, timeout_s=1800.0,
        conditions_before={}, conditions_after={}, started_utc="t0", finished_utc="t1")
    return dataclasses.replace(base, **changes)


def test_a_campaign_that_meets_every_rule_is_promoted():
    assert promotion_reasons(facts()) == []
    assert disclosure.build(facts())["promotion"] == {"status": "promoted", "promoted": True, "reasons": []}


def only(reasons: list[str]) -> str:
    assert len(reasons) == 1, reasons
    return reasons[0]


def test_git_sha_changed():
    got = only(promotion_reasons(facts(git_after={"sha": "2" * 40, "dirty": False})))
    assert got == f"git SHA changed during the campaign: {'1' * 40} -> {'2' * 40}"


def test_source_not_bound_to_a_sha():
    got = only(promotion_reasons(facts(git_before={"sha": None, "error": "not a git repository"},
                                       git_after={"sha": None})))
    assert got == "source not bound to a git SHA: not a git repository"
    got = only(promotion_reasons(facts(git_before={"sha": ""}, git_after={"sha": ""})))
    assert got == "source not bound to a git SHA: no SHA"


@pytest.mark.parametrize("side", ["git_before", "git_after"])
def test_dirty_tree_before_or_after(side):
    got = only(promotion_reasons(facts(**{side: {"sha": "1" * 40, "dirty": True}})))
    assert got == "source tree dirty (git status --porcelain is not empty)"


def test_fingerprint_changed_names_the_keys():
    after = {**FP, "gpu": {"name": "H200", "driver": "2"}, "torch": "3"}
    got = only(promotion_reasons(facts(fingerprint_after=after)))
    assert got == "comparison fingerprint changed during the campaign: gpu.driver, torch"


@pytest.mark.parametrize("side", ["fingerprint_before", "fingerprint_after"])
def test_fingerprint_not_taken(side):
    got = only(promotion_reasons(facts(**{side: None})))
    assert got == "comparison fingerprint not taken before and after the runs"


def test_different_backends():
    runs = [run(i + 1, w, backend="aot" if i == 4 else "trt") for i, w in enumerate([10, 10.1, 9.9, 10.05, 9.95])]
    assert only(promotion_reasons(facts(runs=runs))) == "runs used different backends: ['aot', 'trt']"


def test_different_devices():
    runs = [run(i + 1, w, device="cuda:1" if i == 0 else "cuda:0") for i, w in enumerate([10, 10.1, 9.9, 10, 10])]
    assert only(promotion_reasons(facts(runs=runs))) == "runs executed on different devices: ['cuda:0', 'cuda:1']"


def test_executed_device_differs_from_the_requested_one():
    runs = [run(i + 1, w, device="cpu") for i, w in enumerate([10, 10.1, 9.9, 10.05, 9.95])]
    assert only(promotion_reasons(facts(runs=runs))) == "executed device cpu differs from requested cuda"
    # the kind is compared, not the index; and upper case is the same kind
    assert promotion_reasons(facts(artifact_manifest={"device": "CUDA:3"})) == []
    assert promotion_reasons(facts(artifact_manifest={"spec": {"device": "cuda"}})) == []
    assert promotion_reasons(facts(artifact_manifest={})) == []  # nothing requested: nothing to compare


def test_timing_cv_undefined_with_one_valid_run():
    reasons = promotion_reasons(facts(runs_requested=1, runs=[run(1)]))
    assert "timing CV undefined (fewer than 2 valid runs)" in reasons
    assert "1 runs requested; promotion needs 5 fresh processes" in reasons
    assert len(reasons) == 2


def test_timing_cv_above_the_limit_and_at_it():
    high = [run(i + 1, w) for i, w in enumerate([10, 10, 10, 10, 12])]
    cv = summary([r.wall_s for r in high])["cv"]
    assert only(promotion_reasons(facts(runs=high))) == f"timing CV {cv:.4f} > 0.05"
    # walls 10 - d, 10, 10, 10, 10 + d have stdev d / sqrt(2): a CV a hair under 5 % passes, a hair over fails
    for cv, blocked in ((0.0499, False), (0.0501, True)):
        d = cv * 10 * 2 ** 0.5
        runs = [run(i + 1, w) for i, w in enumerate([10 - d, 10, 10, 10, 10 + d])]
        assert summary([r.wall_s for r in runs])["cv"] == pytest.approx(cv)
        assert any(r.startswith("timing CV") for r in promotion_reasons(facts(runs=runs))) is blocked


def test_timing_cv_of_exactly_five_percent_passes():
    runs = [run(i + 1, w) for i, w in enumerate([19.0, 19.0, 21.0, 21.0, 20.0])]  # stdev 1, mean 20
    assert summary([r.wall_s for r in runs])["cv"] == 0.05
    assert promotion_reasons(facts(runs=runs)) == []


def test_an_undeclared_dataset_blocks_promotion():
    assert only(promotion_reasons(facts(dataset={"mode": "real", "version": "2012"}))) == \
        "dataset split not declared (--dataset-split)"


def test_fewer_than_five_runs_requested():
    runs = [run(i + 1, w) for i, w in enumerate([10, 10.1, 9.9, 10.05])]
    assert only(promotion_reasons(facts(runs_requested=4, runs=runs))) == \
        "4 runs requested; promotion needs 5 fresh processes"
    runs6 = [run(i + 1, w) for i, w in enumerate([10, 10.1, 9.9, 10.05, 9.95, 10])]
    assert promotion_reasons(facts(runs_requested=6, runs=runs6)) == []


def test_a_failed_run_invalidates_and_is_named():
    runs = [run(i + 1, 10.0 + i / 100) for i in range(4)] + [run(5, ok=False)]
    reasons = promotion_reasons(facts(runs=runs))
    assert reasons == ["attempt invalidated: run 5 failed: exit status 1", "only 4 of 5 requested runs are valid"]


def test_missing_runs_and_an_interruption():
    runs = [run(i + 1, 10.0 + i / 100) for i in range(3)]
    reasons = promotion_reasons(facts(runs=runs, interrupted="SIGTERM"))
    assert reasons == ["attempt interrupted: SIGTERM", "only 3 of 5 requested runs are valid"]


def test_no_run_passed():
    reasons = promotion_reasons(facts(runs=[run(i + 1, ok=False) for i in range(5)]))
    assert "no run passed its gate" in reasons
    assert "timing CV undefined (fewer than 2 valid runs)" in reasons


def test_min_profile_is_never_promotable():
    reasons = promotion_reasons(facts(profile=PROFILES["min"]))
    assert reasons == ["not-promotable: min profile"]
    assert disclosure.build(facts(profile=PROFILES["min"]))["promotion"]["status"] == "not-promotable: min profile"


def test_digest_changed_names_each_file():
    reasons = promotion_reasons(facts(digests_after={"manifest": "c" * 64, "artifact": "b" * 64, "extra": "d"}))
    assert reasons == ["digest changed during the campaign: extra", "digest changed during the campaign: manifest"]


def test_runner_not_the_abi_entry_point():
    assert only(promotion_reasons(facts(runner_is_abi=False))) == \
        "runner is not the contest ABI entry point scripts/run"


def test_a_suspend_blocks_promotion():
    reasons = promotion_reasons(facts(conditions_before={"suspend_count": 3}, conditions_after={"suspend_count": 4}))
    assert only(reasons).startswith("conditions: sleep: the machine suspended 1 time(s)")


def test_aggregate_gate_below_threshold():
    runs = [run(i + 1, 10.0 + i / 100, matches=99 if i else 98) for i in range(5)]  # 494 of 500; needs 495
    assert only(promotion_reasons(facts(runs=runs))) == "aggregate gate failed: agreement 494/500 < threshold 495"
    runs = [run(i + 1, 10.0 + i / 100, matches=99) for i in range(5)]  # 495 of 500: exactly the threshold
    assert promotion_reasons(facts(runs=runs)) == []


# ---------------------------------------------------------------- data reasons and labels


def test_data_reasons_each_fault():
    assert disclosure.data_reasons(facts()) == []
    d = {"mode": "real", "split": "val", "version": "2012", "generated_markers": ["m1", "m2"],
         "generated_model": "renders", "coverage": {"complete": False, "answered": 9, "rows": 10, "what": "rows"}}
    assert disclosure.data_reasons(facts(dataset=d)) == [
        "generated data: the kit's own cohort (m1)", "generated data: the kit's own cohort (m2)",
        "generated model: renders", "incomplete coverage: 9 of 10 rows"]
    complete = {**d, "generated_markers": [], "generated_model": None,
                "coverage": {"complete": True, "answered": 10, "rows": 10, "what": "rows"}}
    assert disclosure.data_reasons(facts(dataset=complete)) == []
    assert disclosure.data_reasons(facts(dataset={"mode": "real", "version": "2012"})) == [
        "dataset split not declared (--dataset-split)"]
    assert disclosure.data_reasons(facts(dataset={"mode": "real", "split": "val"})) == [
        "dataset version not declared (--dataset-version)"]


def test_quality_label():
    assert disclosure.quality_label(facts(), True) == "quality result"
    assert disclosure.quality_label(facts(), False) == "not a result (campaign not promoted)"
    assert disclosure.quality_label(facts(profile=PROFILES["min"]), True) == "functional check"
    assert disclosure.quality_label(facts(dataset={"mode": "generated"}), True) == "functional check"
    assert disclosure.quality_label(facts(dataset={"mode": "real", "generated_model": "x"}), True) == \
        "functional check"


# ---------------------------------------------------------------- statistics


def test_summary_against_the_statistics_module():
    values = [3.0, 1.0, 2.0, 10.0]
    s = summary(values)
    assert s["n"] == 4 and s["values"] == values
    assert s["median"] == 2.5 and s["mean"] == 4.0 and s["min"] == 1.0 and s["max"] == 10.0 and s["range"] == 9.0
    assert s["stdev"] == pytest.approx(statistics.stdev(values))
    assert s["cv"] == pytest.approx(statistics.stdev(values) / 4.0)


def test_summary_edges():
    assert summary([]) == {"n": 0, "values": [], "median": None, "mean": None, "min": None, "max": None,
                           "range": None, "stdev": None, "cv": None}
    one = summary([7.0])
    assert one["stdev"] is None and one["cv"] is None and one["median"] == 7.0 and one["range"] == 0.0
    two = summary([1.0, 3.0])
    assert two["stdev"] == pytest.approx(2 ** 0.5) and two["cv"] == pytest.approx(2 ** 0.5 / 2)
    assert summary([0.0, 0.0])["cv"] is None  # a zero mean has no CV
    assert summary([-1.0, 1.0])["cv"] is None
    assert summary([0.25, 0.75])["cv"] == pytest.approx(statistics.stdev([0.25, 0.75]) / 0.5)  # a mean under 1


# ---------------------------------------------------------------- the campaign's contest gate


def test_threshold_and_gate_reason_at_the_boundary():
    assert eva02.threshold(10000) == 9900 and eva02.threshold(200) == 198 and eva02.threshold(1) == 1
    assert eva02.gate_reason(9900, 10000) is None
    assert eva02.gate_reason(9899, 10000) == \
        "gate failed: agreement 9899/10000 < threshold 9900 (99% of 10000 rows)"
    assert eva02.gate_reason(10, 10, all_rows=False) is None
    ref = np.array([1, -1, 2, -1], dtype=np.int32)
    assert eva02.gate_reason(2, 4, ref) == ("gate failed: agreement 2/4 < threshold 4 (99% of 4 rows); "
                                            "2 rows without a reference answer count as misses")
    zero = np.array([0, -1, 0], dtype=np.int32)  # class 0 is an answer, not a miss
    assert eva02.gate_reason(1, 3, zero).endswith("; 1 rows without a reference answer count as misses")
    assert eva02.gate_reason(1, 2, ref, all_rows=False) == \
        "gate failed: agreement 1/2 < threshold 2 (99% of 2 answered rows)"


def test_aggregate_reasons_sum_every_run():
    runs = [run(1, matches=99, total=100), run(2, matches=100, total=100)]  # 199 of 200, threshold 198
    assert eva02.aggregate_reasons(runs) == []
    runs = [run(1, matches=97, total=100), run(2, matches=100, total=100)]  # 197 < 198
    assert eva02.aggregate_reasons(runs) == ["aggregate gate failed: agreement 197/200 < threshold 198"]


def write_i32(path, values):
    np.asarray(values, dtype="<i4").tofile(path)
    return path


def test_check_predictions_every_problem(tmp_path):
    ref = np.array([1, 2, 3, -1], dtype=np.int32)
    assert eva02.check_predictions(tmp_path / "none.i32", ref) == (0, 4, "no OUTPUT file was written")
    assert eva02.check_predictions(tmp_path / "none.i32", ref, all_rows=False)[1] == 3
    zero = np.array([0, 0, -1], dtype=np.int32)  # class 0 is an answer
    assert eva02.check_predictions(tmp_path / "none.i32", zero, all_rows=False)[1] == 2
    short = write_i32(tmp_path / "short.i32", [1, 2, 3])
    assert eva02.check_predictions(short, ref) == (0, 4, "OUTPUT has 12 bytes, expected 16 (one int32 per row)")
    for bad in ([1, 2, 3, 1000], [1, 2, -1, 3]):
        path = write_i32(tmp_path / "bad.i32", bad)
        assert eva02.check_predictions(path, ref) == (0, 4, "OUTPUT has 1 values outside [0, 999]")
    edge = write_i32(tmp_path / "edge.i32", [1, 2, 999, 0])  # 0 and 999 are classes
    assert eva02.check_predictions(edge, ref) == (2, 4, None)
    assert eva02.check_predictions(edge, ref, all_rows=False) == (2, 3, None)
    good = write_i32(tmp_path / "good.i32", [1, 2, 3, 5])
    assert eva02.check_predictions(good, ref) == (3, 4, None)
    assert eva02.check_predictions(good, ref, all_rows=False) == (3, 3, None)
