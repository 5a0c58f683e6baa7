"""The disclosure JSON: the authoritative record of one campaign, and its promotion rules.

Everything the HTML report shows is read from this JSON. Timing from a failed run is
never a result: failed runs sit in `failed_runs`, never in the metric values.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from evaluator.evidence.fingerprint import diff_keys, fingerprint_sha256
from evaluator.evidence.runs import RESULT_ROLES, ROLE_RULES, Profile, RunRecord, Workload, pick

SCHEMA = "campaign.disclosure/1"
MIN_RUNS = 5
CV_LIMIT = 0.05
NOTICE = (
    "Not an official MLPerf result. This evidence follows MLPerf-EDU-style rules "
    "(five fresh processes, every gate passed, CV <= 5 %, one comparison fingerprint, clean "
    "tree at one git SHA, SHA-256 manifest); it was not reviewed or audited by MLCommons."
)


@dataclass
class CampaignFacts:
    """Everything a campaign observed; build() turns it into the disclosure dict."""

    workload: Workload
    profile: Profile
    runs_requested: int
    runs: list[RunRecord]
    dataset: dict  # mode, split, rows, seed, count, and the copied input files
    digests_before: dict[str, str]  # name -> sha256 (manifest, reference, images, artifact tree)
    digests_after: dict[str, str]
    artifact_manifest: dict  # eva02: the engine artifact's manifest.json; cir-retrieval: the index's meta.json
    fingerprint_before: dict
    fingerprint_after: dict
    git_before: dict  # sha, dirty, error
    git_after: dict
    runner: list[str]
    runner_is_abi: bool
    timeout_s: float
    load_before: list[float] | None
    load_after: list[float] | None
    started_utc: str
    finished_utc: str
    config_note: str | None = None
    attachments: list[dict] = field(default_factory=list)


def summary(values: list[float]) -> dict:
    """n, values, median, mean, min, max, range, sample stdev and CV (stdev / mean) of values."""
    out: dict = {"n": len(values), "values": list(values)}
    if not values:
        return out | {k: None for k in ("median", "mean", "min", "max", "range", "stdev", "cv")}
    mean = statistics.mean(values)
    stdev = statistics.stdev(values) if len(values) > 1 else None
    return out | {
        "median": statistics.median(values), "mean": mean, "min": min(values), "max": max(values),
        "range": max(values) - min(values), "stdev": stdev,
        "cv": stdev / mean if stdev is not None and mean > 0 else None,
    }


def _device_kind(device: str | None) -> str | None:
    return device.split(":")[0].lower() if isinstance(device, str) else None


def _module(f: CampaignFacts):
    """The workload's module (evaluator.evidence.workloads): its gate and its disclosure parts."""
    from evaluator.evidence.workloads import MODULES

    return MODULES[f.workload.workload_id]


def promotion_reasons(f: CampaignFacts) -> list[str]:
    """Every reason the campaign cannot be promoted; empty means promoted."""
    reasons = []
    if not f.profile.promotable:
        reasons.append(f"not-promotable: {f.profile.name} profile")
    ok = [r for r in f.runs if r.ok]
    reasons += [f"attempt invalidated: run {r.index} failed: {r.reason}" for r in f.runs if not r.ok]
    if len(ok) < f.runs_requested:
        reasons.append(f"only {len(ok)} of {f.runs_requested} requested runs are valid")
    if f.runs_requested < MIN_RUNS:
        reasons.append(f"{f.runs_requested} runs requested; promotion needs {MIN_RUNS} fresh processes")
    reasons += _module(f).aggregate_reasons(ok)
    cv = summary([r.wall_s for r in ok])["cv"]
    if cv is None:
        reasons.append("timing CV undefined (fewer than 2 valid runs)")
    elif cv > CV_LIMIT:
        reasons.append(f"timing CV {cv:.4f} > {CV_LIMIT}")
    changed = diff_keys(f.fingerprint_before, f.fingerprint_after)
    if changed:
        reasons.append(f"comparison fingerprint changed during the campaign: {', '.join(changed)}")
    if not f.git_before.get("sha"):
        reasons.append(f"source not bound to a git SHA: {f.git_before.get('error') or 'no SHA'}")
    elif f.git_before.get("sha") != f.git_after.get("sha"):
        reasons.append(f"git SHA changed during the campaign: {f.git_before['sha']} -> {f.git_after.get('sha')}")
    if f.git_before.get("dirty") or f.git_after.get("dirty"):
        reasons.append("source tree dirty (git status --porcelain is not empty)")
    for name in sorted(set(f.digests_before) | set(f.digests_after)):
        if f.digests_before.get(name) != f.digests_after.get(name):
            reasons.append(f"digest changed during the campaign: {name}")
    if not f.runner_is_abi:
        reasons.append(f"runner is not the contest ABI entry point {f.workload.entry}")
    executed = sorted({str(pick(r.timing or {}, "device")) for r in ok})
    backends = sorted({str(pick(r.timing or {}, "backend")) for r in ok})
    if len(executed) > 1:
        reasons.append(f"runs executed on different devices: {executed}")
    if len(backends) > 1:
        reasons.append(f"runs used different backends: {backends}")
    requested = _device_kind(_module(f).requested_device(f.artifact_manifest))
    if requested and len(executed) == 1 and _device_kind(executed[0]) != requested:
        reasons.append(f"executed device {executed[0]} differs from requested {requested}")
    return reasons


