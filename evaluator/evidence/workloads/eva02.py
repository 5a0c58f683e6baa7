"""The eva02-imagenet1k workload of the evidence campaign: its inputs, one timed run of the
contest ABI, its agreement gate and its part of the disclosure."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.io import sha256_file
from evaluator.evidence import provd
from evaluator.evidence.runs import (
    Prepared,
    RunArgs,
    RunRecord,
    UsageError,
    Workload,
    pick,
    process_failure,
    timed_run,
)

AGREEMENT_GATE = 0.99


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


def manifest_rows(manifest: Path) -> list[tuple[str, str]]:
    """(request_id, relative path) per row, parsed by the contest's own manifest reader."""
    from evaluator.contest.manifest import read_manifest

    return [(row.request_id, row.path) for row in read_manifest(manifest)]


def load_reference(reference: Path, manifest: Path) -> np.ndarray:
    """Reference answers in manifest order (-1 = no answer): an .i32 file or a `request_id<TAB>class` TSV."""
    from evaluator.contest.agreement import read_reference

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
    from evaluator.contest.agreement import agreement

    res = agreement(pred, ref)  # rows without a reference answer (-1) are left out
    return res.matches, res.total, None


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
    """RunInputs of a dir written by `evaluator.contest.demo prepare` (cohort/, artifact/, reference.i32)."""
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


WORKLOAD = Workload(
    workload_id="eva02-imagenet1k",
    roles=("score-bearing", "performance-bearing"),
    abi="scripts/run MANIFEST IMAGE_ROOT OUTPUT (ENGINE_ARTIFACT, CONTEST_REPORT)",
    gate=f"top-1 agreement with the reference answers >= {AGREEMENT_GATE:.0%} in every run and in aggregate",
    quality_metric="agreement",
    rule="contest ABI; wall time from process start to reaped exit, measured outside the process",
    real_inputs=("manifest", "image_root", "reference", "artifact"),
)


def images_sha256(inputs: RunInputs) -> str:
    """One digest of the cohort's images, in manifest order ('MISSING' for an absent file)."""
    from evaluator.contest.manifest import resolve_image

    h = hashlib.sha256()
    for rid, rel in manifest_rows(inputs.manifest):
        try:
            path = resolve_image(inputs.image_root, rel)
            digest = sha256_file(path) if path.is_file() else "MISSING"
        except ValueError:
            digest = "REFUSED"  # escapes the image root: the run refuses it too
        h.update(f"{rid}\t{rel}\t{digest}\n".encode())
    return h.hexdigest()


def input_copies(inputs: RunInputs) -> dict[str, tuple[Path, str]]:
    """name -> (source file, path in OUT) of the inputs copied into the evidence folder."""
    return {"cohort_manifest": (inputs.manifest, "inputs/manifest.tsv"),
            "reference": (inputs.reference, f"inputs/reference{inputs.reference.suffix}"),
            "artifact_manifest": (inputs.artifact / "manifest.json", "inputs/artifact_manifest.json")}


def input_digests(inputs: RunInputs) -> dict[str, str]:
    """Digests of everything every run reads; taken before and after the runs, they must match."""
    return {
        "cohort_manifest": sha256_file(inputs.manifest),
        "reference": sha256_file(inputs.reference),
        "images": images_sha256(inputs),
        "artifact_manifest": sha256_file(inputs.artifact / "manifest.json")
        if (inputs.artifact / "manifest.json").is_file() else "MISSING",
        "artifact_tree": provd.tree_digest(inputs.artifact)["sha256"],
    }


def resolve_inputs(a: RunArgs, tmp: Path) -> tuple[RunInputs, dict]:
    """The run inputs for the profile, plus the dataset record (seed/count for min)."""
    if a.profile == "min":
        if a.prepared is None:
            a.prepared = tmp / "prepared"
            prepare_min(a.source_dir, a.prepared, a.count, a.seed)
            split = f"generated:seed={a.seed},count={a.count}"
        else:
            split = f"generated:prepared dir reused (declared seed={a.seed})"
        inputs = prepared_inputs(a.prepared, split)
        return inputs, {"mode": "generated", "split": split, "rows": inputs.rows, "seed": a.seed,
                        "canonical_seed": a.seed == 0}
    for name in ("manifest", "reference"):
        if not getattr(a, name).is_file():
            raise UsageError(f"--{name} {getattr(a, name)}: not a file")
    for name in ("image_root", "artifact"):
        if not getattr(a, name).is_dir():
            raise UsageError(f"--{name.replace('_', '-')} {getattr(a, name)}: not a directory")
    split = a.split or "imagenet-1k-val"
    inputs = RunInputs(a.manifest.resolve(), a.image_root.resolve(), a.reference.resolve(), a.artifact.resolve(),
                       len(manifest_rows(a.manifest)), "real", split)
    return inputs, {"mode": "real", "split": split, "rows": inputs.rows}


