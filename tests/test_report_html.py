"""HTML report: rendered from the disclosure JSON only, self-contained, readable in Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from evaluator.evidence import campaign, disclosure, report_html
from evaluator.evidence.runs import PROFILES, RunRecord
from evaluator.evidence.workloads import WORKLOADS


def timing(total: float) -> dict:
    timeline = []
    for b in range(6):  # decode of batch b+1 overlaps inference of batch b
        timeline.append({"stage": "decode", "batch": b, "start": 0.9 + 0.4 * b, "end": 1.3 + 0.4 * b})
        timeline.append({"stage": "inference", "batch": b, "start": 1.3 + 0.4 * b, "end": 1.7 + 0.4 * b})
    return {"stages": {"imports": 0.5, "artifact_load": 0.4, "decode": 2.4, "inference": 2.4, "write": 0.01,
                       "total": total},
            "timeline": timeline, "images": 64, "images_per_s": 64 / total, "backend": "eager",
            "decoder": "pil", "precision": "fp32", "batch_size": 8, "device": "cpu"}


CONDITIONS = {"power_supplies": [{"name": "AC", "type": "Mains", "online": "1", "status": None}],
              "power_source": "mains", "power_policy": {"cpufreq_governors": {"performance": 2},
                                                       "platform_profile": "not measured"},
              "suspend_count": 3, "thermal_zones": [{"zone": "thermal_zone0", "type": "x86_pkg_temp",
                                                      "celsius": 41.0}],
              "throttle_events": 0, "gpu": None, "loadavg": [0.1, 0.2, 0.3], "usable_cores": 2}


def facts(profile: str = "max", walls=(3.71, 3.74, 3.69, 3.80, 3.72), fail_last: bool = False) -> disclosure.CampaignFacts:
    runs = [RunRecord(i + 1, True, None, w, 0, False, 64, 64,
                      {"predictions": f"runs/run-{i + 1:02d}/predictions.i32"}, timing(w - 0.05))
            for i, w in enumerate(walls)]
    if fail_last:
        runs.append(RunRecord(len(runs) + 1, False, "exit status 3: boom", 99.0, 3, False, None, None, {}))
    fp = {"hardware": {"cpu": {"model": "test"}, "gpu": None}, "software": {}, "env": {}}
    digests = {"cohort_manifest": "1" * 64, "reference": "2" * 64, "images": "3" * 64,
               "artifact_manifest": "4" * 64, "artifact_tree": "5" * 64}
    return disclosure.CampaignFacts(
        workload=WORKLOADS["eva02-imagenet1k"], profile=PROFILES[profile], runs_requested=5 + fail_last,
        runs=runs, dataset={"mode": "real", "split": "val", "version": "ILSVRC2012", "rows": 64, "files": {},
                            "coverage": {"what": "manifest rows answered", "answered": 64, "rows": 64,
                                         "complete": True}},
        digests_before=digests, digests_after=dict(digests),
        artifact_manifest={"spec": {"model": "eva02_large_patch14_448"}, "device": "cpu", "backend": "eager"},
        fingerprint_before=fp, fingerprint_after=fp, git_before={"sha": "f" * 40, "dirty": False},
        git_after={"sha": "f" * 40, "dirty": False}, runner=["scripts/run"], runner_is_abi=True, timeout_s=1800,
        conditions_before=CONDITIONS, conditions_after=CONDITIONS | {"loadavg": [0.4, 0.5, 0.6]},
        started_utc="2025-01-01T00:00:00+00:00", finished_utc="2025-01-01T00:01:00+00:00",
        evidence={"sha256": "e" * 64, "covers": "every listed file except disclosure.json and report.html"},
        scheduling={"decoder": "pil", "pipeline_depth": 2, "reader_threads": 8, "cuda_graphs": True,
                    "thread_budget": {"usable_cores": 2, "OMP_NUM_THREADS": "unset"}})


def test_render_is_self_contained_and_deterministic():
    doc = disclosure.build(facts())
    html = report_html.render(doc)
    assert html == report_html.render(json.loads(json.dumps(doc)))  # from the JSON alone, same bytes
    assert "<script" not in html.lower()
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", html)  # nothing fetched
    assert "@import" not in html and "url(" not in html
    assert html.count("<svg") == 2 + 5  # run times, stage bars, one timeline per run
    assert "3.800" in html and "promoted" in html
    assert "independent preview; not an official MLPerf result; not endorsed by MLCommons" in html
    assert "agreement (quality result)" in html and "median / min / max (s)" in html


def test_failed_run_shown_apart_from_the_metric_and_no_aggregate():
    doc = disclosure.build(facts(fail_last=True))
    assert 99.0 not in doc["primary_metric"]["values"]
    assert doc["attempt"]["valid"] is False
    html = report_html.render(doc)
    assert "exit status 3: boom" in html and "99.000" not in html
    # an invalid attempt: the raw values, labelled, and no statistic of them anywhere
    assert "raw values of the runs that completed (invalid attempt)" in html and "3.800" in html
    for statistic in ("median / min / max", "range / sample stdev", "CV (stdev / mean)", "median 3.",
                      "agreement aggregate"):
        assert statistic not in html, statistic
    assert "Invalid attempt</b>: run 6 failed: exit status 3: boom" in html
    for key in ("median", "mean", "min", "max", "range", "stdev", "cv"):
        assert key not in doc["primary_metric"], key
    assert "aggregate" not in doc["quality"] and doc["primary_metric"]["status"].startswith("invalid attempt")


def test_min_profile_html_labels_every_quality_figure_a_functional_check():
    doc = disclosure.build(facts("min"))
    html = report_html.render(doc)
    assert doc["promotion"]["status"] == "not-promotable: min profile"
    assert doc["workload"]["roles"] == ["functional"] and doc["quality"]["label"] == "functional check"
    assert all(r["quality"]["label"] == "functional check" for r in doc["runs"])
    assert "agreement (functional check)" in html and "agreement aggregate (functional check)" in html
    assert "quality result" not in html and ">promoted<" not in html


def test_evidence_digest_conditions_and_scheduling_are_shown():
    html = report_html.render(disclosure.build(facts()))
    assert "e" * 64 in html and "evidence sha256" in html
    assert "power source (measured)" in html and ">mains<" in html and "not stated (set --power)" in html
    assert "quiet (1-minute load 0.1 on 2 cores" in html
    assert "scheduling reader_threads" in html and "scheduling cuda_graphs" in html
    assert "scheduling thread_budget" in html


def test_stage_parts_adds_other_when_total_exceeds_stages():
    parts = dict(report_html.stage_parts({"imports": 1.0, "inference": 2.0, "total": 4.0}))
    assert parts == {"imports": 1.0, "inference": 2.0, "other": 1.0}


def test_stage_parts_pipelined_report_does_not_double_count():
    """The engine's report: read/decode/inference overlap inside 'pipeline'; stack the non-overlapping parts."""
    stages = {"imports": 1.5, "artifact_load": 0.5, "read": 0.3, "decode": 2.0, "inference": 2.5,
              "pipeline": 3.0, "write": 0.01, "total": 5.2}
    parts = report_html.stage_parts(stages)
    assert [p for p, _ in parts] == ["imports", "artifact_load", "pipeline", "write", "other"]
    assert sum(v for _, v in parts) == pytest.approx(5.2)