def _failed_entry(r: RunRecord) -> dict:
    # No wall_s: timing from a failed run is never reported.
    return {"index": r.index, "reason": r.reason, "exit_code": r.exit_code, "timed_out": r.timed_out,
            "files": r.files}


def build(f: CampaignFacts) -> dict:
    """The disclosure dict (write it with write())."""
    reasons = promotion_reasons(f)
    promoted = not reasons
    if not f.profile.promotable:
        status = f"not-promotable: {f.profile.name} profile"
    else:
        status = "promoted" if promoted else "not-promoted"
    ok = [r for r in f.runs if r.ok]
    parts = _module(f).disclosure_parts(f, promoted)
    return {
        "schema": SCHEMA,
        "notice": NOTICE,
        "workload": {"id": f.workload.workload_id, "roles": list(f.workload.roles_for(f.profile.name)),
                     "abi": f.workload.abi, "gate": f.workload.gate, "quality_metric": f.workload.quality_metric,
                     "rule": f.workload.rule},
        "role_rules": ROLE_RULES,
        "profile": f.profile.name,
        "mode": "inference", "phase": "full", "scenario": "offline",
        "result_role": f.profile.result_role,
        "result_role_rule": RESULT_ROLES[f.profile.result_role],
        "config_note": f.config_note,
        "promotion": {"status": status, "promoted": promoted, "reasons": reasons},
        "attempt": {"valid": len(ok) == f.runs_requested, "runs_requested": f.runs_requested,
                    "runs_started": len(f.runs), "timeout_s": f.timeout_s,
                    "rule": "one failed or timed-out process invalidates the attempt; runs are never replaced or retried"},
        "primary_metric": {"name": "wall_seconds", "unit": "s",
                           "measured": "process start to reaped exit, time.perf_counter outside the process"}
        | summary([r.wall_s for r in ok]),
        "quality": parts["quality"],
        "dataset": f.dataset,
        "digests": {"before": f.digests_before, "after": f.digests_after},
        "model": parts["model"],
        "device": parts["device"],
        "configuration": parts["configuration"],
        "system": {"fingerprint_sha256": fingerprint_sha256(f.fingerprint_before),
                   "fingerprint_after_sha256": fingerprint_sha256(f.fingerprint_after),
                   "fingerprint": f.fingerprint_before},
        "source": {"git_sha": f.git_before.get("sha"), "dirty": f.git_before.get("dirty"),
                   "git_sha_after": f.git_after.get("sha"), "dirty_after": f.git_after.get("dirty")},
        "load_notes": {"loadavg_before": f.load_before, "loadavg_after": f.load_after,
                       "power": "not measured"},
        "time": {"started_utc": f.started_utc, "finished_utc": f.finished_utc},
        "runs": parts["runs"],
        "failed_runs": [_failed_entry(r) for r in f.runs if not r.ok],
        "attachments": f.attachments,
    }


def write(disclosure: dict, path: Path) -> None:
    path.write_text(json.dumps(disclosure, indent=2, sort_keys=False) + "\n")
