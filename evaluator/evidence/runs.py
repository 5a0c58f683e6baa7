"""What every workload of the evidence campaign shares: roles, profiles, the campaign's
arguments, one run's record and one timed process.

A workload names what is run and how a run is judged (its gate). Its roles say what
its numbers may be used for; ROLE_RULES writes each role's rule down, and the rules
travel in every disclosure. A profile says what input a campaign runs on and whether
its result can ever be promoted. Each workload is one module of
evaluator.evidence.workloads with the same functions.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROLE_RULES = {
    "score-bearing": "its quality metric may be reported as a result only from a promoted campaign; "
                     "every run must pass the workload's quality gate",
    "performance-bearing": "its wall time may be reported and ranked only from a promoted campaign: "
                           "five fresh processes, every gate passed, CV <= 5 %, one fingerprint, "
                           "clean tree at one git SHA, artifact digests preserved",
    "systems-only": "timed for engineering insight only; never ranked, never carries a quality claim",
    "functional": "a functional check on the kit's own generated data: shows the code paths run and the "
                  "checks hold; its timings and quality-like figures are never results",
    "deferred": "registered but not runnable yet; running it fails and says when it joins",
    "rejected": "not admissible as evidence; running it fails",
}


RESULT_ROLES = {
    "functional": "functional evidence on a generated input; never promoted, never shown as quality",
    "canonical": "canonical real-data contract; promotable when every promotion rule holds",
    "research": "real data under a declared research configuration; promotable, labelled research",
}


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

    def roles_for(self, profile: str, generated: bool = False) -> tuple[str, ...]:
        """The roles this workload's numbers have on a profile: functional only on min or on
        generated data, whatever the profile."""
        fixed = PROFILES[profile].roles if profile in PROFILES else None
        return ("functional",) if generated else fixed or self.roles


@dataclass(frozen=True)
class Profile:
    name: str
    dataset_mode: str  # generated | real (a real profile also requires its workload's real_inputs)
    result_role: str
    promotable: bool
    required: tuple[str, ...] = ()  # RunArgs fields required beyond the workload's inputs
    roles: tuple[str, ...] | None = None  # the roles of every workload on this profile, where fixed


DECLARED = ("dataset_split", "dataset_version")  # a real profile's dataset is declared, never defaulted
PROFILES = {
    "min": Profile("min", "generated", "functional", promotable=False, roles=("functional",)),
    "max": Profile("max", "real", "canonical", promotable=True, required=DECLARED),
    "pro": Profile("pro", "real", "research", promotable=True, required=("config_note", *DECLARED)),
}


REPO_ROOT = Path(__file__).resolve().parents[2]
MIN_COUNT = 64   # min: generated images (cir: gallery) when --count is not given


@dataclass
class RunArgs:
    workload: str
    profile: str
    runs: int
    out: Path
    manifest: Path | None = None
    image_root: Path | None = None
    reference: Path | None = None
    artifact: Path | None = None
    index_dir: Path | None = None
    queries: Path | None = None
    labels: tuple[Path, ...] = ()
    clip_dir: Path | None = None
    config_note: str | None = None
    dataset_split: str | None = None
    dataset_version: str | None = None
    power: str | None = None  # the operator's statement of power source / policy where Linux exposes none
    bundle_limit_mb: float = 256.0  # artifact / index files bundled up to this size, else digests + rebuild command
    count: int | None = None  # None: MIN_COUNT, or (eva02 min) the prepared demo's cohort when one is there
    requests: int = 60
    seed: int = 0
    prepared: Path | None = None
    timeout_s: float = 1800.0
    runner: str | None = None
    source_dir: Path = REPO_ROOT
    attach: tuple[Path, ...] = ()
    require_promotion: bool = False


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
    total: int | None  # the gate's denominator (eva02: manifest rows, or answered rows on generated data)
    files: dict[str, str] = field(default_factory=dict)  # role -> path relative to OUT
    timing: dict | None = None
    quality: dict | None = None  # workloads scored per run (cir-retrieval): raw, reward, ...


@dataclass
class Prepared:
    """A workload's inputs for one campaign, and how to digest, copy and run them."""

    inputs: object                                  # the workload's own inputs record
    dataset: dict                                   # mode, split, rows, seed, ...
    judge: object                                   # what a run's output is judged against
    artifact_manifest: dict                         # the artifact's manifest.json / the index's meta.json
    digests: Callable[[object], dict[str, str]]     # inputs -> {name: sha256}, before and after the runs
    copies: dict[str, tuple[Path, str]]             # name -> (source file, path in OUT)
    run: Callable[..., RunRecord]                   # (index, runner, inputs, judge, out, source_dir, timeout_s)
    bundle: tuple[Path, str, str] | None = None     # (dir, path in OUT, rebuild command): the artifact / index
    scheduling: dict = field(default_factory=dict)  # what the runs' environment sets (readers, graphs, threads)


class Interrupted(BaseException):
    """SIGTERM (or SIGINT) stopped the campaign; like KeyboardInterrupt, not an Exception."""


def generated_markers(*dirs: Path | None) -> list[str]:
    """The generated-data markers (evaluator.synthetic writes one beside every cohort / corpus it
    makes) found in dirs, each checked once; None is skipped."""
    from evaluator.synthetic.cohort import GENERATED_MARKER

    seen, found = set(), []
    for d in dirs:
        if d is None:
            continue
        marker = Path(d) / GENERATED_MARKER
        if marker not in seen and marker.is_file():
            found.append(str(marker))
        seen.add(marker)
    return found


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


def pick(d: dict, *paths: str):
    """The first present value among dotted key paths (e.g. 'spec.model'), else None."""
    for path in paths:
        node = d
        for key in path.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            return node
    return None
