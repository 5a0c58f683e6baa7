"""Build-step checks of an artifact: is it current for these build flags, and does it run?

    python -m evaluator.contest.selfcheck current -- ENGINE_BUILD_FLAGS...   # exit 0 reuse, 1 stale, 2 bad input
    python -m evaluator.contest.selfcheck run --artifact DIR [--timeout S]
    python -m evaluator.contest.selfcheck recorded CHECKPOINT                  # KNOB=value lines for build.sh

`current` takes exactly the flags `python -m engine.build` would get (--out names the
artifact) and says whether the artifact there is intact (SHA-256 of every file) and was
made from the same checkpoint bytes, spec, backend and device. `run` renders one
generated image, writes a one-row manifest in a temp dir, runs `scripts/run` on it as a
whole process and checks the output is one little-endian int32 in [0, 999]. Both print
one JSON line on stdout and say why on stderr when they fail. `recorded` prints the spec a
checkpoint records in its safetensors metadata (the kit's generated checkpoints record
their model, input size, crop and model kwargs) as shell-quoted `ENGINE_...=value` lines,
nothing for a checkpoint that records none; build.sh takes them where the user set no knob.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# caches scripts/run points into TMPDIR; a file there after the check means the run compiled
COMPILE_CACHES = ("inductor", "triton", "cupy")
RUN_TIMEOUT_S = 900.0   # scripts/run on one image, its artifact's load and warm-up included


PROG = "python -m evaluator.contest.selfcheck"


def _err(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr)


def stale_reasons(build_argv: list[str]) -> list[str]:
    """Why the artifact named by `--out` in `build_argv` cannot be reused ([] = reusable)."""
    from engine.classify.artifact import ArtifactError, load_artifact
    from engine.core.spec import Spec, resolve_spec
    from engine.io import sha256_file
    from engine.tuning import parse_args

    a = parse_args(build_argv)
    if not (a.out / "manifest.json").is_file():
        return [f"no artifact at {a.out}"]
    try:
        art = load_artifact(a.out, verify="sha256")
    except ArtifactError as e:
        return [f"artifact is not intact: {e}"]
    reasons = []
    # the same mapping engine.tuning.command applies, so the comparison is one-to-one with the flags;
    # what auto measured is the artifact's, provided it was measured on a machine like this one
    precision = art.precision if a.precision == "auto" else a.precision
    batch = art.batch_size if a.batch_size == "auto" else a.batch_size
    if a.auto:
        from engine.tuning.auto import device_name

        search = art.meta.get("build", {}).get("search")
        here = device_name(a.device)
        if search is None:
            reasons.append("the artifact was not measured on this machine (no build.search; auto measures)")
        elif search.get("device") != here:
            reasons.append(f"measured on {search.get('device')}, this machine is {here}")
    spec = resolve_spec(a.model, precision=precision, batch_size=batch, input_size=a.input_size,
                        crop_mode=a.crop_mode, crop_pct=a.crop_pct, interpolation=a.interpolation,
                        num_classes=a.num_classes, model_kwargs=a.model_kwargs)
    want_sha = sha256_file(a.checkpoint)
    have_sha = art.meta.get("checkpoint", {}).get("sha256")
    if have_sha != want_sha:
        reasons.append(f"checkpoint sha256 {str(have_sha)[:12]} != {want_sha[:12]} ({a.checkpoint})")
    have_spec = Spec.from_dict(art.meta["spec"]).to_json()
    if have_spec != spec.to_json():
        diff = sorted(k for k, v in spec.to_dict().items() if art.meta["spec"].get(k) != v)
        reasons.append(f"spec differs in {diff}")
    if a.backend != "auto" and art.backend != a.backend:
        reasons.append(f"backend {art.backend} != {a.backend}")
    if art.device != a.device:
        reasons.append(f"device {art.device} != {a.device}")
    return reasons


def current(build_argv: list[str]) -> int:
    from engine.cli import error, one_line

    try:
        reasons = stale_reasons(build_argv)
    except (OSError, ValueError, RuntimeError) as e:
        return error(PROG, f"cannot compare the artifact with the build flags: {one_line(e)}")
    print(json.dumps({"reusable": not reasons, "reasons": reasons}))
    for r in reasons:
        _err(f"stale: {r}")
    return 0 if not reasons else 1


# safetensors metadata key -> the build.sh knob it stands for
RECORDED_KNOBS = {"model": "ENGINE_MODEL", "input_size": "ENGINE_INPUT_SIZE", "crop_mode": "ENGINE_CROP_MODE",
                  "crop_pct": "ENGINE_CROP_PCT", "model_kwargs": "ENGINE_MODEL_KWARGS"}


def recorded_spec(checkpoint: Path) -> dict[str, str]:
    """{knob: value} of the spec fields a safetensors checkpoint records in its metadata ({} when none)."""
    return {RECORDED_KNOBS[k]: v if isinstance(v, str) else json.dumps(v, sort_keys=True)
            for k, v in recorded_fields(checkpoint).items()}


def recorded_fields(checkpoint: Path) -> dict:
    """{spec field: value} a safetensors checkpoint records in its metadata (model, input_size,
    crop_mode, crop_pct, model_kwargs; {} when none). Values are JSON-encoded strings there (the
    kit's generator writes them so); plain strings are taken as they are."""
    with open(checkpoint, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if not 0 < n <= 100 << 20:            # not a safetensors file (a torch pickle, ...): nothing recorded
            return {}
        try:
            meta = json.loads(f.read(n)).get("__metadata__") or {}
        except (ValueError, AttributeError):
            return {}
    out = {}
    for key in RECORDED_KNOBS:
        if key not in meta:
            continue
        try:
            out[key] = json.loads(meta[key])
        except ValueError:
            out[key] = meta[key]
    return out


def recorded(checkpoint: Path) -> int:
    import shlex

    for knob, value in recorded_spec(checkpoint).items():
        print(f"{knob}={shlex.quote(value)}")
    return 0


def write_probe(folder: Path, seed: int = 0) -> Path:
    """One generated JPEG plus a one-row manifest in `folder`; returns the manifest path."""
    import numpy as np

    from evaluator.synthetic.cohort import encode, render, templates

    rng = np.random.default_rng(seed)
    data, _ = encode(render(templates(1, seed)[0], 320, 240, rng), rng, "rgb")
    (folder / "images").mkdir(parents=True, exist_ok=True)
    (folder / "images" / "probe.JPEG").write_bytes(data)
    manifest = folder / "manifest.tsv"
    manifest.write_text("selfcheck-0\timages/probe.JPEG\n")  # LF only: CRLF is the entrant's bug to avoid
    return manifest


def slow_decoder(artifact: Path) -> str | None:
    """Why the run of a CUDA artifact would decode with something slower than dali-gpu here (None:
    it would not, or ENGINE_SLOW_DECODER_OK=1 accepts it)."""
    from engine import settings
    from engine.decoders import slow_decoder_reason

    if settings.slow_decoder_ok():
        return None
    try:
        meta = json.loads((artifact / "manifest.json").read_text())
    except (OSError, ValueError):
        return None                      # the run below says what is wrong with the artifact
    return slow_decoder_reason(meta.get("device", "cpu"), settings.decoder(), meta.get("decoder"))


def run_check(artifact: Path, timeout: float = RUN_TIMEOUT_S) -> int:
    """Run scripts/run on one generated image with `artifact`; 0 when the output is sane. 1 before
    that when a CUDA artifact would decode with a slow fallback (engine.decoders.slow_decoder_reason)."""
    from evaluator.contest.agreement import read_i32
    from evaluator.contest.task import COHORT_IMAGES

    why = slow_decoder(artifact)
    if why:
        _err(f"{why}: tens of seconds more on {COHORT_IMAGES:,} images (ENGINE_SLOW_DECODER_OK=1 accepts it)")
        return 1

    work = Path(tempfile.mkdtemp(prefix="selfcheck-"))
    try:
        manifest = write_probe(work / "input")
        out, tmp = work / "out", work / "tmp"
        out.mkdir()
        tmp.mkdir()
        env = {**os.environ, "ENGINE_ARTIFACT": str(artifact.resolve()), "TMPDIR": str(tmp)}
        env.pop("CONTEST_REPORT", None)
        t0 = time.perf_counter()
        try:
            r = subprocess.run([str(REPO / "scripts" / "run"), str(manifest), str(work / "input"),
                                str(out / "predictions.i32")], env=env, capture_output=True, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            _err(f"scripts/run did not finish within {timeout:.0f} s on one image")
            return 1
        wall = round(time.perf_counter() - t0, 3)
        if r.returncode != 0:
            _err(f"scripts/run exited {r.returncode} on one generated image; its stderr:\n{r.stderr[-4000:]}")
            return 1
        pred = out / "predictions.i32"
        if not pred.is_file():
            _err("scripts/run exited 0 but wrote no output file")
            return 1
        try:
            top1 = read_i32(pred, n=1)  # exactly 4 bytes, value in [0, 999]
        except ValueError as e:
            _err(f"bad output: {e}")
            return 1
        compiled = [str(p.relative_to(tmp)) for c in COMPILE_CACHES if (tmp / c).is_dir()
                    for p in (tmp / c).rglob("*") if p.is_file()]
        if compiled:
            _err(f"the run compiled at run time (files in its compile caches): {compiled[:5]}")
            return 1
        print(json.dumps({"ok": True, "artifact": str(artifact), "top1": int(top1[0]), "wall_s": wall}))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    from engine.cli import MAX_DEADLINE_S, HelpFormatter, finite_float, guard, parser

    p = parser(PROG, __doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("current", help="exit 0 when the artifact at --out is intact and matches the flags",
                       formatter_class=HelpFormatter)
    c.add_argument("build_argv", nargs=argparse.REMAINDER, help="the flags for python -m engine.build")
    r = sub.add_parser("run", help="one generated image through scripts/run", formatter_class=HelpFormatter)
    r.add_argument("--artifact", type=Path, required=True, help="the artifact to check")
    r.add_argument("--timeout", type=finite_float(0.0, MAX_DEADLINE_S, "s", lo_open=True), default=RUN_TIMEOUT_S, help="seconds scripts/run may take on one image")
    k = sub.add_parser("recorded", help="the spec knobs a checkpoint records, as KNOB=value lines",
                       formatter_class=HelpFormatter)
    k.add_argument("checkpoint", type=Path)
    a = p.parse_args(argv)
    if a.command == "recorded":
        return guard(PROG, lambda: recorded(a.checkpoint), debug=a.debug)
    if a.command == "current":
        argv_ = a.build_argv[1:] if a.build_argv[:1] == ["--"] else a.build_argv
        return guard(PROG, lambda: current(argv_), debug=a.debug)
    if not (a.artifact / "manifest.json").is_file():
        p.error(f"--artifact {a.artifact}: no manifest.json there (not an artifact)")
    return guard(PROG, lambda: run_check(a.artifact, a.timeout), debug=a.debug)


if __name__ == "__main__":
    sys.exit(main())
