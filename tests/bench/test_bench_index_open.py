"""What verifying an index costs when it is opened: load_index with and without the check.

    python tests/bench/test_bench_index_open.py [--gallery 125000] [--dim 768] [--repeat 3] [--json OUT.json]

Commits a generated index of unit FP16 rows (int and str ids, as CIRCO and CIRR give them)
into a temp folder, opens it once each way to warm the page cache, then `--repeat`
alternations of load_index(verify=False) and load_index(verify=True). Both read every
file once; the difference is the check: sha256 of each file's bytes, the row norms, the
ids. The parts are timed apart too (median of `--repeat`). JSON on stdout (and in --json).

The pytest test below only checks that the benchmark runs, at a small size.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.retrieval.index import bad_row, commit, duplicate_id, load_index


def generated_index(d: Path, n: int, dim: int) -> None:
    rng = np.random.default_rng(0)
    emb = np.empty((n, dim), np.float16)                                     # [N, D]
    for lo in range(0, n, 16384):
        x = rng.standard_normal((min(16384, n - lo), dim)).astype(np.float32)
        emb[lo:lo + len(x)] = x / np.linalg.norm(x, axis=1, keepdims=True)
    commit(d, emb, [i if i % 2 else f"img-{i}" for i in range(n)], {})


def _median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gallery", type=int, default=125_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp:
        d = Path(tmp)
        generated_index(d, a.gallery, a.dim)
        load_index(d, verify=False)
        idx = load_index(d)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(a.repeat):
            for verify in (False, True):
                t = time.perf_counter()
                load_index(d, verify=verify)
                times[verify].append(time.perf_counter() - t)
        data = (d / idx.meta["files"]["embeddings"]).read_bytes()
        parts = {"sha256_embeddings_s": _median_s(lambda: hashlib.sha256(data).hexdigest(), a.repeat),
                 "row_norms_s": _median_s(lambda: bad_row(idx.emb), a.repeat),
                 "distinct_ids_s": _median_s(lambda: duplicate_id(idx.ids), a.repeat)}
    report = {"gallery": a.gallery, "dim": a.dim, "repeat": a.repeat, "bytes": len(data),
              "open_s": [round(t, 4) for t in times[False]], "open_verified_s": [round(t, 4) for t in times[True]],
              "median_open_s": round(statistics.median(times[False]), 4),
              "median_open_verified_s": round(statistics.median(times[True]), 4),
              **{k: round(v, 4) for k, v in parts.items()}}
    report["median_check_s"] = round(report["median_open_verified_s"] - report["median_open_s"], 4)
    print(f"[bench-index-open] {a.gallery} x {a.dim}: open {report['median_open_s']:.3f} s, verified "
          f"{report['median_open_verified_s']:.3f} s", file=sys.stderr)
    text = json.dumps(report, indent=1)
    print(text)
    if a.json is not None:
        a.json.write_text(text + "\n")
    return report


def test_index_open_bench_runs_at_a_small_size(tmp_path, capsys):
    out = tmp_path / "bench.json"
    report = main(["--gallery", "3000", "--dim", "64", "--repeat", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == report == json.loads(capsys.readouterr().out)
    assert len(report["open_s"]) == len(report["open_verified_s"]) == 2
    assert report["bytes"] == 128 + 3000 * 64 * 2 and report["sha256_embeddings_s"] > 0


if __name__ == "__main__":
    main()
