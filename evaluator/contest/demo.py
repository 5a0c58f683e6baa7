"""The embedded default, end to end: cohort -> tiny checkpoint -> artifact -> ABI vs reference.

    python -m evaluator.demo [run] [--out demo] [--count 200] [--crop-mode squash] [--backend NAME]
    python -m evaluator.demo prepare --out DIR [--count N] [--seed S]

`run` (the default) says what it runs, makes what is missing under OUT (untimed), then
times the naive FP32 reference path and the optimized contest ABI (`scripts/run`) as
whole processes, fresh every time, alternated (reference, optimized, reference,
optimized: `--repeats` each) under one environment (the same OpenMP and thread
settings, TMPDIR inside OUT). It prints a short summary (agreement against the 99 %
gate, both wall times, their ratio, where the optimized run spent its time) and then
the same facts as JSON (also written to OUT/demo.json). Exit 0 when agreement passes,
1 when it does not or a step fails (the end of its log is shown), 2 for a bad flag or
environment value. Everything it writes is under OUT; each process's
stderr is kept in OUT/logs/.

`prepare` writes OUT/cohort/, OUT/tiny_eva02.safetensors, OUT/artifact/ and
OUT/reference.i32 for campaigns, benchmarks and the rehearsal. Finished steps are reused.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine.backends import BACKENDS
from engine.backends import DEFAULT as DEFAULT_BACKEND
from engine.io import mark_owned, marked
from engine.presets import preset

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m evaluator.demo"
BATCH = preset("cpu").static_batch_size   # the demo builds on the CPU: its preset's static batch
DEFAULT_COUNT = 200      # first run ~4-5 min on two shared cores (checkpoint fit, AOT compile); reruns ~1 min
MAX_COUNT = 100_000
HEARTBEAT_S = 10.0       # a line this often while a child process runs


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
    print(f"demo: {msg}", file=sys.stderr, flush=True)


# engine.settings getters whose variables the child processes read: a bad value is the
# user's mistake, said once before any work rather than as a failed child minutes later
CHILD_SETTINGS = ("decoder", "cuda_graphs", "artifact_verify", "pipeline_depth", "readers", "fast_exit",
                  "progress", "guard", "threads", "max_file_bytes", "decoder_isolate")


def check_environment() -> None:
    """Read every engine switch the children will read; raises engine.settings.SettingsError."""
    from engine import settings

    for name in CHILD_SETTINGS:
        getter = getattr(settings, name, None)
        if getter is not None:
            getter()


def child_env(out: Path) -> dict[str, str]:
    """One environment for every child process: the caller's, plus passive OpenMP waits (as
    scripts/run sets them) and TMPDIR with every cache inside OUT."""
    env = {**os.environ}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # busy-waiting OpenMP threads starve 2 cores
    tmp = out.resolve() / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env.update({"TMPDIR": str(tmp), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
                "TRITON_CACHE_DIR": str(tmp / "triton"), "HF_HUB_OFFLINE": "1",
                "PYTHONPATH": f"{REPO}{os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else ''}"})
    return env


class _Heartbeat:
    """A stderr line every HEARTBEAT_S while a long child process runs (the clock is not touched)."""

    def __init__(self, what: str):
        self.what, self._stop = what, threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            _log(f"{self.what}: still running, {time.monotonic() - self._t0:.0f} s")

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()


def _child(cmd: list[str], env: dict, log: Path, what: str) -> float:
    """Run one whole process with stderr (and stdout) into `log`; its wall seconds, start to reaped.
    A failure prints the log's tail and raises ChildFailed."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f, _Heartbeat(what):
        t = time.perf_counter()
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        wall = time.perf_counter() - t
    if rc != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        raise ChildFailed(f"{what} exited {rc}; the end of {log}:\n  " + "\n  ".join(tail))
    return round(wall, 3)


class ChildFailed(RuntimeError):
    """A step of the demo (a build, a run) failed: exit 1 with its log's tail."""


