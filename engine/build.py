"""The untimed preparation step: checkpoint -> artifact directory.

    python -m engine.build --model NAME --checkpoint FILE --out DIR [--device cpu|cuda]
        [--precision fp32|fp16|bf16] [--backend NAME] [--batch-size N]
        [--input-size N] [--crop-mode center|squash] [--crop-pct F] [--model-kwargs JSON]

The artifact is written into a temporary sibling directory and renamed into place, so
an interrupted build never leaves a directory that looks complete.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine import backends
from engine.artifact import write_manifest
from engine.checkpoint import load_model
from engine.io import sha256_file
from engine.spec import CROP_MODES, PRECISIONS, Spec, resolve_spec


def build(spec: Spec, checkpoint: Path | None, out: Path, backend: str = backends.DEFAULT,
          device: str = "cpu") -> dict:
    """Build the artifact for `spec` with `backend` (a name in engine.backends) and return its manifest."""
    be = backends.get(backend)
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda needs a CUDA GPU on the build machine")
    if checkpoint is None and be.NEEDS_WEIGHTS:
        raise ValueError(f"backend {backend} needs --checkpoint")
    t0 = time.perf_counter()
    net = load_model(spec, checkpoint) if be.NEEDS_WEIGHTS else None
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the run may be another (non-root) user
    try:
        extra = {"build": {"argv": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}}
        extra.update(be.save(net, spec, device, tmp))
        extra["build"]["seconds"] = round(time.perf_counter() - t0, 3)
        ck_sha = sha256_file(checkpoint) if checkpoint is not None else None
        meta = write_manifest(tmp, spec, backend, device, checkpoint, ck_sha, extra)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.replace(out, old / "a")
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="timm name, e.g. eva02_large_patch14_448.mim_m38m_ft_in22k_in1k")
    p.add_argument("--checkpoint", type=Path, help="local .safetensors / .pth / .bin (every backend but null needs one)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--backend", choices=tuple(backends.BACKENDS), default=backends.DEFAULT)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--input-size", type=int)
    p.add_argument("--crop-mode", choices=CROP_MODES)
    p.add_argument("--crop-pct", type=float)
    p.add_argument("--interpolation")
    p.add_argument("--num-classes", type=int)
    p.add_argument("--model-kwargs", type=json.loads, help="extra timm constructor kwargs as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        spec = resolve_spec(a.model, precision=a.precision, batch_size=a.batch_size, input_size=a.input_size,
                            crop_mode=a.crop_mode, crop_pct=a.crop_pct, interpolation=a.interpolation,
                            num_classes=a.num_classes, model_kwargs=a.model_kwargs)
        meta = build(spec, a.checkpoint, a.out, backend=a.backend, device=a.device)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"engine.build: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(a.out), "backend": meta["backend"], "device": meta["device"],
                      "precision": meta["precision"], "batch_size": meta["batch_size"],
                      "seconds": meta["build"]["seconds"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
