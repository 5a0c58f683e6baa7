"""timm's own batched FP32 pipeline, as a user would write it: a peer for the precision benchmark.

    python tests/bench/timm_batched.py MANIFEST IMAGE_ROOT OUTPUT --model NAME --checkpoint FILE
        [--input-size N] [--crop-mode squash|center] [--crop-pct F] [--model-kwargs JSON] [--batch-size 32]

PIL decode + timm's eval transform (resolve_data_config -> create_transform) in a torch
DataLoader (batch 32, workers 0), the timm model in FP32 eager; one int32 per manifest row
(-1 where PIL cannot read). Thread settings come from the environment the caller passes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="timm_batched.py")
    p.add_argument("manifest", type=Path)
    p.add_argument("image_root", type=Path)
    p.add_argument("output", type=Path)
    p.add_argument("--model", required=True)
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument("--input-size", type=int)
    p.add_argument("--crop-mode")
    p.add_argument("--crop-pct", type=float)
    p.add_argument("--model-kwargs", type=json.loads)
    p.add_argument("--batch-size", type=int, default=32)
    a = p.parse_args(argv)

    import numpy as np
    import torch
    from PIL import Image
    from timm.data import create_transform

    from engine.core.checkpoint import load_model
    from engine.core.spec import resolve_spec

    spec = resolve_spec(a.model, input_size=a.input_size, crop_mode=a.crop_mode, crop_pct=a.crop_pct,
                        model_kwargs=a.model_kwargs)
    model = load_model(spec, a.checkpoint).eval()
    tf = create_transform(input_size=(3, spec.input_size, spec.input_size), interpolation=spec.interpolation,
                          mean=spec.mean, std=spec.std, crop_pct=spec.crop_pct, crop_mode=spec.crop_mode)
    rows = [line.split("\t", 1)[1] for line in a.manifest.read_text().splitlines() if line]

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            try:
                with Image.open(a.image_root / rows[i]) as im:
                    return tf(im.convert("RGB")), True
            except Exception:  # noqa: BLE001 - unreadable: no answer, as the reference
                return torch.zeros(3, spec.input_size, spec.input_size), False

    out = np.full(len(rows), -1, np.int32)
    loader = torch.utils.data.DataLoader(Rows(), batch_size=a.batch_size, num_workers=0)
    lo = 0
    with torch.inference_mode():
        for x, ok in loader:
            top1 = model(x).argmax(-1).numpy().astype(np.int32)
            out[lo:lo + len(top1)] = np.where(ok.numpy(), top1, -1)
            lo += len(top1)
    out.astype("<i4").tofile(a.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
