"""Workloads, roles and profiles of the evidence campaign, and one timed run of a workload.

A workload names what is run and how a run is judged (its gate). Its roles say what
its numbers may be used for; ROLE_RULES writes each role's rule down, and the rules
travel in every disclosure. A profile says what input a campaign runs on and whether
its result can ever be promoted.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROLE_RULES = {
    "score-bearing": "its quality metric may be reported as a result only from a promoted campaign; "
                     "every run must pass the workload's quality gate",
    "performance-bearing": "its wall time may be reported and ranked only from a promoted campaign: "
                           "five fresh processes, every gate passed, CV <= 5 %, one fingerprint, "
                           "clean tree at one git SHA, artifact digests preserved",
    "systems-only": "timed for engineering insight only; never ranked, never carries a quality claim",
    "deferred": "registered but not runnable yet; running it fails and says when it joins",
    "rejected": "not admissible as evidence; running it fails",
}

RESULT_ROLES = {
    "functional": "functional evidence on a generated input; never promoted, never shown as quality",
    "canonical": "canonical real-data contract; promotable when every promotion rule holds",
    "research": "real data under a declared research configuration; promotable, labelled research",
}

AGREEMENT_GATE = 0.99


class UsageError(Exception):
    """A campaign that cannot start as asked (exit status 2)."""


@dataclass(frozen=True)
class Workload:
    workload_id: str
    roles: tuple[str, ...]
    abi: str
    gate: str
    quality_metric: str
    rule: str = ""
    runnable: bool = True
    entry: str = "scripts/run"  # the ABI entry point of the source tree; any other runner is not promotable
    real_inputs: tuple[str, ...] = ()  # RunArgs fields the max/pro profiles require
    min_roles: tuple[str, ...] | None = None  # roles on the min profile, where they differ

    def roles_for(self, profile: str) -> tuple[str, ...]:
        """The roles this workload's numbers have on a profile."""
        return self.min_roles if profile == "min" and self.min_roles else self.roles


WORKLOADS = {
    "eva02-imagenet1k": Workload(
        workload_id="eva02-imagenet1k",
        roles=("score-bearing", "performance-bearing"),
        abi="scripts/run MANIFEST IMAGE_ROOT OUTPUT (ENGINE_ARTIFACT, CONTEST_REPORT)",
        gate=f"top-1 agreement with the reference answers >= {AGREEMENT_GATE:.0%} in every run and in aggregate",
        quality_metric="agreement",
        rule="contest ABI; wall time from process start to reaped exit, measured outside the process",
        real_inputs=("manifest", "image_root", "reference", "artifact"),
    ),
    "cir-retrieval": Workload(
        workload_id="cir-retrieval",
        roles=("score-bearing", "performance-bearing"),
        min_roles=("systems-only",),
        abi="scripts/run.sh --index-dir INDEX --queries QUERIES.jsonl --output OUT.jsonl --report REPORT.json "
            "(retrieval ABI; INDEX built beforehand by scripts/build.sh --corpus DIR --index-dir INDEX)",
        gate="run validity: exit status 0; one row per request, in request order; each row at most 50 "
             "distinct image ids, all in the index, the request's reference image excluded; scores finite "
             "and non-increasing",
        quality_metric="raw quality of evaluator.score_retrieval (equal-weight mean of CIRCO mAP@5/10/25/50 "
                       "and CIRR Recall@1/5/10/50) and its reward mapping, scored against the labels per run",
        rule="retrieval ABI. The gallery index is built once before the runs (scripts/build.sh: untimed "
             "preparation, part of no metric). One run = one fresh scripts/run.sh process answering every "
             "request into a fresh output file (never resumed from an earlier run's output), timed from "
             "process start to reaped exit outside the process; every run must pass the gate. min profile "
             "(generated corpus, tiny random CLIP): systems-only, its wall times are engineering insight and "
             "its quality number is a functional check, never shown as quality. max/pro profiles (a real "
             "index, its requests, labels and CLIP): score-bearing and performance-bearing, the raw quality "
             "and the wall time are results only from a promoted campaign.",
        entry="scripts/run.sh",
        real_inputs=("index_dir", "queries", "labels", "clip_dir"),
    ),
}


