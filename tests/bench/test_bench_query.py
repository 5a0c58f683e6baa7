"""Query-path benchmark at the task's scale on generated embeddings: seconds per call per method.

    python tests/bench/test_bench_query.py [--gallery 125000] [--requests 2200] [--dim 768] \
        [--device cpu|cuda] [--methods slerp,slerp+qbnorm,...] [--repeat 3] [--json OUT.json]

One call = what scripts/run.sh does after the CLIP is loaded: load the committed index
(FP16 rows, read once and verified), read the requests file, build engine.retrieval.query.QueryPipeline,
`prepare` (bank statistics), and `evaluator.cir.run.answer` (compose, score, top 50, one
flushed JSONL row per request). Only the CLIP towers are left out: the text side is
generated unit rows looked up by prompt (`GeneratedTowers`), so the figures are the
retrieval maths and I/O without the text tower's forward passes (time those apart).

The index is generated once per process: a clustered [N, D] unit FP16 gallery, a
gallery-derived text bank (4,096 rows, each aimed at its own gallery row, recorded as the
build records it: the default hubness bank) and stored DBA rows (generated neighbours'
blend: the query path only loads them; computing DBA is a build-time cost). Every method
runs `--repeat` fresh calls; each clock read follows a device synchronisation. JSON on
stdout (and in --json): per method the setup (pipeline + bank statistics) and answer
seconds of every call, and their medians.

The pytest test below only checks that the benchmark runs, at a small size.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

METHODS = ("slerp", "text-only", "sum", "slerp+isoftmax", "slerp+qbnorm", "slerp+dual-softmax", "slerp+csls",
           "slerp+aqe", "slerp+dba")
TEXT_BANK = 4096          # gallery-derived texts, the build's default with a mapping


class GeneratedTowers:
    """The towers' text side with generated unit rows [T, D]: a prompt that names a generated
    text (`texts`) maps to its row, any other prompt to a fixed row chosen by its CRC-32."""

    def __init__(self, texts: dict[str, int], emb: torch.Tensor, device: torch.device):
        self.rows, self.emb, self.device, self.precision = texts, emb.to(device), device, "fp32"
        self.spec = SimpleNamespace(embed_dim=emb.shape[1], context_length=77, image=None)

    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, list[bool]]:
        ids = [self.rows.get(t, zlib.crc32(t.encode()) % len(self.emb)) for t in texts]
        return torch.tensor(ids, dtype=torch.int64), [False] * len(texts)

    def encode_tokens(self, tokens: torch.Tensor, trim: bool | None = None) -> torch.Tensor:
        return self.emb[tokens.to(self.device)]                            # [B, D] unit rows

    def encode_texts(self, texts: list[str]) -> torch.Tensor:
        return self.encode_tokens(self.tokenize(texts)[0])


def generate(out: Path, n: int, m: int, dim: int, seed: int = 0) -> tuple[Path, Path, torch.Tensor, dict]:
    """Write a committed index (engine.retrieval.index.commit) and a requests file under `out`.
    Returns (index dir, requests file, text rows [m, D], prompt -> text row)."""
    from engine.retrieval.index import commit

    g = torch.Generator().manual_seed(seed)
    centres = F.normalize(torch.randn(max(1, n // 50), dim, generator=g), dim=-1)
    gallery = torch.empty(n, dim)
    for lo in range(0, n, 16384):                                          # bounded temporaries
        hi = min(n, lo + 16384)
        c = centres[torch.randint(0, len(centres), (hi - lo,), generator=g)]
        gallery[lo:hi] = F.normalize(c + 0.8 * torch.randn(hi - lo, dim, generator=g) / dim ** 0.5, dim=-1)
    offset = F.normalize(torch.randn(dim, generator=g), dim=0)             # the text cone's direction
    refs = torch.randint(0, n, (m,), generator=g)
    targets = torch.randint(0, n, (m,), generator=g)
    text = F.normalize(gallery[targets] + 1.2 * offset + 0.5 * torch.randn(m, dim, generator=g) / dim ** 0.5,
                       dim=-1)
    bank_rows = np.sort(np.random.default_rng(seed).choice(n, min(TEXT_BANK, n), replace=False))
    bank = F.normalize(gallery[torch.from_numpy(bank_rows)] + 1.2 * offset, dim=-1)
    nb = torch.randint(0, n, (n, 3), generator=g)                          # stand-in DBA neighbours
    dba_rows = F.normalize(gallery + 0.3 * gallery[nb].sum(1), dim=-1)

    def npy(x: torch.Tensor) -> bytes:
        import io

        buf = io.BytesIO()
        np.save(buf, x.numpy().astype(np.float16), allow_pickle=False)
        return buf.getvalue()

    ids = list(range(n))
    meta = {"model": {"digest": "generated"}, "gallery_mean": gallery.mean(0).tolist(),
            "text_bank": {"count": len(bank_rows), "rows": bank_rows.tolist(), "source": "generated"},
            "dba": {"n": 3, "alpha": 3.0}, "unreadable": []}
    index_dir = out / "index"
    index_dir.mkdir(parents=True, exist_ok=True)
    commit(index_dir, gallery.numpy().astype(np.float16), ids, meta,
           {"text_bank": (".f16.npy", npy(bank)), "dba": (".f16.npy", npy(dba_rows))})
    prompts = {}
    with open(out / "requests.jsonl", "w") as f:
        for i in range(m):
            mod = f"request {i}: make it different"
            prompts[mod] = i
            row = {"query_id": i, "reference_image_id": int(refs[i]), "modification": mod}
            if i % 2:                                                      # CIRCO-style half: a shared concept
                row["shared_concept"] = "a thing"
            f.write(json.dumps(row) + "\n")
    return index_dir, out / "requests.jsonl", text, prompts


def one_call(index_dir: Path, queries: Path, towers: GeneratedTowers, name: str, output: Path) -> dict:
    """One call of the query path (scripts/run.sh after the CLIP load); seconds per stage."""
    from engine.retrieval.index import load_index
    from engine.retrieval.jsonl import read_requests
    from engine.retrieval.query import QueryPipeline, QuerySettings
    from evaluator.cir import task
    from evaluator.cir.run import answer

    def sync() -> float:
        if towers.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    t0 = sync()
    index = load_index(index_dir)
    requests = read_requests(queries, lambda msg: print(msg, file=sys.stderr))
    method = task.method(name)
    pipe = QueryPipeline(index, towers, method, lambda msg: print(msg, file=sys.stderr), queries, 50,
                         QuerySettings(max_reinspect=task.MAX_REINSPECT))
    pipe.prepare(requests)
    t1 = sync()
    with open(output, "wb") as out:
        n = answer(SimpleNamespace(batch_size=256), pipe, requests, out)
    t2 = sync()
    assert n == len(requests)
    return {"setup_s": t1 - t0, "answer_s": t2 - t1, "total_s": t2 - t0, "label": method.label,
            "bank": pipe.info.get("bank")}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="tests/bench/test_bench_query.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--gallery", type=int, default=125_000)
    p.add_argument("--requests", type=int, default=2_200)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if min(a.gallery, a.requests, a.dim, a.repeat) < 1:
        p.error("--gallery, --requests, --dim and --repeat must be >= 1")
    device = torch.device(a.device)
    with tempfile.TemporaryDirectory(prefix="bench-query-") as tmp:
        t0 = time.perf_counter()
        index_dir, queries, text, prompts = generate(Path(tmp), a.gallery, a.requests, a.dim)
        towers = GeneratedTowers(prompts, text, device)
        report = {"gallery": a.gallery, "requests": a.requests, "dim": a.dim, "device": device.type,
                  "torch_threads": torch.get_num_threads(), "repeat": a.repeat,
                  "generate_s": round(time.perf_counter() - t0, 3),
                  "excluded": "CLIP text tower forwards and model load (generated text rows)", "methods": []}
        for name in (x.strip() for x in a.methods.split(",") if x.strip()):
            calls = [one_call(index_dir, queries, towers, name, Path(tmp) / "out.jsonl") for _ in range(a.repeat)]
            row = {"method": calls[0]["label"], "bank": calls[0]["bank"]}
            for key in ("setup_s", "answer_s", "total_s"):
                row[key] = [round(c[key], 4) for c in calls]
                row["median_" + key] = round(statistics.median(c[key] for c in calls), 4)
            report["methods"].append(row)
            print(f"[bench-query] {row['method']}: {row['median_total_s']:.3f} s per call "
                  f"(setup {row['median_setup_s']:.3f}, answer {row['median_answer_s']:.3f})", file=sys.stderr)
    text_out = json.dumps(report, indent=1)
    print(text_out)
    if a.json is not None:
        a.json.write_text(text_out + "\n")
    return report


def test_query_bench_runs_at_a_small_size(tmp_path, capsys):
    out = tmp_path / "bench.json"
    report = main(["--gallery", "5000", "--requests", "300", "--dim", "64", "--device", "cpu", "--repeat", "1",
                   "--json", str(out)])
    assert json.loads(out.read_text()) == report
    labels = [m["method"] for m in report["methods"]]
    assert labels == list(METHODS)
    for m in report["methods"]:
        assert m["median_total_s"] > 0 and len(m["total_s"]) == 1
        hub = any(h in m["method"] for h in ("softmax", "qbnorm", "csls"))
        assert (m["bank"] == "4096 gallery-derived texts") == hub          # the default bank, stored at build
    assert json.loads(capsys.readouterr().out) == report                 # stdout is the JSON report


if __name__ == "__main__":
    main()
