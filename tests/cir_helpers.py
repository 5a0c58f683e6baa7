"""Shared pieces of the CIR tests: one generated corpus, the tiny CLIP in three layouts, one
built index and one full run per session (made lazily, cached), plus the ABI checker."""
from __future__ import annotations

import atexit
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHUNK, BATCH = "64", "32"      # 320 images -> 5 full chunks + 1; batches align with chunks


@functools.cache
def workspace() -> Path:
    d = Path(tempfile.mkdtemp(prefix="cir-tests-"))
    atexit.register(shutil.rmtree, d, True)
    return d


@functools.cache
def corpus() -> Path:
    from evaluator.synthetic.cir_corpus import make_corpus

    out = workspace() / "corpus"
    make_corpus(out, templates=40, per_template=8, seed=0, broken=3, requests=40)
    return out


@functools.cache
def clip_dirs() -> dict[str, Path]:
    from evaluator.synthetic.cir_corpus import write_tiny_clip

    return write_tiny_clip(workspace() / "clip", seed=0)


def script(name: str, *args: str, env: dict | None = None, timeout: float = 300,
           prefix: list[str] | None = None, root: Path = REPO) -> subprocess.CompletedProcess:
    """scripts/NAME as a whole process (the tiny CLIP's open_clip layout unless env says otherwise),
    from the code in `root` (default: this checkout)."""
    e = {**os.environ, "CLIP_MODEL_DIR": str(clip_dirs()["open_clip"]), "PYTHON": sys.executable,
         "CLIP_DEVICE": "cpu", **(env or {})}
    return subprocess.run([*(prefix or []), str(root / "scripts" / name), *args], env=e,
                          capture_output=True, text=True, timeout=timeout,
                          cwd=None if root == REPO else root)   # `python -m` reads the code of its cwd first


def killed_run(*args: str, after: int, timeout: float = 300) -> subprocess.CompletedProcess:
    """The query ABI as a whole process that SIGKILLs itself once `after` rows are written
    and flushed (what a kill of the call does)."""
    code = ("import os, signal, sys\nfrom evaluator.cir import run\n"
            f"sys.exit(run.main(sys.argv[1:], on_row=lambda n: n >= {after} and os.kill(os.getpid(), signal.SIGKILL)))")
    e = {**os.environ, "CLIP_MODEL_DIR": str(clip_dirs()["open_clip"]), "CLIP_DEVICE": "cpu",
         "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code, *args], env=e, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def build_args(index_dir: Path, *extra: str) -> list[str]:
    return ["--corpus", str(corpus()), "--index-dir", str(index_dir), "--chunk-size", CHUNK,
            "--batch-size", BATCH, *extra]


@functools.cache
def built_index() -> Path:
    """The reference index, built once through scripts/build.sh."""
    d = workspace() / "index"
    r = script("build.sh", *build_args(d))
    assert r.returncode == 0, r.stderr[-3000:]
    (workspace() / "build.stderr").write_text(r.stderr)
    return d


@functools.cache
def full_run() -> Path:
    """The reference output: scripts/run.sh over the corpus requests."""
    out = workspace() / "run-full.jsonl"
    r = script("run.sh", "--index-dir", str(built_index()), "--queries", str(corpus() / "requests.jsonl"),
               "--output", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    (workspace() / "run.stderr").write_text(r.stderr)
    return out


def run_args(queries: Path, output: Path, *extra: str) -> list[str]:
    return ["--index-dir", str(built_index()), "--queries", str(queries), "--output", str(output),
            "--model-dir", str(clip_dirs()["open_clip"]), "--device", "cpu", *extra]


def read_rows(path: Path) -> list[dict]:
    """Every line of an output must be one complete JSON row."""
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), "output ends in a torn line"
    return [json.loads(line) for line in text.splitlines()]


def check_abi(rows: list[dict], requests: list[dict], index_ids: list, k: int = 50) -> None:
    """Every ABI invariant of a run output against its (valid) requests."""
    known = {str(i) for i in index_ids}
    refs = {str(r["query_id"]): str(r.get("reference_image_id")) for r in requests}
    seen = set()
    for row in rows:
        qid = str(row["query_id"])
        assert qid in refs, f"row for unknown query {qid}"
        assert qid not in seen, f"two rows for query {qid}"
        seen.add(qid)
        res = row["results"]
        ids = [str(r["image_id"]) for r in res]
        scores = [r["score"] for r in res]
        assert 0 < len(res) <= k
        assert len(set(ids)) == len(ids), f"query {qid}: duplicate ids"
        assert set(ids) <= known, f"query {qid}: ids not in the gallery"
        assert refs[qid] not in ids, f"query {qid}: the reference is in its results"
        assert all(isinstance(s, float) and math.isfinite(s) for s in scores)
        assert all(a >= b for a, b in zip(scores, scores[1:])), f"query {qid}: scores increase"
    assert seen == set(refs), f"queries without a row: {sorted(set(refs) - seen)[:5]}"


def requests_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