def claim_demo_folders(out: Path, artifact: Path, ckpt: Path) -> None:
    """UsageError, before anything is written, unless `out` may hold the demo (absent, empty, or
    an earlier demo's folder) and `artifact` may be (re)built (absent, empty, or an artifact of this
    kit, not holding the demo's checkpoint): engine.io.folder_refusal's rules."""
    from engine.cli import UsageError
    from engine.io import folder_refusal
    from engine.tuning.command import is_artifact_folder
    from evaluator.synthetic.cohort import kit_made

    def earlier_demo(d: Path) -> bool:   # a demo's folder, or one holding the kit's tiny checkpoint to reuse
        return marked(d, "demo") or (d / "cohort" / "cohort.json").is_file() or kit_made(d)

    why = (folder_refusal(out, "the demo folder", earlier_demo)
           or folder_refusal(artifact, "the artifact folder", is_artifact_folder, (ckpt,)))
    if why:
        raise UsageError(why)


def prepare(out: Path, count: int = DEFAULT_COUNT, seed: int = 0, crop_mode: str = "squash",
            backend: str = DEFAULT_BACKEND, batch_size: int = BATCH, artifact: Path | None = None,
            precision: str = "fp32", reference: bool = True) -> Prepared:
    """Make (or reuse) every input of a demo run under `out`; `reference=False` skips the
    (cached) reference answers, which `run` measures fresh instead."""
    from engine.io import sha256_file
    from evaluator.contest.selfcheck import stale_reasons
    from evaluator.synthetic.cohort import make_cohort, make_tiny_checkpoint

    cohort, ckpt = out / "cohort", out / "tiny_eva02.safetensors"
    artifact = artifact or out / "artifact"
    claim_demo_folders(out, artifact, ckpt)
    out.mkdir(parents=True, exist_ok=True)
    mark_owned(out, "demo")
    env = child_env(out)
    rec = cohort / "cohort.json"
    have = json.loads(rec.read_text()) if rec.is_file() else {}
    if (have.get("seed"), have.get("count")) != (seed, count):
        _log(f"generating {count} images (seed {seed}) in {cohort}")
        make_cohort(cohort, count, seed)
    recipe = ckpt.with_suffix(".json")
    if not ckpt.is_file() or not recipe.is_file() or json.loads(recipe.read_text()).get("seed") != seed:
        _log(f"fitting the tiny EVA-02 head on generated renders -> {ckpt}")
        make_tiny_checkpoint(ckpt, seed)
    build_args = _model_args(crop_mode) + ["--checkpoint", str(ckpt), "--out", str(artifact), "--backend", backend,
                                           "--batch-size", str(batch_size), "--precision", precision]
    ck_sha = sha256_file(ckpt)
    stale = stale_reasons(build_args)      # the build step's own check: intact, same checkpoint, spec, backend
    if stale:
        _log(f"building the {backend} artifact in {artifact} ({stale[0]}; untimed preparation, log in "
             f"{out / 'logs'})")
        _child([sys.executable, "-m", "engine.build", *build_args], env, out / "logs" / "build.log",
               f"building the {backend} artifact")
    link = out / "reference.i32"
    if reference:
        ref, ref_meta = out / f"reference-{crop_mode}.i32", out / f"reference-{crop_mode}.json"
        key = {"checkpoint": ck_sha, "manifest": sha256_file(cohort / "manifest.tsv"), "crop_mode": crop_mode}
        if not ref.exists() or not ref_meta.exists() or json.loads(ref_meta.read_text()).get("key") != key:
            _log("running the naive FP32 reference path (PIL + timm eager, batch 1)")
            t = _child(_reference_cmd(cohort, ref, crop_mode, ckpt), env, out / "logs" / "reference.log",
                       "the reference run")
            ref_meta.write_text(json.dumps({"key": key, "wall_s": t}) + "\n")
        link.unlink(missing_ok=True)
        link.write_bytes(ref.read_bytes())
    return Prepared(cohort, ckpt, artifact, link, build_args)


