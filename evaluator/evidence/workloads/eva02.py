"""The eva02-imagenet1k workload of the evidence campaign: its inputs, one timed run of the
contest ABI, its gate and its part of the disclosure.

The gate on real data (max/pro) is the contest's: at least ceil(0.99 N) exact top-1
matches over the N manifest rows, a row without a reference answer a miss. On the kit's
generated cohort (min) the kit's own reference path cannot read the cohort's deliberately
broken files, so the functional check counts the rows it answers (and says so).
"""

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
from evaluator.contest import agreement
from evaluator.evidence import sha256_manifest
from evaluator.evidence.runs import (
    MIN_COUNT,
    Prepared,
    RunArgs,
    RunRecord,
    UsageError,
    Workload,
    generated_markers,
    pick,
    process_failure,
    timed_run,
)

AGREEMENT_GATE = agreement.GATE   # the contest's gate, written once (evaluator.contest.agreement)


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
    all_rows: bool = True  # the contest gate over every row; False: the rows the reference answers


def manifest_rows(manifest: Path) -> list[tuple[str, str]]:
    """(request_id, relative path) per row, parsed by the contest's own manifest reader.

    A manifest it cannot parse is the user's mistake: UsageError naming the line."""
    from evaluator.contest.manifest import read_manifest

    try:
        return [(row.request_id, row.path) for row in read_manifest(manifest)]
    except (OSError, ValueError) as exc:
        raise UsageError(f"--manifest: {exc}") from exc


def load_reference(reference: Path, manifest: Path) -> np.ndarray:
    """Reference answers in manifest order (-1 = no answer): an .i32 file or a `request_id<TAB>class` TSV."""
    from evaluator.contest.agreement import read_reference

    return read_reference(reference, manifest, len(manifest_rows(manifest)))


def threshold(total: int) -> int:
    """Matches the gate needs: ceil(0.99 total)."""
    from evaluator.contest.agreement import threshold as contest_threshold

    return contest_threshold(total, AGREEMENT_GATE)


def check_predictions(path: Path, ref: np.ndarray, all_rows: bool = True) -> tuple[int, int, str | None]:
    """(matches, gate rows, problem) for an OUTPUT file: one int32 in [0, 999] per manifest row.

    all_rows: every manifest row counts and an unanswered one is a miss (the contest gate);
    else only the rows the reference answers count (generated cohorts)."""
    total = ref.size if all_rows else int((ref >= 0).sum())
    if not path.is_file():
        return 0, total, "no OUTPUT file was written"
    size = path.stat().st_size
    if size != 4 * ref.size:
        return 0, total, f"OUTPUT has {size} bytes, expected {4 * ref.size} (one int32 per row)"
    pred = np.fromfile(path, dtype="<i4")
    bad = int(((pred < 0) | (pred > 999)).sum())
    if bad:
        return 0, total, f"OUTPUT has {bad} values outside [0, 999]"
    from evaluator.contest.agreement import agreement, contest_gate

    res = contest_gate(pred, ref) if all_rows else agreement(pred, ref)
    return res.matches, (res.rows if all_rows else res.total), None


def gate_reason(matches: int, total: int, ref: np.ndarray | None = None, all_rows: bool = True) -> str | None:
    """Why matches of total fail the gate (a gate that saw no row fails), or None."""
    if total and matches >= threshold(total):
        return None
    misses = int((ref < 0).sum()) if ref is not None and all_rows else 0
    return (f"gate failed: agreement {matches}/{total} < threshold {threshold(total)} ({AGREEMENT_GATE:.0%} of "
            f"{total} {'rows' if all_rows else 'answered rows'})"
            + (f"; {misses} rows without a reference answer count as misses" if misses else ""))


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
    record.matches, record.total, problem = check_predictions(files["predictions"], ref, inputs.all_rows)
    record.reason = problem or gate_reason(record.matches, record.total, ref, inputs.all_rows)
    if record.reason:
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
    # its progress lines pass through to the campaign's stderr: a minute of preparation is not silent
    proc = subprocess.run(cmd, cwd=source_dir, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}): see its messages above")


DEMO_DIR = "demo"   # where `python -m evaluator.demo` writes by default (--out)