@dataclass(frozen=True)
class Profile:
    name: str
    dataset_mode: str  # generated | real (a real profile also requires its workload's real_inputs)
    result_role: str
    promotable: bool
    required: tuple[str, ...] = ()  # RunArgs fields required beyond the workload's inputs


PROFILES = {
    "min": Profile("min", "generated", "functional", promotable=False),
    "max": Profile("max", "real", "canonical", promotable=True),
    "pro": Profile("pro", "real", "research", promotable=True, required=("config_note",)),
}


@dataclass
class RunInputs:
    """What every run of one campaign reads: the same files for all N processes."""

    manifest: Path
    image_root: Path
    reference: Path
    artifact: Path
    rows: int
    dataset_mode: str
    split: str


@dataclass
class RunRecord:
    """One fresh OS process. wall_s is a result only when ok is True."""

    index: int
    ok: bool
    reason: str | None
    wall_s: float | None
    exit_code: int | None
    timed_out: bool
    matches: int | None
    total: int | None
    files: dict[str, str] = field(default_factory=dict)  # role -> path relative to OUT
    timing: dict | None = None
    quality: dict | None = None  # workloads scored per run (cir-retrieval): raw, reward, ...


def manifest_rows(manifest: Path) -> list[tuple[str, str]]:
    """(request_id, relative path) per row, parsed by the contest's own manifest reader."""
    from evaluator.manifest import read_manifest

    return [(row.request_id, row.path) for row in read_manifest(manifest)]


def load_reference(reference: Path, manifest: Path) -> np.ndarray:
    """Reference answers in manifest order (-1 = no answer): an .i32 file or a `request_id<TAB>class` TSV."""
    from evaluator.agreement import read_reference

    return read_reference(reference, manifest, len(manifest_rows(manifest)))


def check_predictions(path: Path, ref: np.ndarray) -> tuple[int, int, str | None]:
    """(matches, total, problem) for an OUTPUT file: one int32 in [0, 999] per manifest row."""
    if not path.is_file():
        return 0, ref.size, "no OUTPUT file was written"
    size = path.stat().st_size
    if size != 4 * ref.size:
        return 0, ref.size, f"OUTPUT has {size} bytes, expected {4 * ref.size} (one int32 per row)"
    pred = np.fromfile(path, dtype="<i4")
    bad = int(((pred < 0) | (pred > 999)).sum())
    if bad:
        return 0, ref.size, f"OUTPUT has {bad} values outside [0, 999]"
    from evaluator.agreement import agreement

    res = agreement(pred, ref)  # rows without a reference answer (-1) are left out
    return res.matches, res.total, None


def default_runner(source_dir: Path, entry: str = "scripts/run") -> list[str]:
    """The command of an ABI entry point (`scripts/run`, `scripts/run.sh`) of the source tree."""
    script = source_dir / entry
    return [str(script)] if os.access(script, os.X_OK) else ["bash", str(script)]


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the run's whole process group (scripts/run is a shell that starts Python)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        print(f"campaign: process group {proc.pid} already gone", file=sys.stderr)
    proc.wait()


def timed_run(cmd: list[str], cwd: Path, env: dict, stdout: Path, stderr: Path,
              timeout_s: float) -> tuple[int | None, float, bool]:
    """(exit status, wall seconds, timed out) of one fresh process group, timed from outside it."""
    timed_out = False
    with open(stdout, "wb") as so, open(stderr, "wb") as se:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=so, stderr=se,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
        except BaseException:  # Ctrl-C: leave no run behind, then stop the campaign
            _kill_group(proc)
            raise
        wall_s = time.perf_counter() - t0
    return proc.returncode, wall_s, timed_out