def _reference_cmd(cohort: Path, output: Path, crop_mode: str, ckpt: Path) -> list[str]:
    return [sys.executable, "-m", "evaluator.reference", str(cohort / "manifest.tsv"), str(cohort), str(output),
            *_model_args(crop_mode), "--checkpoint", str(ckpt)]


def _describe(a) -> list[str]:
    """The first lines, printed before any work: what runs, on what, and what to expect."""
    from evaluator.contest.agreement import GATE
    from evaluator.synthetic.cohort import BROKEN, TINY_INPUT, TINY_KWARGS, TINY_MODEL

    planted = max(1, a.count // 100)              # make_cohort's default share of broken files
    kinds = ", ".join(sorted({BROKEN[j % len(BROKEN)] for j in range(planted)}))
    patches = TINY_INPUT // 14
    artifact = a.artifact or a.out / "artifact"
    return [
        "demo: the contest ABI against the naive FP32 reference, on generated data (no ImageNet, no downloads)",
        f"  model      {TINY_MODEL} cut to {TINY_KWARGS['depth']} blocks (timm's has 12), {TINY_INPUT} px input "
        f"({patches} x {patches} patches), head fit on generated renders: a stand-in, not EVA-02-L/448",
        f"  cohort     {a.count} generated JPEGs (seed {a.seed}) in {a.out / 'cohort'}; {planted} planted broken on "
        f"purpose ({kinds}): every run reports them as unreadable, and that is expected",
        f"  optimized  scripts/run with the {a.backend} artifact in {artifact} (batch {a.batch_size}, {a.precision})",
        "  reference  python -m evaluator.reference: PIL + timm eager FP32, one image at a time",
        f"  timing     {a.repeats} fresh processes of each, alternated, same environment; medians, start to reaped",
        f"  pass       top-1 agreement >= {GATE:.0%} on the images the reference can read",
        f"  output     everything under {a.out} (stderr of each process in {a.out / 'logs'})",
    ]


def _planted_line(prep: Prepared) -> str:
    from evaluator.contest.manifest import read_manifest
    from evaluator.synthetic.cohort import broken_items

    record = json.loads((prep.cohort / "cohort.json").read_text())
    rows = {r.path: r.line for r in read_manifest(prep.cohort / "manifest.tsv")}
    return "  planted    " + ", ".join(f"row {rows[it['path']]} ({it['encoding'].split(':', 1)[1]}, {it['path']})"
                                      for it in broken_items(record))


def _median_stages(timings: list[dict]) -> dict:
    keys = [k for k in timings[0]["stages"] if all(k in t["stages"] for t in timings)]
    return {k: round(statistics.median(t["stages"][k] for t in timings), 3) for k in keys}


def _unreadable_lines(log: Path) -> int:
    return sum(1 for line in log.read_text(errors="replace").splitlines() if "unreadable" in line)


def measure(a, prep: Prepared) -> dict:
    """Alternate fresh reference and optimized processes; agreement of every optimized run."""
    import numpy as np

    from evaluator.contest.agreement import agreement, read_i32

    env = child_env(a.out)
    env["ENGINE_ARTIFACT"] = str(prep.artifact.resolve())
    runs, logs = a.out / "runs", a.out / "logs"
    runs.mkdir(parents=True, exist_ok=True)
    walls: dict[str, list[float]] = {"reference": [], "optimized": []}
    refs, preds, timings, unreadable = [], [], [], []
    for i in range(1, a.repeats + 1):
        ref = runs / f"reference-{i}.i32"
        _log(f"reference run {i} of {a.repeats} (PIL + timm eager, batch 1) ...")
        walls["reference"].append(_child(_reference_cmd(prep.cohort, ref, a.crop_mode, prep.checkpoint), env,
                                         logs / f"reference-{i}.log", f"reference run {i}"))
        _log(f"reference run {i}: {walls['reference'][-1]:.2f} s")
        refs.append(np.fromfile(ref, "<i4"))
        pred, report = runs / f"predictions-{i}.i32", runs / f"timing-{i}.json"
        _log(f"optimized run {i} of {a.repeats} (scripts/run MANIFEST IMAGE_ROOT OUTPUT) ...")
        walls["optimized"].append(_child([str(REPO / "scripts" / "run"), str(prep.cohort / "manifest.tsv"),
                                          str(prep.cohort), str(pred), "--report", str(report)], env,
                                         logs / f"optimized-{i}.log", f"optimized run {i}"))
        _log(f"optimized run {i}: {walls['optimized'][-1]:.2f} s")
        unreadable.append(_unreadable_lines(logs / f"optimized-{i}.log"))
        preds.append(read_i32(pred, len(refs[-1])))
        timings.append(json.loads(report.read_text()))
    ref = refs[-1]
    (a.out / "reference.i32").write_bytes(ref.astype("<i4").tobytes())
    (a.out / "predictions.i32").write_bytes(preds[-1].astype("<i4").tobytes())
    results = [agreement(p, ref) for p in preds]
    worst = min(results, key=lambda r: r.rate)
    med = {k: round(statistics.median(v), 3) for k, v in walls.items()}
    return {
        "walls": walls, "medians": med, "ratio": round(med["reference"] / med["optimized"], 2),
        "worst": worst, "all_passed": all(r.passed for r in results),
        "references_agree": all(np.array_equal(r, ref) for r in refs),
        "timing": timings[-1], "stages": _median_stages(timings), "unreadable_lines": unreadable,
        "env": {k: env.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "TMPDIR")},
    }


