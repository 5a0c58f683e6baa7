"""The naive FP32 reference path: PIL + timm eval transform + timm eager FP32, batch 1.

It is the ground truth for agreement and the baseline for every speed figure.

    python -m evaluator.reference MANIFEST IMAGE_ROOT OUTPUT --checkpoint FILE [--model NAME]
        [--input-size N] [--crop-mode center|squash] [--crop-pct F] [--model-kwargs JSON]

Without --model, the spec is the one the checkpoint records in its safetensors metadata
(the kit's generated checkpoints do: model, input size, crop, model kwargs); a flag given
overrides the recorded value.

OUTPUT holds one int32 per row; -1 marks an image the reference cannot read.

It runs with the kit's own thread settings, so every speed ratio against it is fair:
the thread budget of engine.threads (ENGINE_THREADS) sizes torch and OpenMP, and
OpenMP threads sleep between calls (OMP_WAIT_POLICY, default PASSIVE, as scripts/run
sets it), all set before torch loads: busy-waiting OpenMP threads cost an order of
magnitude on a shared machine.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

PROG = "python -m evaluator.reference"


def reference_top1(spec, checkpoint: Path, paths: list[Path | None], device: str = "cpu"):
    """int32 [N] top-1 of the FP32 eager model (engine.core.spec.Spec `spec`), one image at a time;
    -1 where PIL cannot read."""
    import numpy as np
    import torch

    from engine import settings
    from engine.classify.tf32_off import set_fp32_math
    from engine.core.checkpoint import load_model
    from engine.decoders.pil import reference_tensor
    from engine.io import read_regular
    from engine.progress import Progress

    max_bytes = settings.max_file_bytes()
    set_fp32_math()                     # IEEE FP32 on CUDA too (ENGINE_TF32=1 to match a TF32 reference)
    model = load_model(spec, checkpoint).to(device)
    out = np.full(len(paths), -1, np.int32)
    with torch.inference_mode(), Progress(len(paths), "reference", unit="images") as bar:
        for i, p in enumerate(paths):
            bar.update()
            if p is None:
                continue
            try:
                # regular files only: a FIFO or a device never blocks the reference
                x = reference_tensor(read_regular(p, max_bytes), spec)   # [3, S, S] float32
            except Exception:  # noqa: BLE001 - unreadable for the reference: no answer
                continue
            out[i] = int(model(x[None].to(device)).argmax(-1))
    return out


def thread_settings(device: str) -> dict:
    """The kit's thread budget for a `device` run, put in the environment before numpy / torch load
    (OpenMP sizes its pool and reads its wait policy then); returns what was set."""
    from engine import threads

    budget = threads.budget("cpu" if device == "cpu" else "cuda")
    env = threads.library_env(budget)
    os.environ.update(env)
    return {"budget": budget, "env": env}


def parse_args(argv: list[str] | None):
    from engine import settings
    from engine.cli import device_name, finite_float, json_object, parser, whole_number

    p = parser(PROG, __doc__.split("\n\n")[0], {
        **settings.env_help(("ENGINE_THREADS", "OMP_WAIT_POLICY", "ENGINE_MAX_FILE_BYTES", "ENGINE_PROGRESS",
                           "ENGINE_TF32")),
        "ENGINE_DEBUG": "1: tracebacks instead of one-line errors"})
    p.add_argument("manifest", type=Path, help="request_id<TAB>relative/path per row")
    p.add_argument("image_root", type=Path, help="folder the manifest paths are relative to")
    p.add_argument("output", type=Path, help="one little-endian int32 per row (-1: unreadable)")
    p.add_argument("--model", help="timm name (decides the spec); default: what the checkpoint records")
    p.add_argument("--checkpoint", required=True, type=Path, help="safetensors or torch state dict")
    recorded = "the checkpoint's record when --model is not given, else"
    p.add_argument("--input-size", type=whole_number(1, 8192, "px"), help=f"spec override: input size in px (default: {recorded} the model's)")
    p.add_argument("--crop-mode", choices=("center", "squash"),
                   help=f"spec override (default: {recorded} the model's)")
    p.add_argument("--crop-pct", type=finite_float(0.0, 1.0, lo_open=True), help=f"spec override: crop fraction (default: {recorded} the model's)")
    p.add_argument("--model-kwargs", type=json_object,
                   help=f"timm create_model kwargs as a JSON object (default: {recorded} none)")
    p.add_argument("--device", default="cpu", type=device_name, help="cpu, cuda or cuda:N (IEEE FP32 either way: TF32 off unless ENGINE_TF32=1)")
    return p.parse_args(argv)


def run(a) -> int:
    """Check every input before the model loads, then write the reference answers."""
    from engine import settings
    from engine.cli import UsageError

    t0 = time.perf_counter()
    settings.check(("threads", "readers", "omp_wait_policy", "max_file_bytes", "progress", "tf32"))
    threaded = thread_settings(a.device)      # before torch loads (engine.core.checkpoint imports it)
    from evaluator.contest.manifest import read_manifest, resolve_image

    # the inputs a user names are checked before torch loads: a mistake costs no import time
    rows = read_manifest(a.manifest)          # ManifestError names the file and line
    if not a.image_root.is_dir():
        raise UsageError(f"IMAGE_ROOT is not a directory: {a.image_root}")
    if not a.output.parent.is_dir():
        raise UsageError(f"OUTPUT folder does not exist: {a.output.parent}")
    if not a.checkpoint.is_file():
        raise UsageError(f"checkpoint not found: {a.checkpoint}")
    from engine.core.checkpoint import CheckpointError
    from engine.core.spec import resolve_spec
    from engine.threads import apply_torch
    from evaluator.contest.selfcheck import recorded_fields

    apply_torch(threaded["budget"])

    rec = recorded_fields(a.checkpoint) if a.model is None else {}
    if a.model is None and "model" not in rec:
        raise UsageError(f"--model is needed: {a.checkpoint} records no model in its metadata")
    pick = {k: getattr(a, k) if getattr(a, k) is not None else rec.get(k)
            for k in ("model", "input_size", "crop_mode", "crop_pct", "model_kwargs")}
    spec = resolve_spec(pick.pop("model"), **pick)
    paths: list[Path | None] = []       # None: a path outside IMAGE_ROOT, no answer
    for r in rows:
        try:
            paths.append(resolve_image(a.image_root, r.path))
        except ValueError:
            paths.append(None)
    try:
        top1 = reference_top1(spec, a.checkpoint, paths, a.device)
    except CheckpointError as e:
        raise UsageError(str(e)) from e
    top1.astype("<i4").tofile(a.output)
    from engine.classify.tf32_off import fp32_math

    print(json.dumps({"images": len(rows), "unreadable": int((top1 < 0).sum()), "fp32_math": fp32_math(),
                      "seconds": round(time.perf_counter() - t0, 3), "threads": threaded["env"]}), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from engine.cli import guard

    a = parse_args(argv)
    # ValueError: a malformed manifest (ManifestError) or a spec field timm's model cannot take
    return guard(PROG, lambda: run(a), errors=(ValueError,), debug=a.debug)


if __name__ == "__main__":
    sys.exit(main())
