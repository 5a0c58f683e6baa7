"""A generated composed-image-retrieval corpus and a tiny CLIP, for tests and rate figures.

No real images or weights: gallery images are procedural renders of seeded templates
(evaluator.synthetic.cohort), grouped so that "the same template" stands for "the same concept";
requests name a reference image and a modification, and their positives are other
renders of the reference's template (all of them for CIRCO-style requests, which carry
a shared_concept; one for CIRR-style requests). The tiny CLIP is random (seeded) and is
written in the three layouts engine.clip.load accepts.

    python -m evaluator.cir_corpus --out DIR [--templates 40] [--per-template 8] [--clip DIR]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from engine.progress import Progress

TINY_CLIP = {"embed_dim": 64, "quick_gelu": True,
             "vision_cfg": {"image_size": 64, "layers": 2, "width": 64, "patch_size": 16},
             "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 2}}
TINY_NAME = "tiny-clip"
LAYOUT_DIRS = ("open_clip", "openai", "hf")
COLORS = ("red", "green", "blue", "yellow", "purple", "orange", "black", "white")
THINGS = ("stripes", "circles", "a gradient", "dots", "waves")
ENCODINGS = ("rgb", "rgb", "rgb", "rgb", "progressive", "gray", "cmyk", "png")


def image_id(i: int):
    """CIRCO ids are ints, CIRR ids strings: the corpus mixes both."""
    return 100_000 + i if i % 2 == 0 else f"dev-{i}-img{i % 7}"


def make_corpus(out: Path, templates: int = 40, per_template: int = 8, seed: int = 0,
                broken: int = 3, requests: int = 60) -> dict:
    """Write out/{images/, records.jsonl, requests.jsonl, labels.jsonl}; return counts."""
    from evaluator.synthetic.cohort import claim_generated_folder, encode, render, write_generated_marker
    from evaluator.synthetic.cohort import templates as make_templates

    claim_generated_folder(out, "the corpus folder")
    rng = np.random.default_rng(seed)
    tpl = make_templates(templates, seed)
    out.mkdir(parents=True, exist_ok=True)
    write_generated_marker(out, "evaluator.synthetic.cir_corpus", seed=seed)   # first: an interrupted run's folder stays ours
    records, by_template = [], {}
    bar = Progress(templates * per_template, "cir corpus: rendering", unit="images")
    for i in range(templates * per_template):
        bar.update()
        t = i % templates
        rel = f"images/{t:03d}/{i:05d}.jpg"
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        w, h = (int(v) for v in rng.integers(72, 160, 2))
        data, _ = encode(render(tpl[t], w, h, rng), rng, str(rng.choice(ENCODINGS)))
        (out / rel).write_bytes(data)
        rec = {"image_id": image_id(i), "path": rel}
        if i % 50 == 7:
            rec = {"id": image_id(i), "file": rel}            # synonyms the reader accepts
        records.append(rec)
        by_template.setdefault(t, []).append(image_id(i))
    bar.close()
    n = len(records)
    for b in range(broken):                                    # unreadable: listed, left out
        iid, rel = f"broken-{b}", f"images/broken-{b}.jpg"
        if b % 3 == 2:
            rel = "images/does-not-exist.jpg"
        else:
            data, _ = encode(render(tpl[0], 120, 90, rng), rng, "rgb")
            (out / rel).write_bytes(data[: len(data) // 3] if b % 2 == 0 else b"not an image\n" * 8)
        records.insert(int(rng.integers(0, n)), {"image_id": iid, "path": rel})
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    reqs, labels = [], []
    for q in range(requests):
        t = int(rng.integers(templates))
        members = by_template[t]
        ref = members[int(rng.integers(len(members)))]
        others = [m for m in members if m != ref]
        mod = f"make it more {COLORS[int(rng.integers(len(COLORS)))]} with {THINGS[int(rng.integers(len(THINGS)))]}"
        if q % 2 == 0:                                          # CIRCO-style: concept + all positives
            qid = q
            reqs.append({"query_id": qid, "reference_image_id": ref, "modification": mod,
                         "shared_concept": f"pattern number {t}"})
            labels.append({"query_id": qid, "source": "circo", "positives": others})
        else:                                                   # CIRR-style: one target
            qid = f"cirr-{q}"
            reqs.append({"query_id": qid, "reference_image_id": ref, "modification": mod})
            labels.append({"query_id": qid, "source": "cirr",
                           "positives": [others[int(rng.integers(len(others)))]]})
    (out / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
    (out / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in labels))
    write_generated_marker(out, "evaluator.synthetic.cir_corpus", seed=seed, images=n, requests=len(reqs))
    return {"images": n, "broken": broken, "requests": len(reqs)}


def tiny_clip(seed: int = 0):
    """The tiny open_clip CLIP (seeded random init, FP32, eval)."""
    import torch

    from engine.clip.load import build_open_clip

    torch.manual_seed(seed)
    return build_open_clip(TINY_CLIP)


def write_tiny_clip(out: Path, seed: int = 0) -> dict[str, Path]:
    """Save the tiny CLIP as out/open_clip, out/openai (state dict + model_name.txt + NAME.json)
    and out/hf (config.json + model.safetensors + preprocessor_config.json)."""
    import torch
    from safetensors.torch import save_file

    from engine.clip.hf import hf_config_from_model_cfg, open_clip_to_hf

    sd = {k: v.contiguous() for k, v in tiny_clip(seed).state_dict().items()}
    dirs = {name: out / name for name in LAYOUT_DIRS}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    pre = {"mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711],
           "interpolation": "bicubic", "resize_mode": "shortest"}
    (dirs["open_clip"] / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": TINY_CLIP, "preprocess_cfg": pre}, indent=1))
    torch.save(sd, dirs["open_clip"] / "open_clip_pytorch_model.bin")
    torch.save(sd, dirs["openai"] / "model.pt")
    (dirs["openai"] / "model_name.txt").write_text(TINY_NAME + "\n")
    (dirs["openai"] / f"{TINY_NAME}.json").write_text(json.dumps(TINY_CLIP, indent=1))
    (dirs["hf"] / "config.json").write_text(json.dumps(hf_config_from_model_cfg(TINY_CLIP), indent=1))
    save_file(open_clip_to_hf(sd), str(dirs["hf"] / "model.safetensors"))
    size = TINY_CLIP["vision_cfg"]["image_size"]
    (dirs["hf"] / "preprocessor_config.json").write_text(json.dumps(
        {"crop_size": {"height": size, "width": size}, "size": {"shortest_edge": size}, "do_center_crop": True,
         "image_mean": pre["mean"], "image_std": pre["std"], "resample": 3}, indent=1))
    return dirs


def main(argv: list[str] | None = None) -> int:
    from engine.cli import SEED, guard, parser, whole_number

    prog = "python -m evaluator.cir_corpus"
    p = parser(prog, __doc__.split("\n\n")[0], {"ENGINE_PROGRESS": "auto, bar, lines or off"})
    p.add_argument("--out", type=Path, required=True, help="folder for images/, records, requests and labels")
    p.add_argument("--templates", type=whole_number(1, 10_000), default=40, help="concepts (one procedural template each)")
    p.add_argument("--per-template", type=whole_number(2, 10_000, "images"), default=8, help="gallery images per concept")
    p.add_argument("--requests", type=whole_number(0, 10**6), default=60, help="requests (half CIRCO-style, half CIRR-style)")
    p.add_argument("--broken", type=whole_number(0, 10**6, "records"), default=3, help="unreadable records planted in records.jsonl")
    p.add_argument("--seed", type=SEED, default=0, help="the same seed gives the same bytes")
    p.add_argument("--clip", type=Path, default=None, help="also write the tiny CLIP's three layouts here (default: not written)")
    a = p.parse_args(argv)
    if a.templates < 1 or a.per_template < 2:
        p.error("--templates must be >= 1 and --per-template >= 2 (requests need a positive)")
    if a.requests < 0 or a.broken < 0:
        p.error("--requests and --broken must be >= 0")

    def body() -> int:
        from engine import settings

        settings.check(("progress",))    # before anything is created: a refusal leaves no folder behind
        info = make_corpus(a.out, a.templates, a.per_template, a.seed, a.broken, a.requests)
        if a.clip is not None:
            info["clip"] = {k: str(v) for k, v in write_tiny_clip(a.clip, a.seed).items()}
        print(json.dumps(info), file=sys.stderr)
        return 0

    return guard(prog, body, debug=a.debug)


if __name__ == "__main__":
    sys.exit(main())
