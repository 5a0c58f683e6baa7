"""The embedded default, end to end: cohort -> tiny checkpoint -> artifact -> ABI -> agreement.

    python -m evaluator.demo [--out demo] [--count 300] [--crop-mode squash] [--backend NAME]
    python -m evaluator.demo prepare --out DIR [--count N] [--seed S]

`run` (the default) builds what is missing, runs `scripts/run` and the naive FP32
reference path as whole processes, and prints agreement and wall times as JSON.
`prepare` writes DIR/cohort/, DIR/tiny_eva02.safetensors, DIR/artifact/ and
DIR/reference.i32 for campaigns and benchmarks. Finished steps are reused.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine.backends import BACKENDS
from engine.backends import DEFAULT as DEFAULT_BACKEND

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Prepared:
    cohort: Path        # manifest.tsv + images/
    checkpoint: Path
    artifact: Path
    reference: Path     # int32 per row, -1 = unreadable for the reference
    build_args: list[str]


def _model_args(crop_mode: str) -> list[str]:
    from evaluator.synthetic.cohort import TINY_INPUT, TINY_KWARGS, TINY_MODEL

    return ["--model", TINY_MODEL, "--input-size", str(TINY_INPUT), "--crop-mode", crop_mode,
            "--crop-pct", "1.0", "--model-kwargs", json.dumps(TINY_KWARGS)]


def _log(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def prepare(out: Path, count: int = 300, seed: int = 0, crop_mode: str = "squash", backend: str = DEFAULT_BACKEND,
            batch_size: int = 16, artifact: Path | None = None, precision: str = "fp32") -> Prepared:
    """Make (or reuse) every input of a demo run under `out`."""
    from engine.io import sha256_file
    from evaluator.synthetic.cohort import make_cohort, make_tiny_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    cohort, ckpt = out / "cohort", out / "tiny_eva02.safetensors"
    artifact = artifact or out / "artifact"
    rec = cohort / "cohort.json"
    if not rec.exists() or (json.loads(rec.read_text())["seed"], json.loads(rec.read_text())["count"]) != (seed, count):
        _log(f"generating {count} images (seed {seed}) in {cohort}")
        make_cohort(cohort, count, seed)
    if not ckpt.exists() or json.loads(ckpt.with_suffix(".json").read_text()).get("seed") != seed:
        _log(f"fitting the tiny EVA-02 head on generated renders -> {ckpt}")
        make_tiny_checkpoint(ckpt, seed)
    build_args = _model_args(crop_mode) + ["--checkpoint", str(ckpt), "--out", str(artifact), "--backend", backend,
                                           "--batch-size", str(batch_size), "--precision", precision]
    ck_sha = sha256_file(ckpt)
    man = artifact / "manifest.json"
    stale = True
    if man.exists():
        m = json.loads(man.read_text())
        stale = (m["checkpoint"]["sha256"], m["backend"], m["spec"]["crop_mode"], m["batch_size"], m["precision"]) != (
            ck_sha, backend, crop_mode, batch_size, precision)
    if stale:
        _log(f"building the {backend} artifact in {artifact} (untimed preparation)")
        subprocess.run([sys.executable, "-m", "engine.build", *build_args], check=True, stdout=subprocess.DEVNULL)
    ref, ref_meta = out / f"reference-{crop_mode}.i32", out / f"reference-{crop_mode}.json"
    key = {"checkpoint": ck_sha, "manifest": sha256_file(cohort / "manifest.tsv"), "crop_mode": crop_mode}
    if not ref.exists() or not ref_meta.exists() or json.loads(ref_meta.read_text()).get("key") != key:
        _log("running the naive FP32 reference path (PIL + timm eager, batch 1)")
        t = _timed([sys.executable, "-m", "evaluator.reference", str(cohort / "manifest.tsv"), str(cohort), str(ref),
                    *_model_args(crop_mode), "--checkpoint", str(ckpt)])
        ref_meta.write_text(json.dumps({"key": key, "wall_s": t}) + "\n")
    link = out / "reference.i32"
    link.unlink(missing_ok=True)
    link.write_bytes(ref.read_bytes())
    return Prepared(cohort, ckpt, artifact, link, build_args)


def _timed(cmd: list[str], env: dict | None = None) -> float:
    """Wall seconds of one whole process, start to reaped."""
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    return round(time.perf_counter() - t, 3)


def run(a: argparse.Namespace) -> int:
    import numpy as np

    from evaluator.contest.agreement import agreement, read_i32

    prep = prepare(a.out, a.count, a.seed, a.crop_mode, a.backend, a.batch_size, a.artifact, a.precision)
    pred, report = a.out / "predictions.i32", a.out / "timing.json"
    env = {**os.environ, "ENGINE_ARTIFACT": str(prep.artifact), "CONTEST_REPORT": str(report)}
    _log("running the contest ABI: scripts/run MANIFEST IMAGE_ROOT OUTPUT")
    wall = _timed([str(REPO / "scripts" / "run"), str(prep.cohort / "manifest.tsv"), str(prep.cohort), str(pred)], env)
    ref_wall = json.loads((a.out / f"reference-{a.crop_mode}.json").read_text())["wall_s"]
    ref = np.fromfile(prep.reference, "<i4")
    res = agreement(read_i32(pred, len(ref)), ref)
    timing = json.loads(report.read_text())
    summary = {
        "images": len(ref), "unreadable_for_reference": res.unreadable,
        "agreement": f"{res.matches}/{res.total}", "agreement_rate": round(res.rate, 6),
        "verdict": "PASS" if res.passed else "FAIL",
        "abi_wall_s": wall, "reference_wall_s": ref_wall, "speedup_vs_reference": round(ref_wall / wall, 2),
        "backend": timing["backend"], "decoder": timing["decoder"], "stages": timing["stages"],
        "artifact": str(prep.artifact), "predictions": str(pred),
    }
    print(json.dumps(summary, indent=1))
    return 0 if res.passed else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluator.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", choices=("run", "prepare"), default="run")
    p.add_argument("--out", type=Path, default=Path("demo"))
    p.add_argument("--count", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--crop-mode", choices=("center", "squash"), default="squash")
    p.add_argument("--backend", choices=tuple(BACKENDS), default=DEFAULT_BACKEND, help="engine.backends")
    p.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp32")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--artifact", type=Path, help="artifact dir (run: artifacts/default; prepare: OUT/artifact)")
    a = p.parse_args(argv)
    if a.command == "prepare":
        prep = prepare(a.out, a.count, a.seed, a.crop_mode, a.backend, a.batch_size, a.artifact, a.precision)
        print(json.dumps({k: str(v) for k, v in prep.__dict__.items() if k != "build_args"}))
        return 0
    a.artifact = a.artifact or REPO / "artifacts" / "default"
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
