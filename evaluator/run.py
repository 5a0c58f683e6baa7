"""The contest ABI: MANIFEST IMAGE_ROOT OUTPUT -> one little-endian int32 per manifest row.

    python -m evaluator.run [MANIFEST [IMAGE_ROOT [OUTPUT]]] [--report FILE]

Defaults come from CONTEST_MANIFEST / CONTEST_IMAGE_ROOT / CONTEST_OUTPUT, the artifact
from ENGINE_ARTIFACT (default artifacts/default), the timing report path from
CONTEST_REPORT. Nothing is printed on stdout; problems go to stderr. The output is
written to a temporary file and renamed into place, so a crash never leaves a file
that looks complete.
"""
from __future__ import annotations

import time

_T_IMPORT = time.perf_counter()

import argparse  # noqa: E402 - the clock above times every import below
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

DEFAULTS = {
    "manifest": ("CONTEST_MANIFEST", "/contest/input/manifest.tsv"),
    "image_root": ("CONTEST_IMAGE_ROOT", "/contest/input/images"),
    "output": ("CONTEST_OUTPUT", "/contest/output/predictions.i32"),
}


def _process_start() -> float:
    """Wall-clock second the process (or scripts/run, via ENGINE_T0) started."""
    t0 = os.environ.get("ENGINE_T0")
    if t0:
        try:
            return float(t0)
        except ValueError:
            pass
    try:  # Linux: process start time from /proc, in clock ticks since boot
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - (time.perf_counter() - _T_IMPORT)


def write_predictions(path: Path, top1) -> None:
    """Atomically write int32 little-endian predictions (temp file in the same folder, fsync, rename)."""
    import numpy as np

    from evaluator.files import write_atomic

    write_atomic(path, np.ascontiguousarray(top1, dtype="<i4").tobytes())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/run", description=__doc__.split("\n\n")[0])
    for name, (env, default) in DEFAULTS.items():
        p.add_argument(name, nargs="?", type=Path, default=Path(os.environ.get(env, default)))
    p.add_argument("--report", type=Path, default=os.environ.get("CONTEST_REPORT") or None,
                   help="write the timing report JSON here (env CONTEST_REPORT)")
    p.add_argument("--artifact", type=Path, default=Path(os.environ.get("ENGINE_ARTIFACT", "artifacts/default")))
    p.add_argument("--decoder", default=None, help="pil | dali-cpu | dali-gpu (default: the artifact's)")
    p.add_argument("--readers", type=int, default=int(os.environ.get("ENGINE_READERS", "8")))
    p.add_argument("--depth", type=int, default=int(os.environ.get("ENGINE_PIPELINE_DEPTH", "2")),
                   help="decoded batches in flight ahead of inference; 0 = decode and infer in turn")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    wall0 = _process_start()
    a = parse_args(argv)
    from evaluator.manifest import ManifestError, read_manifest, resolve_image

    try:
        rows = read_manifest(a.manifest)
    except ManifestError as e:
        print(f"run: error: {e}", file=sys.stderr)
        return 2
    if not a.image_root.is_dir():
        print(f"run: error: IMAGE_ROOT is not a directory: {a.image_root}", file=sys.stderr)
        return 2
    if not a.output.parent.is_dir():
        print(f"run: error: OUTPUT folder does not exist: {a.output.parent}", file=sys.stderr)
        return 2

    import torch  # noqa: F401 - heavy import timed as part of "imports"

    from engine.artifact import ArtifactError, load_artifact
    from engine.decode import make_decoder
    from engine.pipeline import classify
    from engine.runtime import load_runtime

    t_imports = time.perf_counter()
    try:
        art = load_artifact(a.artifact)
        runtime = load_runtime(art)
    except (ArtifactError, RuntimeError, OSError) as e:
        print(f"run: error: cannot load artifact {a.artifact}: {e}", file=sys.stderr)
        return 2
    decoder_name = a.decoder or art.meta.get("decoder") or ("dali-gpu" if art.device == "cuda" else "dali-cpu")
    decoder = make_decoder(decoder_name, art.spec, art.batch_size)
    t_loaded = time.perf_counter()

    root = a.image_root

    def read(i: int) -> bytes:
        return resolve_image(root, rows[i].path).read_bytes()

    res = classify(read, len(rows), decoder, runtime, readers=a.readers, depth=a.depth)
    t_done = time.perf_counter()
    for i in sorted(res.failed):
        r = rows[i]
        print(f"run: row {r.line} ({r.request_id}, {r.path}): unreadable, predicted {res.top1[i]}: "
              f"{res.failed[i]}", file=sys.stderr)
    write_predictions(a.output, res.top1)
    t_end = time.perf_counter()

    if a.report:
        # perf_counter -> seconds since process start
        offset = (time.time() - time.perf_counter()) - wall0
        report = {
            "images": len(rows),
            "failed": len(res.failed),
            "backend": art.backend,
            "decoder": decoder.name,
            "precision": art.precision,
            "batch_size": art.batch_size,
            "device": str(runtime.device),
            "pipeline_depth": a.depth,
            "stages": {
                "imports": round(t_imports + offset, 4),
                "artifact_load": round(t_loaded - t_imports, 4),
                "read": round(res.stages.get("read", 0.0), 4),
                "decode": round(res.stages.get("decode", 0.0), 4),
                "inference": round(res.stages.get("inference", 0.0), 4),
                "pipeline": round(t_done - t_loaded, 4),
                "write": round(t_end - t_done, 4),
                "total": round(t_end + offset, 4),
            },
            "first_batch_s": round(res.first_batch_at + offset, 4) if res.first_batch_at else None,
            "images_per_s": round(len(rows) / max(t_done - t_loaded, 1e-9), 2),
            "timeline": [{**e, "start": round(e["start"] + offset, 4), "end": round(e["end"] + offset, 4)}
                         for e in res.timeline],
        }
        a.report.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _exit_now(code: int) -> None:
    """Flush and leave without interpreter teardown (torch/DALI finalizers cost seconds on the clock)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if os.environ.get("ENGINE_FAST_EXIT", "1") == "1":
        _exit_now(main())
    sys.exit(main())