def prepared_demo(a: RunArgs) -> tuple[Path, dict] | None:
    """A finished demo folder to reuse, with its cohort record, or None: ./demo, else SOURCE_DIR/demo,
    holding cohort/, artifact/ and reference.i32 written after both (the demo writes its reference
    last, so an interrupted demo is not taken), of the campaign's --seed and, when --count is
    given, of that count."""
    for folder in dict.fromkeys((Path.cwd() / DEMO_DIR, a.source_dir / DEMO_DIR)):
        manifest, record = folder / "cohort" / "manifest.tsv", folder / "cohort" / "cohort.json"
        artifact, reference = folder / "artifact" / "manifest.json", folder / "reference.i32"
        if not all(p.is_file() for p in (manifest, record, artifact, reference)):
            continue
        try:
            cohort = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        if cohort.get("seed") != a.seed or (a.count is not None and cohort.get("count") != a.count):
            continue
        if reference.stat().st_mtime < max(manifest.stat().st_mtime, artifact.stat().st_mtime):
            continue
        return folder.resolve(), cohort
    return None


def prepared_inputs(prepared: Path, split: str) -> RunInputs:
    """RunInputs of a dir written by `python -m evaluator.demo prepare` (cohort/, artifact/, reference.i32)."""
    manifest = prepared / "cohort" / "manifest.tsv"
    for path in (manifest, prepared / "artifact" / "manifest.json", prepared / "reference.i32"):
        if not path.is_file():
            raise UsageError(f"{path}: missing from the prepared dir {prepared}")
    rows = manifest_rows(manifest)
    if not rows:
        raise UsageError(f"{manifest}: no rows")
    # Manifest paths are relative to the image root: cohort/images or cohort itself.
    roots = [prepared / "cohort" / "images", prepared / "cohort"]
    root = next((r for r in roots if (r / rows[0][1]).is_file()), None)
    if root is None:
        raise UsageError(f"{rows[0][1]}: not found under {roots[0]} nor {roots[1]}")
    return RunInputs(manifest, root, prepared / "reference.i32", prepared / "artifact", len(rows),
                     "generated", split, all_rows=False)


WORKLOAD = Workload(
    workload_id="eva02-imagenet1k",
    roles=("score-bearing", "performance-bearing"),
    abi="scripts/run MANIFEST IMAGE_ROOT OUTPUT (ENGINE_ARTIFACT, CONTEST_REPORT)",
    gate=f"at least ceil({AGREEMENT_GATE:g} N) exact top-1 matches with the reference answers over the N manifest "
         "rows (a row without a reference answer is a miss), in every run and in aggregate; on the kit's "
         "generated cohort (a functional check) over the rows its reference path answers",
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
        "artifact_tree": sha256_manifest.tree_digest(inputs.artifact)["sha256"],
    }


def checkpoint_origin(artifact_manifest: dict) -> dict:
    """The source checkpoint's digest and recorded origin (its safetensors `made_from`, when at hand)."""
    from evaluator.rehearsal.provenance import checkpoint_record

    meta = {**artifact_manifest, "checkpoint": artifact_manifest.get("checkpoint") or {}}
    try:
        rec = checkpoint_record(meta, None)
    except (OSError, ValueError, RuntimeError) as exc:  # a corrupt or unreadable checkpoint file
        rec = {"sha256": meta["checkpoint"].get("sha256"), "made_from": f"unreadable ({exc})"}
    made_from = rec.get("made_from")
    return {"sha256": rec.get("sha256") or artifact_manifest.get("checkpoint_sha256"),
            "path_in_manifest": rec.get("path_in_manifest"), "made_from": made_from,
            "generated": isinstance(made_from, str) and "generated" in made_from.lower()}