def prepare(a: RunArgs, tmp: Path) -> Prepared:
    """The campaign's inputs (min: generated into tmp), and how to digest, copy and run them."""
    inputs, dataset = resolve_inputs(a, tmp)
    am_path = inputs.artifact / "manifest.json"
    artifact_manifest = json.loads(am_path.read_text()) if am_path.is_file() else {}
    return Prepared(inputs, dataset, load_reference(inputs.reference, inputs.manifest), artifact_manifest,
                    input_digests, input_copies(inputs), run_once)


def aggregate_reasons(ok: list[RunRecord]) -> list[str]:
    """Why the valid runs together fail the workload's aggregate gate (empty: they pass)."""
    matches, total = sum(r.matches for r in ok), sum(r.total for r in ok)
    if not total or matches < AGREEMENT_GATE * total:
        return [f"aggregate gate failed: agreement {matches}/{total} < {AGREEMENT_GATE:.0%}"]
    return []


def requested_device(artifact_manifest: dict) -> str | None:
    """The device the artifact was built for (the runs must execute there)."""
    return pick(artifact_manifest, "device", "spec.device")


def _run_entry(r: RunRecord) -> dict:
    t = r.timing or {}
    return {
        "index": r.index, "wall_s": r.wall_s, "exit_code": r.exit_code,
        "matches": r.matches, "total": r.total, "agreement": r.matches / r.total if r.total else None,
        "files": r.files,
        "timing_report": {
            "stages": t.get("stages"), "timeline": t.get("timeline"), "images": t.get("images"),
            "images_per_s": t.get("images_per_s"), "backend": t.get("backend"), "decoder": t.get("decoder"),
            "precision": t.get("precision"), "batch_size": t.get("batch_size"), "device": t.get("device"),
            "first_batch_s": t.get("first_batch_s"), "failed_images": t.get("failed"),
        },
    }


def disclosure_parts(f, promoted: bool) -> dict:
    """quality, model, device, configuration and runs of an eva02-imagenet1k disclosure."""
    ok = [r for r in f.runs if r.ok]
    first = (ok[0].timing if ok else None) or {}
    am = f.artifact_manifest
    matches, total = sum(r.matches for r in ok), sum(r.total for r in ok)
    return {
        "quality": {
            "metric": "agreement", "gate": AGREEMENT_GATE,
            "values": [r.matches / r.total for r in ok], "matches": [r.matches for r in ok],
            "totals": [r.total for r in ok], "aggregate": matches / total if total else None,
            "gate_passed": bool(total) and matches >= AGREEMENT_GATE * total and len(ok) == len(f.runs),
            "shown_as_quality": promoted,
        },
        "model": {
            "name": pick(am, "spec.model", "model", "spec.name", "name"),
            "checkpoint_sha256": pick(am, "checkpoint_sha256", "checkpoint.sha256", "spec.checkpoint_sha256"),
            "artifact_manifest_sha256": f.digests_before.get("artifact_manifest"),
            "artifact_tree_sha256": f.digests_before.get("artifact_tree"),
        },
        "device": {"requested": pick(am, "device", "spec.device"), "executed": first.get("device"),
                   "backend": first.get("backend") or pick(am, "backend", "spec.backend")},
        "configuration": {
            "precision": first.get("precision") or pick(am, "precision", "spec.precision"),
            "compilation": pick(am, "backend", "spec.backend") or first.get("backend"),
            "batch_size": first.get("batch_size") or pick(am, "batch_size", "spec.batch_size", "spec.batch_sizes"),
            "decoder": first.get("decoder"),
            "runner": f.runner,
        },
        "runs": [_run_entry(r) for r in ok],
    }
