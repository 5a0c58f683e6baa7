"""Eager against AOT-compiled CLIP towers on this machine: images/s and texts/s, JSON out.

    python -m engine.clip.bench --clip CLIP_DIR             # a CLIP folder (e.g. the tests' tiny CLIP)
    python -m engine.clip.bench --clip ViT-L-14 --image-batch 8 --precisions fp32 bf16

`--clip` is a CLIP folder (engine.clip.load) or an open_clip architecture built with random
weights (throughput only).
Each tower is checked against the FP32 eager reference first (cosine per row), then timed:
eager (ClipTowers, what runs without compiled towers: autocast precision, text trimmed to the
batch's prompts) and aot alternate round by round (A/B/A/B), medians and spread reported;
compile time is its own field, never in a rate.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.presets.retrieval import RETRIEVAL

PROMPTS = ("a photo of a red car", "make it blue and add stripes", "a dog on a beach at sunset",
           "the same shirt but green", "remove the background people", "a small wooden house in the snow")


def _model(clip: str):
    """(model, ClipSpec): a CLIP folder (engine.clip.load), else an open_clip architecture with random weights."""
    from engine.clip.spec import ClipSpec, image_spec_from_open_clip

    if Path(clip).exists():
        from engine.clip.load import load_clip

        model, spec, _ = load_clip(clip)
        return model, spec
    import open_clip

    cfg = open_clip.get_model_config(clip)
    model = open_clip.create_model(clip, pretrained=None).eval()
    spec = ClipSpec(image=image_spec_from_open_clip(cfg, {}, clip), embed_dim=int(cfg["embed_dim"]),
                    context_length=int(cfg.get("text_cfg", {}).get("context_length", 77)), arch=clip)
    return model, spec


def _rate(fn, x, n: int, min_s: float = RETRIEVAL.bench_min_s) -> float:
    """Rows per second over repeated calls lasting at least `min_s` (a tiny tower's call is sub-ms)."""
    calls, t0 = 0, time.perf_counter()
    while True:
        fn(x)
        calls += 1
        t = time.perf_counter() - t0
        if t >= min_s:
            return calls * n / t


def bench(clip: str, image_batch: int, text_batch: int, precisions: list[str], rounds: int, work: Path) -> dict:
    from engine.clip import compiled as C
    from engine.clip.towers import ClipTowers

    model, spec = _model(clip)
    dev = torch.device("cpu")
    ref = ClipTowers(model, spec, "cpu", "fp32")
    s = spec.image.input_size
    imgs = torch.randint(0, 256, (image_batch, s, s, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(text_batch)]
    toks = ref.tokenize(texts)[0]
    want = {"image": ref.encode_images(imgs), "text": ref.encode_tokens(toks)}
    out = {"clip": clip, "image_batch": image_batch, "text_batch": text_batch, "threads": torch.get_num_threads(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "rounds": rounds, "towers": []}
    for prec in precisions:
        eager = ClipTowers(model, spec, "cpu", prec)
        for kind, x, n in (("image", imgs, image_batch), ("text", toks, text_batch)):
            batch = image_batch if kind == "image" else text_batch
            t0 = time.perf_counter()
            d = work / f"{kind}-{prec}"
            C.export_aot(C.make_graph(kind, model, spec, prec), C.example_input(kind, spec, batch, C.TEXT_LEN, "cpu"),
                         "cpu", d)
            compile_s = time.perf_counter() - t0
            aot = C.tower_fn(kind, C.AOT, model, spec, prec, batch, dev, d)
            run_aot = aot if kind == "image" else (lambda t, f=aot: f(t[:, :C.TEXT_LEN]))
            run_eager = eager.encode_images if kind == "image" else eager.encode_tokens
            cos = float((run_aot(x) * want[kind]).sum(1).min())
            run_eager(x)                                    # warm-up of both
            rates: dict[str, list[float]] = {C.EAGER: [], C.AOT: []}
            for _ in range(rounds):                         # A/B alternating: shared-machine drift hits both
                rates[C.EAGER].append(_rate(run_eager, x, n))
                rates[C.AOT].append(_rate(run_aot, x, n))
            row = {"tower": kind, "precision": prec, "compile_s": round(compile_s, 1), "cos_min_vs_fp32": cos}
            for k, v in rates.items():
                row[f"{k}_per_s_median"] = round(statistics.median(v), 2)
                row[f"{k}_per_s_range"] = [round(min(v), 2), round(max(v), 2)]
            row[f"{C.AOT}_over_{C.EAGER}"] = round(row[f"{C.AOT}_per_s_median"] / row[f"{C.EAGER}_per_s_median"], 3)
            print(json.dumps(row), file=sys.stderr, flush=True)
            out["towers"].append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    from engine.cli import ArgumentParser, HelpFormatter, whole_number

    p = ArgumentParser(prog="python -m engine.clip.bench", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--clip", required=True, help="a CLIP folder or an open_clip architecture name")
    p.add_argument("--image-batch", type=whole_number(1, 4096, "images"), default=RETRIEVAL.bench_image_batch,
                   help="images per timed call of the image tower")
    p.add_argument("--text-batch", type=whole_number(1, 65_536, "prompts"), default=RETRIEVAL.bench_text_batch, help="prompts per timed call of the text tower")
    p.add_argument("--precisions", nargs="+", default=["fp32"], help="precisions to compile and time (fp32 bf16 fp16)")
    p.add_argument("--rounds", type=whole_number(1, 1000), default=RETRIEVAL.bench_rounds, help="alternated eager/aot rounds; medians reported")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="clip-bench-") as work:
        print(json.dumps(bench(a.clip, a.image_batch, a.text_batch, a.precisions, a.rounds, Path(work)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
