"""Fixed costs of a run's start, AOTInductor graph loaded in place vs extracted from its package.

    BENCH_ARTIFACT=/path/to/aot/artifact python -m pytest tests/bench/test_bench_fixed_costs.py \
        --benchmark-enable --benchmark-json=fixed.json -s
    python tests/bench/test_bench_fixed_costs.py ARTIFACT [--rounds 3] [--out fixed.json]

Each round starts two fresh processes, alternated, on the same artifact:

    inplace   what scripts/run does: the backend's load, which dlopens aot/model.so where it lies
    package   the former way: a .pt2 package of the same files (repacked here, before timing)
              loaded by torch's package loader, which extracts it into TMPDIR first

and each process times, in order: `imports` (torch and the engine's artifact and backend
modules), `artifact_check` (load_artifact: manifest, digests, sampled SHA-256), `graph_load`
(the compiled graph and, for a guarded artifact, its FP32 re-check graph), `sha256_wait`
(what is left of the files' full SHA-256, which load_artifact started on a thread and a
run waits for before its first image), `first_batch`
and `second_batch` (one zero batch of the spec's shape each; the first pays the lazy
initialisation). The parent adds `process` (spawn to exit). Each process runs with a
private, empty TMPDIR; what it holds while the graph is loaded and after the process ended
is reported in bytes. Figures are medians over the rounds with their spread, as JSON.
With no BENCH_ARTIFACT the test runs on the tiny AOT artifact: a check that the benchmark
runs, not a figure.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from engine.io import package_versions, tree_bytes

if __name__ != "__main__":      # under pytest; the timed child processes run this file without it
    import pytest

    pytestmark = pytest.mark.abi   # benchmark: the AOT artifact loaded in fresh child processes

MODES = ("package", "inplace")
PHASES = ("imports", "artifact_check", "graph_load", "sha256_wait", "first_batch", "second_batch")
# the records torch's package writer puts beside the model's files (archive name "model")
PT2_HEADER = {"archive_format": b"pt2", "archive_version": b"0", ".data/version": b"6\n", "byteorder": b"little"}


def repack(aot_dir: Path, pt2: Path) -> Path:
    """A .pt2 package of an in-place artifact's files, as AOTInductor packaged them (stored, not
    compressed): what the artifact held before the build unpacked it."""
    with zipfile.ZipFile(pt2, "w", zipfile.ZIP_STORED) as z:
        for name, data in PT2_HEADER.items():
            z.writestr(f"model/{name}", data)
        for f in sorted(aot_dir.iterdir()):
            z.write(f, f"model/data/aotinductor/model/{f.name}")
    return pt2


def graph_dirs(artifact: Path) -> list[Path]:
    """The artifact's compiled graphs (aot/ and, when guarded, recheck/aot/)."""
    return [d for d in (artifact / "aot", artifact / "recheck" / "aot") if (d / "model.so").is_file()]