def resolve_inputs(a: RunArgs, tmp: Path) -> tuple[RunInputs, dict]:
    """The run inputs for the profile, plus the dataset record (mode, split, version from inputs and flags)."""
    if a.profile == "min":
        demo = prepared_demo(a) if a.prepared is None else None
        if demo is not None:
            a.prepared, cohort = demo
            print(f"campaign: reusing the prepared demo in {a.prepared} ({cohort.get('count')} generated images, "
                  f"seed {a.seed}, its artifact and reference; nothing is rebuilt); --count N generates another "
                  "cohort, --prepared DIR names another folder", file=sys.stderr, flush=True)
            split = f"generated:seed={a.seed},count={cohort.get('count')} (the prepared demo reused)"
        elif a.prepared is None:
            count = a.count if a.count is not None else MIN_COUNT
            a.prepared = tmp / "prepared"
            prepare_min(a.source_dir, a.prepared, count, a.seed)
            split = f"generated:seed={a.seed},count={count}"
        else:
            split = f"generated:prepared dir reused (declared seed={a.seed})"
        inputs = prepared_inputs(a.prepared, split)
        markers = generated_markers(inputs.manifest.parent, inputs.image_root, inputs.image_root.parent)
        return inputs, {"mode": "generated", "mode_basis": "min profile: the kit's generated cohort",
                        "split": split, "version": "evaluator.synthetic.cohort (this source tree)",
                        "rows": inputs.rows, "seed": a.seed, "canonical_seed": a.seed == 0,
                        "generated_markers": markers}
    for name in ("manifest", "reference"):
        if not getattr(a, name).is_file():
            raise UsageError(f"--{name} {getattr(a, name)}: not a file")
    for name in ("image_root", "artifact"):
        if not getattr(a, name).is_dir():
            raise UsageError(f"--{name.replace('_', '-')} {getattr(a, name)}: not a directory")
    rows = len(manifest_rows(a.manifest))
    if not rows:
        raise UsageError(f"--manifest {a.manifest}: no rows")
    inputs = RunInputs(a.manifest.resolve(), a.image_root.resolve(), a.reference.resolve(), a.artifact.resolve(),
                       rows, "real", a.dataset_split)
    markers = generated_markers(inputs.manifest.parent, inputs.image_root, inputs.image_root.parent)
    if markers:
        inputs.dataset_mode = "generated"
    basis = (f"generated: the kit's marker {markers[0]}" if markers else
             "user-supplied inputs without a generated-data marker; split and version as declared")
    return inputs, {"mode": inputs.dataset_mode, "mode_basis": basis, "split": a.dataset_split,
                    "version": a.dataset_version, "rows": rows, "generated_markers": markers}


def coverage(ref: np.ndarray, reference: Path) -> dict:
    """How many manifest rows the reference answers; a canonical result needs every one."""
    answered = int((ref >= 0).sum())
    return {"what": f"manifest rows answered by the reference ({reference.name})", "answered": answered,
            "rows": int(ref.size), "complete": answered == ref.size}


def prepare(a: RunArgs, tmp: Path) -> Prepared:
    """The campaign's inputs (min: generated into tmp), and how to digest, copy and run them."""
    inputs, dataset = resolve_inputs(a, tmp)
    am_path = inputs.artifact / "manifest.json"
    try:
        artifact_manifest = json.loads(am_path.read_text()) if am_path.is_file() else {}
    except json.JSONDecodeError as exc:
        raise UsageError(f"{am_path}: not JSON ({exc})") from exc
    try:
        ref = load_reference(inputs.reference, inputs.manifest)
    except ValueError as exc:
        raise UsageError(f"--reference {inputs.reference}: {exc}") from exc
    dataset["coverage"] = coverage(ref, inputs.reference)
    dataset["gate_rows"] = ("every manifest row; a row without a reference answer is a miss" if inputs.all_rows else
                            "the rows the kit's reference path answers (functional check on a generated cohort)")
    if not dataset["coverage"]["answered"]:
        raise UsageError(f"--reference {inputs.reference} answers none of the {inputs.rows} manifest rows "
                         "(do its request ids match the manifest's?)")
    origin = checkpoint_origin(artifact_manifest)
    if origin["generated"]:
        dataset["generated_model"] = f"the source checkpoint is made from {origin['made_from']}"
    build = artifact_manifest.get("build") or {}
    argv = build.get("argv") if isinstance(build.get("argv"), list) else None
    rebuild = ("python -m engine.build " + shlex.join(argv[1:])) if argv else "not recorded in the artifact manifest"
    return Prepared(inputs, dataset, ref, artifact_manifest, input_digests, input_copies(inputs), run_once,
                    bundle=(inputs.artifact, "inputs/artifact", rebuild))