def _summary_lines(m: dict, planted: int) -> list[str]:
    from evaluator.contest.agreement import GATE

    w, s = m["worst"], m["stages"]
    verdict = "PASS" if m["all_passed"] else "FAIL"
    lines = [
        f"agreement  {w.matches}/{w.total} = {100 * w.rate:.2f} % of the images the reference can read: {verdict} "
        f"at the {GATE:.0%} gate (worst of {len(m['walls']['optimized'])} runs; the {w.unreadable} unreadable "
        "rows have no reference answer and are left out)",
        f"wall time  reference {m['medians']['reference']:.2f} s, optimized {m['medians']['optimized']:.2f} s "
        f"(medians of {len(m['walls']['optimized'])} fresh processes each: {_fmt_list(m['walls']['reference'])} "
        f"and {_fmt_list(m['walls']['optimized'])} s): reference / optimized = {m['ratio']:.2f}x",
        f"optimized  imports {s.get('imports', 0):.2f} s, artifact load {s.get('artifact_load', 0):.2f} s, "
        f"pipeline {s.get('pipeline', 0):.2f} s (busy: read {s.get('read', 0):.2f}, decode {s.get('decode', 0):.2f}, "
        f"inference {s.get('inference', 0):.2f} s, overlapped), write {s.get('write', 0):.2f} s; "
        f"in-process total {s.get('total', 0):.2f} s",
    ]
    if any(n != planted for n in m["unreadable_lines"]):
        lines.append(f"note       scripts/run reported {m['unreadable_lines']} unreadable rows; {planted} were planted")
    if not m["references_agree"]:
        lines.append("note       the reference runs disagree with each other: the last one is used")
    return lines


def _fmt_list(xs: list[float]) -> str:
    return "/".join(f"{x:.2f}" for x in xs)