def process_failure(exit_code: int | None, timed_out: bool, timeout_s: float, stderr: Path) -> str | None:
    """Why a run's process failed (timeout, non-zero exit with the last stderr line), or None."""
    if timed_out:
        return f"timed out after {timeout_s:g} s (process group killed)"
    if exit_code != 0:
        tail = stderr.read_text(errors="replace").strip().splitlines()[-1:]
        return f"exit status {exit_code}" + (f": {tail[0][:200]}" if tail else "")
    return None


def run_once(index: int, runner: list[str], inputs: RunInputs, ref: np.ndarray, out: Path,
             source_dir: Path, timeout_s: float) -> RunRecord:
    """Run one fresh process under OUT/runs/run-NN, time it from outside, and judge it."""
    run_dir = out / "runs" / f"run-{index:02d}"
    run_dir.mkdir(parents=True)
    files = {
        "predictions": run_dir / "predictions.i32",
        "timing": run_dir / "timing.json",
        "stdout": run_dir / "stdout.log",
        "stderr": run_dir / "stderr.log",
    }
    env = {**os.environ, "ENGINE_ARTIFACT": str(inputs.artifact), "CONTEST_REPORT": str(files["timing"])}
    cmd = [*runner, str(inputs.manifest), str(inputs.image_root), str(files["predictions"])]
    exit_code, wall_s, timed_out = timed_run(cmd, source_dir, env, files["stdout"], files["stderr"], timeout_s)
    rel = {k: v.relative_to(out).as_posix() for k, v in files.items() if v.exists()}
    record = RunRecord(index, False, None, wall_s, exit_code, timed_out, None, None, rel)
    record.reason = process_failure(exit_code, timed_out, timeout_s, files["stderr"])
    if record.reason:
        return record
    record.matches, record.total, problem = check_predictions(files["predictions"], ref)
    if problem:
        record.reason = problem
        return record
    if record.matches < AGREEMENT_GATE * record.total:
        record.reason = f"gate failed: agreement {record.matches}/{record.total} < {AGREEMENT_GATE:.0%}"
        return record
    try:
        record.timing = json.loads(files["timing"].read_text())
    except FileNotFoundError:
        record.reason = "no timing report was written to CONTEST_REPORT"
        return record
    except json.JSONDecodeError as exc:
        record.reason = f"timing report is not JSON: {exc}"
        return record
    if not isinstance(record.timing, dict):
        record.reason = f"timing report is a JSON {type(record.timing).__name__}, expected an object"
        record.timing = None
        return record
    record.ok = True
    return record


def prepare_min(source_dir: Path, dest: Path, count: int, seed: int) -> None:
    """Write the deterministic generated input with `python -m evaluator.demo prepare`."""
    cmd = [sys.executable, "-m", "evaluator.demo", "prepare", "--out", str(dest), "--count", str(count),
           "--seed", str(seed)]
    proc = subprocess.run(cmd, cwd=source_dir, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-1000:]}")


def prepared_inputs(prepared: Path, split: str) -> RunInputs:
    """RunInputs of a dir written by `evaluator.demo prepare` (cohort/, artifact/, reference.i32)."""
    manifest = prepared / "cohort" / "manifest.tsv"
    for path in (manifest, prepared / "artifact" / "manifest.json", prepared / "reference.i32"):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing from the prepared dir {prepared}")
    rows = manifest_rows(manifest)
    if not rows:
        raise ValueError(f"{manifest}: no rows")
    # Manifest paths are relative to the image root: cohort/images or cohort itself.
    roots = [prepared / "cohort" / "images", prepared / "cohort"]
    root = next((r for r in roots if (r / rows[0][1]).is_file()), None)
    if root is None:
        raise FileNotFoundError(f"{rows[0][1]}: not found under {roots[0]} nor {roots[1]}")
    return RunInputs(manifest, root, prepared / "reference.i32", prepared / "artifact", len(rows),
                     "generated", split)
