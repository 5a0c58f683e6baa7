"""Precision x batch-size sweep of the contest path: build each artifact, run the ABI, judge it.

    python -m evaluator.sweep --model NAME --checkpoint FILE --manifest M.tsv --image-root DIR \\
        --reference ANSWERS.tsv|REF.i32 [--precisions fp32,bf16,fp16] [--batch-sizes 16,32,64] \\
        [--backend NAME] [--device cpu|cuda] [--out DIR] [--json FILE]

For every (precision, batch size): `python -m engine.build` (untimed; below fp32 guarded,
tau chosen by the build on its calibration images), then one `scripts/run` process timed
from outside, then agreement with the reference at the contest gate. Prints a table and
writes JSON. The verdict is evaluator.agreement's: the gate over the rows the reference
could read (a -1 in a reference .i32 is an image it could not read, such as the kit's
planted broken files: left out and counted apart); the contest's gate over all rows is
in the JSON as `gate_all_rows`. It is evaluation only: the reference answers are used to score, never to
choose anything; the sweep writes no tau and changes no artifact after its build.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOTE = ("evaluation only: the reference scores each artifact; nothing measured here feeds back into an "
        "artifact (tau is the build's, chosen on its calibration images)")


def _log(msg: str) -> None:
    print(f"sweep: {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from engine.cli import MAX_DEADLINE_S, ArgumentParser, HelpFormatter, debug_flag, finite_float

    p = debug_flag(ArgumentParser(prog="python -m evaluator.sweep", description=__doc__.split("\n\n")[0],
                                  formatter_class=HelpFormatter))
    p.add_argument("--model", required=True, help="timm name")
    p.add_argument("--checkpoint", required=True, type=Path, help="local .safetensors / .pth / .bin")
    p.add_argument("--manifest", required=True, type=Path, help="practice cohort manifest.tsv (id<TAB>path)")
    p.add_argument("--image-root", required=True, type=Path, help="folder the manifest's paths are relative to")
    p.add_argument("--reference", required=True, type=Path, help="practice answers (TSV) or a reference .i32")
    p.add_argument("--precisions", default="fp32,bf16",
                   help="comma-separated: fp32, bf16, fp16, fp8 (fp8: Hopper), auto (the build's own measured "
                        "choice, engine.tuning.autotune: built once, whatever --batch-sizes says)")
    p.add_argument("--batch-sizes", default="32", help="comma-separated static batch sizes")
    from engine.backends import BACKENDS

    p.add_argument("--backend", default=None, choices=tuple(BACKENDS), help="engine.backends name (default: the registry's)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where every build and run goes")
    p.add_argument("--out", type=Path, default=Path("sweep"), help="artifacts, predictions and reports go here")
    p.add_argument("--json", type=Path, default=None, help="also write the results JSON here (default: not written)")
    p.add_argument("--build-arg", action="append", default=[],
                   help="extra python -m engine.build argument (repeatable), e.g. --build-arg=--input-size=112")
    p.add_argument("--timeout-s", type=finite_float(0.0, MAX_DEADLINE_S, "s", lo_open=True), default=3600.0, help="per build and per run")
    a = p.parse_args(argv)
    a.precisions = [s.strip() for s in a.precisions.split(",") if s.strip()]
    try:
        a.batch_sizes = [int(s) for s in a.batch_sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--batch-sizes must be whole numbers, got {a.batch_sizes!r}")
    bad = [x for x in a.precisions if x not in ("fp32", "bf16", "fp16", "fp8", "auto")]
    if bad or not a.precisions:
        p.error(f"--precisions takes fp32, bf16, fp16, fp8, auto; got {bad or a.precisions}")
    if not a.batch_sizes or min(a.batch_sizes) < 1 or max(a.batch_sizes) > 4096:
        p.error("--batch-sizes must be whole numbers in 1..4096")
    for name in ("checkpoint", "manifest", "reference"):
        if not getattr(a, name).is_file():
            p.error(f"--{name} {getattr(a, name)}: not a file")
    if not a.image_root.is_dir():
        p.error(f"--image-root {a.image_root}: not a directory")
    for name in ("checkpoint", "manifest", "image_root", "reference", "out", "json"):  # the children run in REPO
        if getattr(a, name) is not None:
            setattr(a, name, getattr(a, name).resolve())
    return a


def run_one(a: argparse.Namespace, precision: str, batch: int, ref, unreadable, rows: int) -> dict:
    """Build, run and judge one configuration; a failed step is recorded, never raised."""
    from engine import backends
    from evaluator.contest.agreement import agreement, judge, read_i32

    tag = f"{precision}_b{batch}"
    art, pred, report = a.out / f"art_{tag}", a.out / f"pred_{tag}.i32", a.out / f"timing_{tag}.json"
    entry: dict = {"precision": precision, "batch_size": batch}
    cmd = [sys.executable, "-m", "engine.build", "--model", a.model, "--checkpoint", str(a.checkpoint),
           "--out", str(art), "--device", a.device, "--precision", precision,
           "--batch-size", "auto" if precision == "auto" else str(batch),
           "--backend", a.backend or backends.DEFAULT, *a.build_arg]
    _log(f"{tag}: building")
    t = time.perf_counter()
    b = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=a.timeout_s)
    entry["build_s"] = round(time.perf_counter() - t, 2)
    if b.returncode != 0:
        entry["error"] = f"build failed ({b.returncode}): {b.stderr.strip().splitlines()[-1:] or ''}"
        return entry
    meta = json.loads((art / "manifest.json").read_text())
    guard = meta.get("guard") or {}
    entry["tau"] = guard.get("tau")
    search = meta.get("build", {}).get("search")
    if search:   # the build's measurement (engine.tuning.autotune): what it chose, on which machine
        entry.update({"chosen": search["chosen"], "built": f"{meta['precision']} b{meta['batch_size']} "
                      f"{meta['backend']}", "measured_on": search["device"],
                      "candidates": search["candidates"]})
    _log(f"{tag}: running scripts/run on {rows} images")
    env = {**os.environ, "ENGINE_ARTIFACT": str(art), "CONTEST_REPORT": str(report)}
    t = time.perf_counter()
    r = subprocess.run([str(REPO / "scripts" / "run"), str(a.manifest), str(a.image_root), str(pred)], env=env,
                       cwd=REPO, capture_output=True, text=True, timeout=a.timeout_s)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        entry["error"] = f"scripts/run failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:] or ''}"
        return entry
    p = read_i32(pred, rows)
    v, agr = judge(p, ref, unreadable), agreement(p, ref)
    g, ga = v.judged, v.all_rows
    timing = json.loads(report.read_text()) if report.is_file() else {}
    gstats = (timing.get("runtime") or {}).get("guard") if isinstance(timing.get("runtime"), dict) else None
    entry.update({"wall_s": round(wall, 3), "images_per_s": round(rows / wall, 2),
                  "gate": {"matches": g.matches, "rows": g.rows, "threshold": g.threshold, "passed": g.passed,
                           "unreadable": v.unreadable},
                  "gate_all_rows": {"matches": ga.matches, "rows": ga.rows, "threshold": ga.threshold,
                                    "passed": ga.passed},
                  "agreement_answered": round(agr.matches / agr.total, 6) if agr.total else None,
                  "rechecked_fraction": gstats.get("fraction") if isinstance(gstats, dict) else None,
                  "timing_report": report.name})
    return entry


def table(results: list[dict]) -> str:
    head = f"{'precision':9} {'batch':>5} {'wall s':>8} {'img/s':>8} {'gate':>16} {'rechecked':>9} {'tau':>8}"
    lines = [head, "-" * len(head)]
    for e in results:
        if "error" in e:
            lines.append(f"{e['precision']:9} {e['batch_size']:>5} {e['error']}")
            continue
        g = e["gate"]
        gate = f"{g['matches']}/{g['rows']} {'PASS' if g['passed'] else 'FAIL'}"
        rf = "-" if e["rechecked_fraction"] is None else f"{100 * e['rechecked_fraction']:.1f}%"
        tau = "-" if e["tau"] is None else f"{e['tau']:.4f}"
        lines.append(f"{e['precision']:9} {e['batch_size']:>5} {e['wall_s']:>8.2f} {e['images_per_s']:>8.1f} "
                     f"{gate:>16} {rf:>9} {tau:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from engine.cli import debugging
    from engine.io import folder_refusal, mark_owned, marked
    from evaluator.contest.agreement import read_frozen_reference
    from evaluator.contest.manifest import ManifestError, read_manifest

    why = folder_refusal(a.out, "--out", lambda d: marked(d, "sweep"))
    if why:
        print(f"sweep: error: {why}", file=sys.stderr)
        return 2
    try:
        rows = len(read_manifest(a.manifest))
        ref, unreadable = read_frozen_reference(a.reference, a.manifest, rows)
    except (ManifestError, ValueError, OSError) as e:
        if debugging(a.debug):
            raise
        print(f"sweep: error: {e}", file=sys.stderr)
        return 2
    if unreadable.any():
        _log(f"{int(unreadable.sum())} rows the reference could not read (-1) are left out of the gate and "
             "counted apart (gate_all_rows in the JSON counts them as misses)")
    a.out.mkdir(parents=True, exist_ok=True)
    mark_owned(a.out, "sweep")
    results = [run_one(a, p, b, ref, unreadable, rows) for p in a.precisions
               for b in (a.batch_sizes[:1] if p == "auto" else a.batch_sizes)]
    doc = {"note": NOTE, "model": a.model, "device": a.device, "rows": rows, "results": results}
    print(table(results), file=sys.stderr)
    print(json.dumps(doc, indent=1))
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all("error" not in e for e in results) else 1