def run(a) -> int:
    from evaluator.synthetic.cohort import broken_items

    print("\n".join(_describe(a)), flush=True)
    prep = prepare(a.out, a.count, a.seed, a.crop_mode, a.backend, a.batch_size, a.artifact, a.precision,
                   reference=False)
    print(_planted_line(prep), flush=True)
    m = measure(a, prep)
    planted = len(broken_items(json.loads((prep.cohort / "cohort.json").read_text())))
    w = m["worst"]
    summary = {
        "images": len(json.loads((prep.cohort / "cohort.json").read_text())["items"]),
        "planted_broken": planted, "unreadable_for_reference": w.unreadable,
        "agreement": f"{w.matches}/{w.total}", "agreement_rate": round(w.rate, 6), "gate": w.gate,
        "verdict": "PASS" if m["all_passed"] else "FAIL",
        "optimized_wall_s": m["walls"]["optimized"], "reference_wall_s": m["walls"]["reference"],
        "optimized_wall_median_s": m["medians"]["optimized"], "reference_wall_median_s": m["medians"]["reference"],
        "speedup_vs_reference": m["ratio"],
        "order": ["reference", "optimized"] * a.repeats,
        "environment": m["env"],
        "backend": m["timing"]["backend"], "decoder": m["timing"]["decoder"],
        "stages": m["stages"],
        "stages_note": "median durations in seconds; imports and total count from process start; read, decode "
                       "and inference are busy times of overlapped pipeline stages (they add up to more than "
                       "pipeline)",
        "unreadable_reported_by_run": m["unreadable_lines"], "references_agree": m["references_agree"],
        "artifact": str(prep.artifact), "predictions": str(a.out / "predictions.i32"),
        "reference": str(a.out / "reference.i32"), "logs": str(a.out / "logs"),
    }
    (a.out / "demo.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(_summary_lines(m, planted)))
    print(json.dumps(summary, indent=1))
    return 0 if m["all_passed"] else 1


def parse_args(argv: list[str] | None):
    from engine.cli import SEED, parser, whole_number

    p = parser(PROG, __doc__.split("\n\n")[0], {
        "OMP_WAIT_POLICY": "passed to every child process (default PASSIVE, as scripts/run sets it)",
        "OMP_NUM_THREADS": "passed unchanged to every child process",
        "ENGINE_DEBUG": "1: tracebacks instead of one-line errors"})
    p.add_argument("command", nargs="?", choices=("run", "prepare"), default="run",
                   help="run: measure and compare; prepare: write the inputs only")
    p.add_argument("--out", type=Path, default=Path("demo"), help="folder for everything the demo writes")
    p.add_argument("--count", type=whole_number(2, MAX_COUNT, "images"), default=DEFAULT_COUNT, help="generated images (1 %% planted broken)")
    p.add_argument("--seed", type=SEED, default=0, help="cohort and checkpoint seed")
    p.add_argument("--crop-mode", choices=("center", "squash"), default="squash", help="spec crop mode")
    p.add_argument("--backend", choices=tuple(BACKENDS), default=DEFAULT_BACKEND, help="runtime backend")
    p.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp32", help="artifact precision")
    p.add_argument("--batch-size", type=whole_number(1, 1024, "images"), default=BATCH, help="static batch of the artifact")
    p.add_argument("--repeats", type=whole_number(1, 20), default=2, help="timed processes of each path (run)")
    p.add_argument("--artifact", type=Path, help="artifact dir (default OUT/artifact)")
    a = p.parse_args(argv)
    if not 2 <= a.count <= MAX_COUNT:
        p.error(f"--count must be in 2..{MAX_COUNT} (1 %% of the images, at least one, are planted broken), "
                f"got {a.count}")
    if not 1 <= a.batch_size <= 1024:
        p.error(f"--batch-size must be in 1..1024, got {a.batch_size}")
    if not 1 <= a.repeats <= 20:
        p.error(f"--repeats must be in 1..20, got {a.repeats}")
    return a


def main(argv: list[str] | None = None) -> int:
    from engine.cli import guard

    a = parse_args(argv)

    def body() -> int:
        check_environment()
        try:
            if a.command == "prepare":
                prep = prepare(a.out, a.count, a.seed, a.crop_mode, a.backend, a.batch_size, a.artifact,
                               a.precision)
                print(json.dumps({k: str(v) for k, v in prep.__dict__.items() if k != "build_args"}))
                return 0
            return run(a)
        except ChildFailed as e:
            print(f"{PROG}: failed: {e}", file=sys.stderr)
            return 1

    return guard(PROG, body, debug=a.debug)


if __name__ == "__main__":
    sys.exit(main())
