"""Generated ImageNet-like cohorts and a tiny EVA-02 whose logits look trained.

No ImageNet data is used anywhere: images are procedural renders of seeded "class
templates" (colour blobs, a background gradient and oriented stripes), and the tiny
model's head is built from the features of such renders, so predictions have many
distinct top-1 classes and real margins (a random head gives near-ties everywhere).

    python -m evaluator.cohort --out DIR [--count N] [--seed S] [--checkpoint]
"""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np

from engine.io import write_atomic
from engine.progress import Progress
from engine.tuning.renders import Template, render, templates

TINY_MODEL = "eva02_tiny_patch14_224"
TINY_KWARGS = {"depth": 4}
TINY_INPUT = 112  # 8 x 8 patches of 14 px: fast on two CPU cores
GENERATED_MARKER = "GENERATED.json"  # beside every generated cohort / corpus: evidence campaigns detect it


def write_generated_marker(out: Path, generator: str, **facts) -> Path:
    """Mark `out` as the kit's own generated data (never a real cohort) with a small JSON file."""
    path = out / GENERATED_MARKER
    path.write_text(json.dumps({"generator": generator, "made_from": "procedural renders; no real images",
                                **facts}, indent=1) + "\n")
    return path


def kit_made(folder: Path) -> bool:
    """`folder` holds what this kit generates: its GENERATED_MARKER, or the tiny checkpoint's recipe
    (make_tiny_checkpoint's JSON, which says it was made from generated images)."""
    if (folder / GENERATED_MARKER).is_file():
        return True
    try:
        recipe = json.loads((folder / "tiny_eva02.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(recipe, dict) and str(recipe.get("made_from", "")).startswith("generated images")


def claim_generated_folder(out: Path, what: str) -> None:
    """UsageError (nothing written) unless `out` may receive generated data: absent, empty, or
    already the kit's generated data (kit_made); engine.io.folder_refusal's other rules apply too
    (never `.`, the current directory, the project, a file)."""
    from engine.cli import UsageError
    from engine.io import folder_refusal

    why = folder_refusal(out, what, kit_made)
    if why:
        raise UsageError(why)


def encode(px: np.ndarray, rng: np.random.Generator, kind: str) -> tuple[bytes, str]:
    """JPEG bytes of `px` in one of the cohort's encodings; returns (bytes, description)."""
    from PIL import Image

    im = Image.fromarray(px)
    q = int(rng.integers(60, 97))
    opts: dict = {"quality": q}
    if kind == "gray":
        im = im.convert("L")
    elif kind == "cmyk":
        im = im.convert("CMYK")
    elif kind == "progressive":
        opts["progressive"] = True
    if kind in ("rgb", "progressive"):
        opts["subsampling"] = int(rng.choice([0, 1, 2]))  # 4:4:4, 4:2:2, 4:2:0
    buf = io.BytesIO()
    if kind == "png":
        im.save(buf, "PNG")  # PNG in disguise: named .JPEG, read by PIL all the same
    else:
        im.save(buf, "JPEG", **opts)
    return buf.getvalue(), f"{kind} q{q} sub{opts.get('subsampling', '-')}"


KINDS = ("rgb", "rgb", "rgb", "rgb", "rgb", "progressive", "gray", "cmyk", "png")
BROKEN = ("empty", "truncated", "text")


def class_ids(k: int, seed: int) -> np.ndarray:
    """The ImageNet-1k-sized label ids the `k` templates stand for (spread over 0..999)."""
    return np.random.default_rng(seed + 1).permutation(1000)[:k]


TEMPLATE_SEED = 0  # the "world" of classes: shared by every cohort and the tiny checkpoint's head


def _make_image(args: tuple) -> tuple[bytes, int, str]:
    """One cohort file from its own seeded stream: (bytes, template index, encoding)."""
    seed, i, count, broken, classes, template_seed = args
    rng = np.random.default_rng([seed, i])  # per image: the same cohort whatever the worker count
    t_idx = int(rng.integers(classes))
    t = templates(classes, template_seed)[t_idx]
    if i >= count - broken:
        kind = BROKEN[(count - 1 - i) % len(BROKEN)]
        return _broken(kind, t, rng), t_idx, f"broken:{kind}"
    w, h = (int(v) for v in rng.integers(150, 801, 2))
    data, desc = encode(render(t, w, h, rng), rng, str(rng.choice(KINDS)))
    return data, t_idx, desc


def make_cohort(out: Path, count: int, seed: int = 0, classes: int = 100, broken: int | None = None,
                template_seed: int = TEMPLATE_SEED, workers: int = 1) -> dict:
    """Write `out/images/...`, `out/manifest.tsv` and `out/cohort.json`; return the cohort record.

    `seed` draws the images; `template_seed` fixes the class templates, which must match the
    checkpoint's for its predictions to have trained-looking margins. `workers` > 1 renders
    in parallel processes (same bytes).
    """
    claim_generated_folder(out, "the cohort folder")
    rng = np.random.default_rng(seed)
    broken = max(1, count // 100) if broken is None else broken
    (out / "images").mkdir(parents=True, exist_ok=True)
    write_generated_marker(out, "evaluator.synthetic.cohort", seed=seed, count=count)   # first: an interrupted run's folder stays ours
    jobs = [(seed, i, count, broken, classes, template_seed) for i in range(count)]
    made = []
    with Progress(count, "cohort: rendering", unit="images") as bar:
        if workers > 1:
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(workers) as pool:
                for m in pool.map(_make_image, jobs, chunksize=16):
                    made.append(m)
                    bar.update()
        else:
            for j in jobs:
                made.append(_make_image(j))
                bar.update()
    rows, items = [], []
    for i, (data, c, desc) in enumerate(made):
        rid = f"{rng.integers(1 << 62):016x}"  # randomized request ids: order is by row, never by id
        rel = f"images/{i % 10:02d}/gen_{i:06d}.JPEG"
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
        rows.append(f"{rid}\t{rel}\n")
        items.append({"request_id": rid, "path": rel, "template": c, "encoding": desc})
    order = rng.permutation(count)  # broken files land anywhere in the manifest
    (out / "manifest.tsv").write_text("".join(rows[j] for j in order))
    record = {"seed": seed, "template_seed": template_seed, "count": count, "classes": classes,
              "made_from": "procedural renders; no real images", "items": [items[j] for j in order]}
    (out / "cohort.json").write_text(json.dumps(record, indent=1) + "\n")
    write_generated_marker(out, "evaluator.synthetic.cohort", seed=seed, count=count)
    return record


def broken_items(record: dict) -> list[dict]:
    """The cohort record's planted broken files (empty, truncated, not an image), in manifest order."""
    return [it for it in record["items"] if it["encoding"].startswith("broken:")]


def _broken(kind: str, t: Template, rng: np.random.Generator) -> bytes:
    if kind == "empty":
        return b""
    if kind == "text":
        return b"this is not an image\n" * 8
    data, _ = encode(render(t, 300, 200, rng), rng, "rgb")
    return data[: len(data) // 3]  # truncated mid-scan


def make_tiny_checkpoint(path: Path, seed: int = 0, classes: int = 100, renders: int = 12,
                         input_size: int = TINY_INPUT, steps: int = 300, template_seed: int = TEMPLATE_SEED,
                         model: str = TINY_MODEL, model_kwargs: dict | None = None, device: str = "cpu") -> dict:
    """An EVA-02 (the tiny test model by default) whose head is fit on generated renders.

    The backbone keeps its seeded random init; only the head is learned (softmax
    regression on whitened pooled features), which gives diverse top-1 classes with
    margins large against the pixel-level noise between decoders. `model`,
    `model_kwargs`, `input_size` and `device` make the same kind of checkpoint for the
    full-size EVA-02-L/448 on a GPU. Returns the build recipe.
    """
    import torch
    from PIL import Image

    from engine.core.checkpoint import create_model
    from engine.core.spec import resolve_spec
    from engine.decoders.pil import _timm_transform

    torch.manual_seed(seed)
    kwargs = TINY_KWARGS if model_kwargs is None else model_kwargs
    spec = resolve_spec(model, input_size=input_size, crop_pct=1.0, crop_mode="squash", model_kwargs=kwargs)
    net = create_model(spec).to(device)
    tf = _timm_transform(spec.to_json(), True)
    rng = np.random.default_rng(seed + 2)
    xs, ys = [], []
    with Progress(classes * renders, "tiny EVA-02: rendering the head's training images", unit="images") as bar:
        for c, t in enumerate(templates(classes, template_seed)):
            for _ in range(renders):
                w, h = (int(v) for v in rng.integers(150, 500, 2))
                xs.append(tf(Image.fromarray(render(t, w, h, rng))))
                ys.append(c)
                bar.update()
    with torch.inference_mode():
        feats = torch.cat([net.forward_head(net.forward_features(torch.stack(xs[i:i + 64]).to(device)),
                                            pre_logits=True).float().cpu()
                           for i in range(0, len(xs), 64)])    # [K * R, D]
    y = torch.as_tensor(ys)
    mu, sd = feats.mean(0), feats.std(0) + 1e-6                # whiten: random features are anisotropic
    z = (feats - mu) / sd
    lin = torch.nn.Linear(z.shape[1], classes)
    opt = torch.optim.Adam(lin.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(lin(z), y) + 1e-4 * lin.weight.square().sum()
        loss.backward()
        opt.step()
    with torch.no_grad():
        w_k = lin.weight / sd                                  # fold the whitening into the head
        b_k = lin.bias - (w_k * mu).sum(-1)
        weight = torch.randn(1000, z.shape[1]) * 1e-3          # unused classes: small rows, low bias
        bias = torch.full((1000,), float(b_k.min()) - 10.0)
        ids = torch.as_tensor(class_ids(classes, template_seed))
        weight[ids], bias[ids] = w_k, b_k
        net.head.weight.copy_(weight)
        net.head.bias.copy_(bias)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the spec it was fit with, in its metadata: build.sh builds for it when no ENGINE_MODEL is given
    recipe = {"model": model, "model_kwargs": kwargs, "input_size": input_size, "crop_mode": "squash",
              "crop_pct": 1.0, "seed": seed,
              "template_seed": template_seed,
              "classes": classes, "fit_loss": round(loss.item(), 4),
              "made_from": "generated images (procedural renders); no ImageNet data"}
    write_atomic(path, safetensors_bytes({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()},
                                         {k: json.dumps(v, sort_keys=True) for k, v in recipe.items()}))
    path.with_suffix(".json").write_text(json.dumps(recipe, indent=2) + "\n")
    return recipe


def safetensors_bytes(tensors: dict, metadata: dict[str, str]) -> bytes:
    """A safetensors file with its metadata keys sorted, so equal inputs give equal bytes.

    safetensors writes `__metadata__` in hash-map order, which changes from process to
    process; the header is JSON (8-byte little-endian length, then the JSON padded with
    spaces to 8 bytes) and tensor offsets count from its end, so it can be rewritten.
    """
    from safetensors.torch import save

    blob = save(tensors, metadata=metadata)
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])                      # dict: keeps the tensors' order
    header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + blob[8 + n:]


def main(argv: list[str] | None = None) -> int:
    from engine.cli import SEED, guard, parser, whole_number

    p = parser("python -m evaluator.cohort", __doc__.split("\n\n")[0], {"ENGINE_PROGRESS": "auto, bar, lines or off"})
    p.add_argument("--out", type=Path, required=True, help="folder for images/, manifest.tsv and cohort.json")
    p.add_argument("--count", type=whole_number(1, 10**7, "images"), default=200, help="images, broken ones included")
    p.add_argument("--seed", type=SEED, default=0, help="draws the images; the same seed gives the same bytes")
    p.add_argument("--classes", type=whole_number(1, 1000), default=100, help="class templates")
    p.add_argument("--broken", type=whole_number(0, 10**7, "images"), help="planted broken files among --count (default 1 %%, at least 1)")
    p.add_argument("--checkpoint", action="store_true", help="also write OUT/tiny_eva02.safetensors")
    a = p.parse_args(argv)
    if a.count < 1 or not 1 <= a.classes <= 1000:
        p.error("--count must be >= 1 and --classes in 1..1000")
    if a.broken is not None and not 0 <= a.broken < a.count:
        p.error(f"--broken must be in 0..{a.count - 1} (at least one readable image)")

    def body() -> int:
        from engine import settings

        settings.check(("progress",))    # before anything is created: a refusal leaves no folder behind
        make_cohort(a.out, a.count, a.seed, a.classes, a.broken)
        if a.checkpoint:
            make_tiny_checkpoint(a.out / "tiny_eva02.safetensors", a.seed, a.classes)
        print(json.dumps({"out": str(a.out), "count": a.count}), file=sys.stderr)
        return 0

    return guard("python -m evaluator.cohort", body, debug=a.debug)


if __name__ == "__main__":
    sys.exit(main())
