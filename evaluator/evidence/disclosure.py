"""The disclosure JSON: the authoritative record of one campaign, and its promotion rules.

Everything the HTML report shows is read from this JSON. Timing from a failed run is
never a result: failed runs sit in `failed_runs`, never in the metric values. An invalid
attempt (a failed run, fewer runs than requested, an interruption or a crash of the
campaign) carries no median, range, CV or quality aggregate: only the raw values of the
runs that completed, labelled as an invalid attempt's.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from evaluator.evidence.fingerprint import diff_keys, fingerprint_sha256
from evaluator.evidence.runs import RESULT_ROLES, ROLE_RULES, Profile, RunRecord, Workload, pick

SCHEMA = "campaign.disclosure/2"
MIN_RUNS = 5
CV_LIMIT = 0.05
NOTICE = (
    "independent preview; not an official MLPerf result; not endorsed by MLCommons. This evidence "
    "follows MLPerf-EDU-style rules (five fresh processes, every gate passed, CV <= 5 %, one comparison "
    "fingerprint, clean tree at one git SHA, SHA-256 manifest); it was not reviewed or audited by MLCommons."
)
INVALID_VALUES = "invalid attempt: raw values of the runs that completed; no aggregate"
LABELS = {
    "functional": "functional check",  # min profile or generated data: never a result
    "result": "quality result",  # a promoted campaign
    "unpromoted": "not a result (campaign not promoted)",
}


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
    fingerprint_before: dict | None
    fingerprint_after: dict | None  # None when the attempt stopped before it was taken
    git_before: dict  # sha, dirty, error
    git_after: dict
    runner: list[str]
    runner_is_abi: bool
    timeout_s: float
    conditions_before: dict  # evaluator.evidence.conditions.snapshot()
    conditions_after: dict | None
    started_utc: str
    finished_utc: str
    config_note: str | None = None
    attachments: list[dict] = field(default_factory=list)
    interrupted: str | None = None  # why the attempt stopped early (a signal, a crash of the campaign)
    scheduling: dict = field(default_factory=dict)  # readers, CUDA graphs, thread budget the runs inherit
    operator_power: str | None = None  # --power
    evidence: dict = field(default_factory=dict)  # {sha256, covers}: the listing digest of the evidence files
    bundle: dict | None = None  # the artifact / index files: bundled, or their digests + rebuild command

    @property
    def generated(self) -> bool:
        """True when the inputs are the kit's own generated data (or its generated test checkpoint)."""
        return self.dataset.get("mode") == "generated" or bool(self.dataset.get("generated_model"))

    @property
    def valid(self) -> bool:
        """Every requested run started, completed and passed its gate; nothing stopped the attempt."""
        return (self.interrupted is None and len(self.runs) == self.runs_requested
                and all(r.ok for r in self.runs))


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
    if f.interrupted:
        reasons.append(f"attempt interrupted: {f.interrupted}")
    reasons += [f"attempt invalidated: run {r.index} failed: {r.reason}" for r in f.runs if not r.ok]
    if len(ok) < f.runs_requested:
        reasons.append(f"only {len(ok)} of {f.runs_requested} requested runs are valid")
    if f.runs_requested < MIN_RUNS:
        reasons.append(f"{f.runs_requested} runs requested; promotion needs {MIN_RUNS} fresh processes")
    reasons += _module(f).aggregate_reasons(ok) if ok else ["no run passed its gate"]
    reasons += data_reasons(f)
    cv = summary([r.wall_s for r in ok])["cv"]
    if cv is None:
        reasons.append("timing CV undefined (fewer than 2 valid runs)")
    elif cv > CV_LIMIT:
        reasons.append(f"timing CV {cv:.4f} > {CV_LIMIT}")
    if f.fingerprint_before is None or f.fingerprint_after is None:
        reasons.append("comparison fingerprint not taken before and after the runs")
    else:
        changed = diff_keys(f.fingerprint_before, f.fingerprint_after)
        if changed:
            reasons.append(f"comparison fingerprint changed during the campaign: {', '.join(changed)}")
    reasons += [f"conditions: {b}" for b in _conditions(f)["blocking"]]
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


