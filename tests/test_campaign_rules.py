"""Evidence rules with fake runners: coverage, generated data and model, declared datasets,
interrupted and crashed attempts, no aggregate for an invalid attempt, bundling, the evidence
digest, and the measured conditions (CPU, no model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_campaign import REPO, make_prepared, make_source_repo, max_args, write_config

from evaluator.evidence import campaign, conditions, disclosure, sha256_manifest
from evaluator.evidence.runs import PROFILES
from evaluator.evidence.workloads import WORKLOADS, eva02

AGGREGATES = ("median", "mean", "min", "max", "range", "stdev", "cv")


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """setup(rows=24, **runner config) -> (prepared dir, source repo)."""
    def make(rows: int = 24, **cfg):
        prepared = make_prepared(tmp_path / "prepared", rows)
        source = make_source_repo(tmp_path / "src")
        config = write_config(tmp_path / "fake.json", prepared, **cfg)
        monkeypatch.setenv("FAKE_RUNNER_CONFIG", str(config))
        return prepared, source

    return make


def load(out: Path) -> dict:
    return json.loads((out / "disclosure.json").read_text())


def tsv_reference(prepared: Path, keep) -> Path:
    """A request_id<TAB>class reference naming only the manifest rows i for which keep(i)."""
    ids = [line.split("\t")[0] for line in (prepared / "cohort" / "manifest.tsv").read_text().splitlines()]
    classes = np.fromfile(prepared / "reference.i32", "<i4")
    path = prepared / "reference.tsv"
    path.write_text("".join(f"{rid}\t{classes[i]}\n" for i, rid in enumerate(ids) if keep(i)))
    return path


def with_reference(args: list[str], reference: Path) -> list[str]:
    args = list(args)
    args[args.index("--reference") + 1] = str(reference)
    return args


# ---------------------------------------------------------------- coverage and the gate


def test_max_with_one_row_unanswered_passes_the_gate_but_is_not_promoted(setup, tmp_path):
    prepared, source = setup(rows=200, sleeps=[0.5])
    ref = tsv_reference(prepared, lambda i: i != 17)  # 199 of 200 rows answered; threshold 198
    out = tmp_path / "out"
    assert campaign.main(with_reference(max_args(prepared, source, out), ref)) == 0  # valid attempt
    doc = load(out)
    assert doc["attempt"]["valid"] is True and doc["quality"]["matches"] == [199] * 5
    assert doc["quality"]["totals"] == [200] * 5 and doc["quality"]["thresholds"] == [198] * 5
    assert doc["dataset"]["coverage"]["complete"] is False
    assert doc["promotion"]["promoted"] is False
    assert "incomplete coverage: 199 of 200 manifest rows answered by the reference (reference.tsv)" in \
        doc["promotion"]["reasons"]
    assert doc["quality"]["label"] == "not a result (campaign not promoted)"


def test_max_with_answers_for_10_of_64_rows_fails_every_gate_and_shows_no_aggregate(setup, tmp_path, capsys):
    prepared, source = setup(rows=64)
    ref = tsv_reference(prepared, lambda i: i < 10)
    out = tmp_path / "out"
    assert campaign.main(with_reference(max_args(prepared, source, out), ref)) == 1
    doc = load(out)
    assert doc["failed_runs"][0]["reason"] == ("gate failed: agreement 10/64 < threshold 64 (99% of 64 rows); "
                                               "54 rows without a reference answer count as misses")
    assert doc["attempt"]["valid"] is False and doc["promotion"]["promoted"] is False
    assert not any(k in doc["primary_metric"] for k in AGGREGATES) and "aggregate" not in doc["quality"]
    got = capsys.readouterr()
    assert "attempt INVALID (run 1 failed: gate failed" in got.out and "median" not in got.out
    # progress on stderr: what is being prepared, and each run as it starts and as it ends
    assert "campaign: preparing the eva02-imagenet1k inputs" in got.err
    assert "campaign: run 1/" in got.err and ": started" in got.err and "FAILED" in got.err


def test_reference_answering_no_row_is_refused_before_any_run(setup, tmp_path, capsys):
    prepared, source = setup()
    ref = prepared / "other.tsv"
    ref.write_text("nobody\t1\nelse\t2\n")
    out = tmp_path / "out"
    assert campaign.main(with_reference(max_args(prepared, source, out), ref)) == 2
    assert "answers none of the 24 manifest rows" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("content, words", [("no tab here\n", "manifest.tsv:1: expected"), ("", "no rows")])
def test_a_bad_manifest_is_a_usage_error_not_a_recorded_crash(setup, tmp_path, capsys, content, words):
    prepared, source = setup()
    (prepared / "cohort" / "manifest.tsv").write_text(content)
    out = tmp_path / "out"
    assert campaign.main(max_args(prepared, source, out)) == 2
    lines = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("campaign: preparing")]
    assert len(lines) == 1 and lines[0].startswith("campaign: error: --manifest") and words in lines[0]   # one error line
    assert not out.exists()


def test_gate_that_saw_no_row_fails():
    assert eva02.gate_reason(0, 0).startswith("gate failed: agreement 0/0")
    assert eva02.aggregate_reasons([]) == ["aggregate gate failed: agreement 0/0 < threshold 0"]
    assert eva02.gate_reason(198, 200) is None and eva02.gate_reason(197, 200) is not None


@pytest.mark.parametrize("missing", [["--dataset-split"], ["--dataset-version"], ["--dataset-split",
                                                                                  "--dataset-version"]])
def test_max_requires_the_declared_dataset(setup, tmp_path, capsys, missing):
    prepared, source = setup()
    args = max_args(prepared, source, tmp_path / "out")
    for flag in missing:
        i = args.index(flag)
        del args[i:i + 2]
    assert campaign.main(args) == 2
    assert f"profile max requires {', '.join(missing)}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- generated data and model


def test_max_on_a_generated_cohort_is_never_promoted(setup, tmp_path):
    from evaluator.synthetic.cohort import write_generated_marker

    prepared, source = setup(sleeps=[0.5])
    marker = write_generated_marker(prepared / "cohort", "evaluator.synthetic.cohort", seed=0, count=24)
    out = tmp_path / "out"
    assert campaign.main(max_args(prepared, source, out)) == 0
    doc = load(out)
    assert doc["dataset"]["mode"] == "generated" and doc["dataset"]["mode_basis"].startswith("generated")
    assert doc["dataset"]["split"] == "test-split"  # declared, never defaulted
    assert doc["result_role"] == "functional" and doc["workload"]["roles"] == ["functional"]
    assert f"generated data: the kit's own cohort ({marker})" in doc["promotion"]["reasons"]
    assert doc["promotion"]["promoted"] is False and doc["quality"]["label"] == "functional check"
    assert all(r["quality"]["label"] == "functional check" for r in doc["runs"])


def test_max_with_the_generated_test_checkpoint_is_never_promoted(setup, tmp_path):
    from safetensors.numpy import save_file

    prepared, source = setup(sleeps=[0.5])
    ckpt = tmp_path / "tiny.safetensors"
    save_file({"w": np.zeros(2, np.float32)}, str(ckpt),
              metadata={"made_from": json.dumps("generated images (procedural renders); no ImageNet data")})
    am = prepared / "artifact" / "manifest.json"
    meta = json.loads(am.read_text())
    meta["checkpoint"] = {"path": str(ckpt), "sha256": sha256_manifest.sha256_file(ckpt), "bytes": ckpt.stat().st_size}
    am.write_text(json.dumps(meta))
    out = tmp_path / "out"
    assert campaign.main(max_args(prepared, source, out)) == 0
    doc = load(out)
    assert doc["model"]["checkpoint_made_from"].startswith("generated images")
    assert any(r.startswith("generated model: the source checkpoint is made from generated images")
               for r in doc["promotion"]["reasons"])
    assert doc["promotion"]["promoted"] is False and doc["result_role"] == "functional"


def test_generators_write_the_marker(tmp_path):
    from evaluator.evidence.runs import generated_markers
    from evaluator.synthetic.cir_corpus import make_corpus
    from evaluator.synthetic.cohort import GENERATED_MARKER, make_cohort

    make_cohort(tmp_path / "cohort", 3, broken=0)
    make_corpus(tmp_path / "corpus", templates=1, per_template=2, broken=0, requests=2)
    for d, generator in ((tmp_path / "cohort", "cohort"), (tmp_path / "corpus", "cir_corpus")):
        marker = json.loads((d / GENERATED_MARKER).read_text())
        assert marker["generator"] == f"evaluator.synthetic.{generator}" and "no real images" in marker["made_from"]
    assert generated_markers(tmp_path / "cohort", None, tmp_path) == [str(tmp_path / "cohort" / GENERATED_MARKER)]


def test_roles_of_min_and_generated_cases_are_functional_only():
    w = WORKLOADS["eva02-imagenet1k"]
    assert w.roles_for("min") == ("functional",) and w.roles_for("max", generated=True) == ("functional",)
    assert w.roles_for("max") == ("score-bearing", "performance-bearing")
    assert PROFILES["max"].required == ("dataset_split", "dataset_version")


# ---------------------------------------------------------------- interrupted and crashed attempts


@pytest.mark.abi
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_attempt_leaves_a_record(setup, tmp_path, sig):
    prepared, source = setup(sleeps=[0.05, 0.05, 60])
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "evaluator.campaign", *max_args(prepared, source, out)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
    deadline = time.monotonic() + 120
    while not (out / "runs" / "run-03" / "stdout.log").exists():  # run 3 is under way (it sleeps 60 s)
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr
    doc = load(out)
    name = signal.Signals(sig).name
    assert doc["attempt"]["valid"] is False and doc["attempt"]["interrupted"].startswith(f"stopped by {name}")
    assert doc["attempt"]["runs_completed"] == 2 and [r["index"] for r in doc["runs"]] == [1, 2]
    assert f"attempt interrupted: stopped by {name}" in " ".join(doc["promotion"]["reasons"])
    assert not any(k in doc["primary_metric"] for k in AGGREGATES)
    assert len(doc["primary_metric"]["values"]) == 2 and "aggregate" not in doc["quality"]
    assert "attempt INVALID (interrupted: stopped by" in stdout and "median" not in stdout
    html = (out / "report.html").read_text()
    assert "Invalid attempt</b>: interrupted: stopped by" in html and "median / min / max" not in html
    assert campaign.main(["verify", str(out / sha256_manifest.MANIFEST_NAME)]) == 0
    # the run that was under way was killed with its process group: nothing of it keeps running
    running = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(source / "scripts" / "run") not in running


def test_a_crash_of_the_campaign_is_recorded(setup, tmp_path, monkeypatch, capsys):
    prepared, source = setup()
    real = eva02.run_once
    calls = []

    def crashing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom in the judge")
        return real(*args, **kwargs)

    monkeypatch.setattr(eva02, "run_once", crashing)
    out = tmp_path / "out"
    assert campaign.main(max_args(prepared, source, out)) == 1
    doc = load(out)
    assert doc["attempt"]["interrupted"].startswith("the campaign crashed: RuntimeError: boom in the judge")
    assert doc["attempt"]["runs_completed"] == 1 and doc["attempt"]["valid"] is False
    assert not any(k in doc["primary_metric"] for k in AGGREGATES)
    assert "recording it as invalid" in capsys.readouterr().err
    assert campaign.main(["verify", str(out / sha256_manifest.MANIFEST_NAME)]) == 0


# ---------------------------------------------------------------- bundling and the evidence digest


def test_unbundled_artifact_is_listed_by_digest_and_rechecked_with_external(setup, tmp_path, capsys):
    prepared, source = setup(sleeps=[0.01])
    out = tmp_path / "out"
    campaign.main([*max_args(prepared, source, out, 2), "--bundle-limit-mb", "0"])
    doc = load(out)
    assert doc["bundle"]["bundled"] is False and doc["bundle"]["files"] == 2
    assert doc["bundle"]["rebuild"] == "python -m engine.build --model eva02_tiny_test --out artifact"
    manifest = json.loads((out / sha256_manifest.MANIFEST_NAME).read_text())
    assert {e["path"] for e in manifest["external"]} == {"manifest.json", "weights.bin"}
    assert not (out / "inputs" / "artifact").exists()
    capsys.readouterr()
    assert campaign.main(["verify", str(out / sha256_manifest.MANIFEST_NAME)]) == 0
    assert "2 external files listed by digest only" in capsys.readouterr().out
    assert campaign.main(["verify", str(out / sha256_manifest.MANIFEST_NAME), "--external", str(prepared / "artifact")]) == 0
    assert "2 external files match" in capsys.readouterr().out
    (prepared / "artifact" / "weights.bin").write_bytes(b"\x01" * 256)
    assert campaign.main(["verify", str(out / sha256_manifest.MANIFEST_NAME), "--external", str(prepared / "artifact")]) == 1
    assert "external weights.bin: changed (sha256 differs" in capsys.readouterr().err


def test_package_keeps_the_artifact_and_verifies_after_extraction(setup, tmp_path):
    prepared, source = setup(sleeps=[0.01])
    out = tmp_path / "out"
    campaign.main(max_args(prepared, source, out, 2))
    archive = tmp_path / "camp.tar.gz"
    assert campaign.main(["package", str(out), "--out", str(archive)]) == 0
    folder = sha256_manifest.extract(archive, tmp_path / "elsewhere")
    assert (folder / "inputs" / "artifact" / "weights.bin").read_bytes() == b"\x00" * 256
    assert sha256_manifest.verify(folder / sha256_manifest.MANIFEST_NAME).ok
    listed = {e["path"] for e in json.loads((folder / sha256_manifest.MANIFEST_NAME).read_text())["files"]}
    assert {"inputs/artifact/weights.bin", "inputs/artifact/manifest.json"} <= listed


def test_evidence_digest_is_recorded_beside_the_listing_and_checked(setup, tmp_path, capsys):
    prepared, source = setup(sleeps=[0.01])
    out = tmp_path / "out"
    campaign.main(max_args(prepared, source, out, 1))
    doc, manifest = load(out), json.loads((out / sha256_manifest.MANIFEST_NAME).read_text())
    assert doc["evidence"]["sha256"] == manifest["evidence_sha256"] == sha256_manifest.evidence_digest(out)
    assert manifest["listing_sha256"] == sha256_manifest.listing_sha256(manifest["files"])
    assert doc["evidence"]["sha256"] in (out / "report.html").read_text()
    # a disclosure edited to claim other evidence, then re-digested, still fails verify
    doc["evidence"]["sha256"] = "0" * 64
    disclosure.write(doc, out / "disclosure.json")
    for e in manifest["files"]:
        if e["path"] == "disclosure.json":
            e["sha256"], e["bytes"] = sha256_manifest.sha256_file(out / "disclosure.json"), (out / "disclosure.json").stat().st_size
    manifest["listing_sha256"] = sha256_manifest.listing_sha256(manifest["files"])
    (out / sha256_manifest.MANIFEST_NAME).write_text(json.dumps(manifest))
    assert campaign.main(["verify", str(out / sha256_manifest.MANIFEST_NAME)]) == 1
    assert "disclosure.json: records evidence sha256 " + "0" * 64 in capsys.readouterr().err
    # and a listing edited by hand no longer matches its own digest
    manifest["files"][0]["sha256"] = "1" * 64
    (out / sha256_manifest.MANIFEST_NAME).write_text(json.dumps(manifest))
    problems = sha256_manifest.verify(out / sha256_manifest.MANIFEST_NAME).problems
    assert any("listing_sha256 does not match its own listing" in p for p in problems)


# ---------------------------------------------------------------- conditions and scheduling


def fake_sys(root: Path, suspends: int = 4, throttle: int = 0) -> Path:
    files = {
        "sys/class/power_supply/AC/type": "Mains", "sys/class/power_supply/AC/online": "1",
        "sys/class/power_supply/BAT0/type": "Battery", "sys/class/power_supply/BAT0/status": "Charging",
        "sys/devices/system/cpu/cpu0/cpufreq/scaling_governor": "performance",
        "sys/devices/system/cpu/cpu1/cpufreq/scaling_governor": "performance",
        "sys/devices/system/cpu/cpu0/thermal_throttle/core_throttle_count": str(throttle),
        "sys/firmware/acpi/platform_profile": "balanced",
        "sys/power/suspend_stats/success": str(suspends),
        "sys/class/thermal/thermal_zone0/type": "x86_pkg_temp", "sys/class/thermal/thermal_zone0/temp": "45500",
        "proc/loadavg": "3.50 1.00 0.50 1/100 12345",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    return root


def test_conditions_are_measured_where_linux_exposes_them(tmp_path):
    before = conditions.snapshot(fake_sys(tmp_path / "a"), gpu=False)
    assert before["power_source"] == "mains (battery Charging)"
    assert before["power_policy"] == {"cpufreq_governors": {"performance": 2}, "platform_profile": "balanced"}
    assert before["suspend_count"] == 4 and before["throttle_events"] == 0
    assert before["thermal_zones"] == [{"zone": "thermal_zone0", "type": "x86_pkg_temp", "celsius": 45.5}]
    assert before["loadavg"] == [3.5, 1.0, 0.5]
    after = conditions.snapshot(fake_sys(tmp_path / "b", suspends=5, throttle=7), gpu=False)
    j = conditions.judge(before, after, "AC mains, performance governor")
    assert j["sleep"] == "the machine suspended 1 time(s) during the campaign"
    assert j["blocking"] == ["sleep: the machine suspended 1 time(s) during the campaign"]
    assert j["thermal"]["cpu_throttling"] == "7 CPU thermal throttle event(s) during the campaign"
    assert j["power"]["operator"] == "AC mains, performance governor"
    cores = before["usable_cores"]
    assert j["background_load"]["per_core"] == round(3.5 / cores, 3)
    assert j["background_load"]["judgement"].startswith("busy" if 3.5 / cores >= 0.25 else "quiet")


def test_conditions_say_not_measured_where_nothing_is_exposed(tmp_path):
    empty = conditions.snapshot(tmp_path, gpu=False)
    j = conditions.judge(empty, empty, None)
    assert j["power"]["source"] == "not measured" and j["sleep"] == "not measured"
    assert j["power"]["policy"] == {"cpufreq_governors": "not measured", "platform_profile": "not measured"}
    assert j["thermal"]["cpu_throttling"] == "not measured" and j["thermal"]["zones_before"] == "not measured"
    assert j["background_load"]["judgement"] == "not measured"
    assert j["power"]["operator"] == "not stated (set --power)" and j["blocking"] == []


def test_a_suspend_during_the_campaign_blocks_promotion():
    from test_report_html import CONDITIONS, facts

    f = facts()
    assert disclosure.build(f)["promotion"]["promoted"] is True
    f.conditions_after = CONDITIONS | {"suspend_count": CONDITIONS["suspend_count"] + 1}
    assert "conditions: sleep: the machine suspended 1 time(s) during the campaign" in \
        disclosure.build(f)["promotion"]["reasons"]


def test_power_flag_and_scheduling_are_disclosed(setup, tmp_path, monkeypatch):
    prepared, source = setup(sleeps=[0.01])
    monkeypatch.setenv("ENGINE_READERS", "3")
    monkeypatch.setenv("ENGINE_CUDA_GRAPHS", "0")
    out = tmp_path / "out"
    campaign.main([*max_args(prepared, source, out, 1), "--power", "wall power, governor performance"])
    doc = load(out)
    assert doc["conditions"]["power"]["operator"] == "wall power, governor performance"
    assert doc["scheduling"]["reader_threads"] == 3 and doc["scheduling"]["cuda_graphs"] is False
    assert doc["scheduling"]["decoder"] == "none"  # the fake run's own report says which decoder ran
    assert doc["scheduling"]["thread_budget"]["usable_cores"] >= 1


def test_a_bad_engine_setting_is_disclosed_not_a_traceback(monkeypatch):
    monkeypatch.setenv("ENGINE_READERS", "zero")
    sched = campaign.scheduling_environment()
    assert sched["reader_threads"].startswith("invalid: ") and "ENGINE_READERS" in sched["reader_threads"]