def child(mode: str, artifact: Path, packages: list[Path]) -> dict:
    """One fresh process's phases (seconds), in the order a run pays them."""
    t = [time.perf_counter()]
    import torch

    from engine import backends
    from engine.classify.artifact import load_artifact
    from engine.classify.runtime import recheck_view
    t.append(time.perf_counter())
    art = load_artifact(artifact)
    t.append(time.perf_counter())
    device = torch.device(art.device)
    if mode == "inplace":
        be = backends.get(art.backend)
        fns = [be.load(art, device)]
        if art.meta.get("guard"):
            fns.append(backends.get(art.meta["guard"].get("recheck_backend", art.backend)).load(recheck_view(art), device))
    else:
        loaders = [torch._C._aoti.AOTIModelPackageLoader(str(p), "model", device.type == "cuda", 1, -1) for p in packages]
        fns = [lambda x, ld=ld: ld.boxed_run([x]) for ld in loaders]
    t.append(time.perf_counter())
    art.check_weights()   # a run joins the full hash here, before its first image
    t.append(time.perf_counter())
    x = torch.zeros((art.batch_size, art.spec.input_size, art.spec.input_size, 3), dtype=torch.uint8, device=device)
    answers = []
    for _ in range(2):
        with torch.inference_mode():
            out = fns[0](x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t.append(time.perf_counter())
        answers = [int(v) for v in out[0].cpu()]
    tmp = Path(tempfile.gettempdir())
    return {"phases": {p: round(b - a, 4) for p, a, b in zip(PHASES, t, t[1:])},
            "tmpdir_bytes_loaded": tree_bytes(tmp), "top1": answers}


def measure(artifact: Path, rounds: int = 3, work: Path | None = None) -> dict:
    """`rounds` x (package, inplace) fresh processes on `artifact`; medians, spreads and the raw rounds."""
    artifact = artifact.resolve()
    dirs = graph_dirs(artifact)
    if not dirs:
        raise SystemExit(f"{artifact}: no aot/model.so: build it with python -m engine.build --backend aot")
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="bench-fixed-")) if own else work
    try:
        packages = [repack(d, work / f"graph{i}.pt2") for i, d in enumerate(dirs)]
        from engine.threads import budget, library_env

        meta = json.loads((artifact / "manifest.json").read_text())
        env = {**os.environ, **library_env(budget(meta["device"])), "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
               "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        raw = {m: [] for m in MODES}
        for r in range(rounds):
            for mode in MODES:
                tmp = work / f"tmp-{mode}-{r}"
                tmp.mkdir()
                t0 = time.perf_counter()
                p = subprocess.run([sys.executable, __file__, "--child", mode, str(artifact), *map(str, packages)],
                                   env={**env, "TMPDIR": str(tmp)}, capture_output=True, text=True)
                wall = time.perf_counter() - t0
                if p.returncode:
                    raise RuntimeError(f"{mode} process failed (exit {p.returncode}): {p.stderr[-2000:]}")
                rec = json.loads(p.stdout.strip().splitlines()[-1])
                rec["phases"]["process"] = round(wall, 4)
                rec["tmpdir_bytes_after_exit"] = tree_bytes(tmp)
                raw[mode].append(rec)
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for mode in MODES:
        summary[mode] = {ph: {"median": round(statistics.median(r["phases"][ph] for r in raw[mode]), 4),
                              "min": min(r["phases"][ph] for r in raw[mode]),
                              "max": max(r["phases"][ph] for r in raw[mode])}
                         for ph in (*PHASES, "process")}
        summary[mode]["tmpdir_bytes_loaded"] = max(r["tmpdir_bytes_loaded"] for r in raw[mode])
        summary[mode]["tmpdir_bytes_after_exit"] = max(r["tmpdir_bytes_after_exit"] for r in raw[mode])
    return {"artifact": str(artifact), "graph_bytes": sum(tree_bytes(d) for d in dirs),
            "model": meta["spec"]["model"], "precision": meta["precision"], "batch_size": meta["batch_size"],
            "device": meta["device"], "rounds": rounds, "order": "package then inplace, alternated",
            "versions": package_versions(("torch",)), "summary": summary, "raw": raw}


def test_bench_fixed_costs(benchmark, request, tmp_path):
    """In-place loading writes nothing to TMPDIR and answers as the extracted package does."""
    given = os.environ.get("BENCH_ARTIFACT")
    artifact = Path(given) if given else request.getfixturevalue("aot_artifact")
    rounds = int(os.environ.get("BENCH_ROUNDS", "3" if given else "1"))
    result = benchmark.pedantic(measure, args=(artifact, rounds, tmp_path), rounds=1, iterations=1)
    benchmark.extra_info.update({k: v for k, v in result.items() if k != "raw"})
    print(json.dumps(result["summary"], indent=1), file=sys.stderr)
    s = result["summary"]
    assert s["inplace"]["tmpdir_bytes_loaded"] == 0 and s["inplace"]["tmpdir_bytes_after_exit"] == 0
    assert s["package"]["tmpdir_bytes_loaded"] >= result["graph_bytes"] * 0.9   # the former way's extraction
    answers = {tuple(r["top1"]) for m in MODES for r in result["raw"][m]}
    assert len(answers) == 1, answers
    assert all(s[m][ph]["median"] > 0 for m in MODES for ph in (*PHASES, "process") if ph != "sha256_wait")
    assert all(s[m]["sha256_wait"]["median"] >= 0 for m in MODES)   # 0 when the hash ended during graph_load


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tests/bench/test_bench_fixed_costs.py", description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("packages", nargs="*", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, help="write the JSON here too")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.artifact, a.packages)))
        return 0
    text = json.dumps(measure(a.artifact, a.rounds), indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