def data_reasons(f: CampaignFacts) -> list[str]:
    """What about the inputs forbids a canonical result: generated data or model, partial
    reference coverage, a dataset split or version not declared."""
    d, reasons = f.dataset, []
    reasons += [f"generated data: the kit's own cohort ({m})" for m in d.get("generated_markers") or []]
    if d.get("generated_model"):
        reasons.append(f"generated model: {d['generated_model']}")
    cov = d.get("coverage")
    if cov and not cov.get("complete"):
        reasons.append(f"incomplete coverage: {cov['answered']} of {cov['rows']} {cov['what']}")
    for key in ("split", "version"):
        if not d.get(key):
            reasons.append(f"dataset {key} not declared (--dataset-{key})")
    return reasons


def _conditions(f: CampaignFacts) -> dict:
    from evaluator.evidence.conditions import judge

    return judge(f.conditions_before or {}, f.conditions_after, f.operator_power)


def quality_label(f: CampaignFacts, promoted: bool) -> str:
    """How every quality-like figure of the campaign is labelled."""
    if f.profile.name == "min" or f.generated:
        return LABELS["functional"]
    return LABELS["result"] if promoted else LABELS["unpromoted"]


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
    valid = f.valid
    label = quality_label(f, promoted)
    parts = _module(f).disclosure_parts(f, promoted, label, valid)
    role = "functional" if f.generated else f.profile.result_role
    walls = [r.wall_s for r in ok]
    primary = {"name": "wall_seconds", "unit": "s",
               "measured": "process start to reaped exit, time.perf_counter outside the process"}
    primary |= summary(walls) if valid else {"n": len(walls), "values": walls, "status": INVALID_VALUES}
    first_failure = next((f"run {r.index} failed: {r.reason}" for r in f.runs if not r.ok), None)
    fp = {"fingerprint_sha256": fingerprint_sha256(f.fingerprint_before) if f.fingerprint_before else None,
          "fingerprint_after_sha256": fingerprint_sha256(f.fingerprint_after) if f.fingerprint_after else None,
          "fingerprint": f.fingerprint_before}
    return {
        "schema": SCHEMA,
        "notice": NOTICE,
        "workload": {"id": f.workload.workload_id, "roles": list(f.workload.roles_for(f.profile.name, f.generated)),
                     "abi": f.workload.abi, "gate": f.workload.gate, "quality_metric": f.workload.quality_metric,
                     "rule": f.workload.rule},
        "role_rules": ROLE_RULES,
        "profile": f.profile.name,
        "mode": "inference", "phase": "full", "scenario": "offline",
        "result_role": role,
        "result_role_rule": RESULT_ROLES[role],
        "config_note": f.config_note,
        "promotion": {"status": status, "promoted": promoted, "reasons": reasons},
        "attempt": {"valid": valid, "runs_requested": f.runs_requested, "runs_started": len(f.runs),
                    "runs_completed": len(ok), "interrupted": f.interrupted,
                    "reason": None if valid else (f"interrupted: {f.interrupted}" if f.interrupted else first_failure
                                                  or f"only {len(ok)} of {f.runs_requested} runs completed"),
                    "timeout_s": f.timeout_s,
                    "rule": "one failed or timed-out process, or an interruption, invalidates the attempt; runs are "
                            "never replaced or retried; an invalid attempt shows no aggregate"},
        "primary_metric": primary,
        "quality": parts["quality"],
        "dataset": f.dataset,
        "digests": {"before": f.digests_before, "after": f.digests_after},
        "model": parts["model"],
        "device": parts["device"],
        "configuration": parts["configuration"],
        "scheduling": parts["scheduling"],
        "system": fp,
        "source": {"git_sha": f.git_before.get("sha"), "dirty": f.git_before.get("dirty"),
                   "git_sha_after": f.git_after.get("sha"), "dirty_after": f.git_after.get("dirty")},
        "conditions": _conditions(f),
        "evidence": f.evidence,
        "bundle": f.bundle,
        "time": {"started_utc": f.started_utc, "finished_utc": f.finished_utc},
        "runs": parts["runs"],
        "failed_runs": [_failed_entry(r) for r in f.runs if not r.ok],
        "attachments": f.attachments,
    }


def write(disclosure: dict, path: Path) -> None:
    path.write_text(json.dumps(disclosure, indent=2, sort_keys=False) + "\n")
