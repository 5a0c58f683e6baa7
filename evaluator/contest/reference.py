"""The naive FP32 reference path: PIL + timm eval transform + timm eager FP32, batch 1.

It is the ground truth for agreement and the baseline for every speed figure.

    python -m evaluator.reference MANIFEST IMAGE_ROOT OUTPUT --model NAME --checkpoint FILE
        [--input-size N] [--crop-mode center|squash] [--model-kwargs JSON]

OUTPUT holds one int32 per row; -1 marks an image the reference cannot read.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engine.checkpoint import load_model
from engine.decoders.pil import reference_tensor
from engine.spec import Spec, resolve_spec
from evaluator.contest.manifest import read_manifest, resolve_image


@torch.inference_mode()
def reference_top1(spec: Spec, checkpoint: Path, paths: list[Path | None], device: str = "cpu") -> np.ndarray:
    """int32 [N] top-1 of the FP32 eager model, one image at a time; -1 where PIL cannot read."""
    model = load_model(spec, checkpoint).to(device)
    out = np.full(len(paths), -1, np.int32)
    for i, p in enumerate(paths):
        if p is None:
            continue
        try:
            x = reference_tensor(p.read_bytes(), spec)   # [3, S, S] float32
        except Exception:  # noqa: BLE001 - unreadable for the reference: no answer
            continue
        out[i] = int(model(x[None].to(device)).argmax(-1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluator.reference", description=__doc__.split("\n\n")[0])
    p.add_argument("manifest", type=Path)
    p.add_argument("image_root", type=Path)
    p.add_argument("output", type=Path)
    p.add_argument("--model", required=True)
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument("--input-size", type=int)
    p.add_argument("--crop-mode")
    p.add_argument("--crop-pct", type=float)
    p.add_argument("--model-kwargs", type=json.loads)
    p.add_argument("--device", default="cpu", help="cpu or cuda (FP32 either way; TF32 left at torch's defaults)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    spec = resolve_spec(a.model, input_size=a.input_size, crop_mode=a.crop_mode, crop_pct=a.crop_pct,
                        model_kwargs=a.model_kwargs)
    rows = read_manifest(a.manifest)
    paths: list[Path | None] = []
    for r in rows:
        try:
            paths.append(resolve_image(a.image_root, r.path))
        except ValueError:
            paths.append(None)
    top1 = reference_top1(spec, a.checkpoint, paths, a.device)
    top1.astype("<i4").tofile(a.output)
    print(json.dumps({"images": len(rows), "unreadable": int((top1 < 0).sum()),
                      "seconds": round(time.perf_counter() - t0, 3)}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
