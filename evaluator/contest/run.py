"""The contest ABI: MANIFEST IMAGE_ROOT OUTPUT -> one little-endian int32 per manifest row.

    scripts/run [MANIFEST [IMAGE_ROOT [OUTPUT]]] [--report FILE]   (python -m evaluator.contest.run)

Defaults come from CONTEST_MANIFEST / CONTEST_IMAGE_ROOT / CONTEST_OUTPUT, the artifact
from ENGINE_ARTIFACT (default artifacts/default), the timing report path from
CONTEST_REPORT (evaluator.settings, engine.settings). Nothing is printed on stdout; problems go to stderr. The output is
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


def _process_start() -> float:
    """Wall-clock second the process (or scripts/run, via ENGINE_T0) started."""
    from engine import settings

    try:
        t0 = settings.t0()
    except ValueError:
        t0 = None
    if t0 is not None:
        return t0
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

    from engine.io import write_atomic

    write_atomic(path, np.ascontiguousarray(top1, dtype="<i4").tobytes())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from engine import settings
    from engine.decoders import DECODERS
    from evaluator import settings as ev

    p = argparse.ArgumentParser(prog="scripts/run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("manifest", nargs="?", type=Path, default=ev.contest_manifest(), help="env CONTEST_MANIFEST")
    p.add_argument("image_root", nargs="?", type=Path, default=ev.contest_image_root(),
                   help="env CONTEST_IMAGE_ROOT")
    p.add_argument("output", nargs="?", type=Path, default=ev.contest_output(), help="env CONTEST_OUTPUT")
    p.add_argument("--report", type=Path, default=ev.contest_report(),
                   help="write the timing report JSON here (env CONTEST_REPORT)")
    p.add_argument("--artifact", type=Path, default=settings.artifact(), help="env ENGINE_ARTIFACT")
    p.add_argument("--decoder", default=settings.decoder(), choices=tuple(DECODERS),
                   help="env ENGINE_DECODER; default: the artifact's")
    p.add_argument("--readers", type=int, default=settings.readers(), help="file reader threads (env ENGINE_READERS)")
    p.add_argument("--depth", type=int, default=settings.pipeline_depth(),
                   help="decoded batches in flight ahead of inference; 0 = decode and infer in turn "
                        "(env ENGINE_PIPELINE_DEPTH)")
    a = p.parse_args(argv)
    if a.readers < 1 or a.depth < 0:
        p.error("--readers must be >= 1 and --depth >= 0")
    return a


def main(argv: list[str] | None = None) -> int:
    wall0 = _process_start()
    try:
        a = parse_args(argv)
    except ValueError as e:  # engine.settings.SettingsError: a bad environment value
        print(f"run: error: {e}", file=sys.stderr)
        return 2
    from evaluator.contest.manifest import ManifestError, read_manifest, resolve_image

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
    from engine.decoders import default_decoder, make_decoder
    from engine.pipeline import classify
    from engine.runtime import load_runtime

    t_imports = time.perf_counter()
    try:
        art = load_artifact(a.artifact)
        runtime = load_runtime(art)
    except (ArtifactError, RuntimeError, OSError) as e:
        print(f"run: error: cannot load artifact {a.artifact}: {e}", file=sys.stderr)
        return 2
    decoder_name = a.decoder or art.meta.get("decoder") or default_decoder(art.device)
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
    from engine import settings as _settings

    try:
        _fast = _settings.fast_exit()
    except ValueError:
        _fast = True
    if _fast:
        _exit_now(main())
    sys.exit(main())