def test_unknown_timeline_stage_gets_its_own_lane():
    run = {"index": 1, "wall_s": 2.0, "timing_report": {"timeline": [
        {"stage": "read", "batch": 0, "start": 0.1, "end": 0.2},
        {"stage": "decode", "batch": 0, "start": 0.2, "end": 0.5}]}}
    svg = report_html.timeline_svg(run)
    assert ">read<" in svg and ">decode<" in svg and ">inference<" not in svg


def test_render_cli_rewrites_report(tmp_path):
    path = tmp_path / "disclosure.json"
    disclosure.write(disclosure.build(facts()), path)
    assert campaign.main(["render", str(path)]) == 0
    assert (tmp_path / "report.html").read_text() == report_html.render(json.loads(path.read_text()))


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium not installed (scripts/test.sh installs it when "
                    "INSTALL_SYSTEM_PACKAGES=1 or CI=true)")
def test_headless_chromium_renders_without_console_errors(tmp_path):
    page = tmp_path / "report.html"
    page.write_text(report_html.render(disclosure.build(facts(fail_last=True))))
    shot = tmp_path / "shot.png"
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
           f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert shot.is_file() and shot.stat().st_size > 20_000, proc.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page_lines = [ln for ln in proc.stderr.splitlines() if "report.html" in ln or "CONSOLE" in ln]
    assert not [ln for ln in page_lines if "Uncaught" in ln or "ERROR:CONSOLE" in ln], page_lines