def aggregate_reasons(ok: list[RunRecord]) -> list[str]:
    """Why the valid runs together fail the workload's aggregate gate (empty: they pass)."""
    matches, total = sum(r.matches for r in ok), sum(r.total for r in ok)
    if not total or matches < threshold(total):
        return [f"aggregate gate failed: agreement {matches}/{total} < threshold {threshold(total)}"]
    return []


def requested_device(artifact_manifest: dict) -> str | None:
    """The device the artifact was built for (the runs must execute there)."""
    return pick(artifact_manifest, "device", "spec.device")


def _run_entry(r: RunRecord, label: str) -> dict:
    t = r.timing or {}
    return {
        "index": r.index, "wall_s": r.wall_s, "exit_code": r.exit_code,
        "quality": {"label": label, "metric": "agreement", "matches": r.matches, "rows": r.total,
                    "agreement": r.matches / r.total if r.total else None},
        "files": r.files,
        "timing_report": {
            "stages": t.get("stages"), "timeline": t.get("timeline"), "images": t.get("images"),
            "images_per_s": t.get("images_per_s"), "backend": t.get("backend"), "decoder": t.get("decoder"),
            "precision": t.get("precision"), "batch_size": t.get("batch_size"), "device": t.get("device"),
            "first_batch_s": t.get("first_batch_s"), "failed_images": t.get("failed"),
        },
    }


def disclosure_parts(f, promoted: bool, label: str, valid: bool) -> dict:
    """quality, model, device, configuration and runs of an eva02-imagenet1k disclosure.

    label: how every quality-like figure is labelled; valid: False drops the aggregate."""
    ok = [r for r in f.runs if r.ok]
    first = (ok[0].timing if ok else None) or {}
    am = f.artifact_manifest
    matches, total = sum(r.matches for r in ok), sum(r.total for r in ok)
    origin = checkpoint_origin(am) if am else {}
    build = am.get("build") or {}
    quality = {
        "metric": "agreement", "label": label, "gate": AGREEMENT_GATE,
        "gate_rows": f.dataset.get("gate_rows"),
        "values": [r.matches / r.total for r in ok], "matches": [r.matches for r in ok],
        "totals": [r.total for r in ok], "thresholds": [threshold(r.total) for r in ok],
        "gate_passed": bool(ok) and valid and not aggregate_reasons(ok),
        "shown_as_quality": promoted,
    }
    if valid:
        quality["aggregate"] = matches / total if total else None
    return {
        "quality": quality,
        "model": {
            "name": pick(am, "spec.model", "model", "spec.name", "name"),
            "checkpoint_sha256": origin.get("sha256"),
            "checkpoint_made_from": origin.get("made_from"),
            "build_command": shlex.join(build["argv"]) if isinstance(build.get("argv"), list) else None,
            "artifact_manifest_sha256": f.digests_before.get("artifact_manifest"),
            "artifact_tree_sha256": f.digests_before.get("artifact_tree"),
        },
        "device": {"requested": pick(am, "device", "spec.device"), "executed": first.get("device"),
                   "backend": first.get("backend") or pick(am, "backend", "spec.backend")},
        "configuration": {
            "precision": first.get("precision") or pick(am, "precision", "spec.precision"),
            "compilation": pick(am, "backend", "spec.backend") or first.get("backend"),
            "batch_size": first.get("batch_size") or pick(am, "batch_size", "spec.batch_size", "spec.batch_sizes"),
            "runner": f.runner,
        },
        "scheduling": {
            "decoder": first.get("decoder") or f.scheduling.get("decoder"),
            "pipeline_depth": first.get("pipeline_depth", f.scheduling.get("pipeline_depth")),
            **{k: v for k, v in f.scheduling.items() if k not in ("decoder", "pipeline_depth")},
            "source": "the run's timing report where it says (decoder, pipeline depth), else the environment "
                      "the runs inherit, read through engine.settings",
        },
        "runs": [_run_entry(r, label) for r in ok],
    }
