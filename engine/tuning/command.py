"""The untimed preparation step: checkpoint -> artifact directory.

    python -m engine.build --model NAME --checkpoint FILE --out DIR [--device cpu|cuda]
        [--precision auto|fp32|bf16|fp16|fp8|int8] [--backend auto|NAME] [--batch-size auto|N]
        [--input-size N] [--crop-mode center|squash] [--crop-pct F] [--model-kwargs JSON]
        [--no-guard] [--calibration-source photos|renders] [--calibration-images DIR]
        [--calibration-check MODULE:FUNCTION] [--guard-budget BP] [--guard-safety F]
        [--recheck-batch N|auto] [--run-images N] [--search-budget-s S] [--deadline-s S]

Precision, backend and batch size default to the device's preset (engine/presets/classification.py):
`auto` there, measured on this machine (engine.tuning.auto). Below FP32 the network follows
the mixed-precision policy (engine.core.precision) and the build is guarded by default
(engine.classify.guard): the low-precision graph also returns its top-1/top-2 margin, a second FP32
graph of `--recheck-batch` images re-checks the rows under tau, and tau is chosen here on
natural photos that are not evaluation data (engine.tuning.calibrate: scikit-image's bundled
photos, or `--calibration-images DIR`) as the smallest threshold whose estimated
disagreement rate, times a safety factor, stays under `--guard-budget` (in basis points of
the images: 1 is 0.01 %). The build prints the budget, tau and the expected re-checked
fraction; renders only check that the low-precision graph is not broken. `--no-guard`
builds the raw low-precision form.

`build()` makes the build's state once (engine.tuning.context.BuildContext: spec, device, its
preset, guard, auto config, clock, work folder, network, manifest extras) and hands it to the
assembly (engine.tuning.assemble) or the measured build (engine.tuning.auto).

A measured build keeps one deadline (`--deadline-s`, the preset's `build_deadline_s`): it
prints its plan (estimated seconds per phase) first and what each phase took last, and the
manifest records both (engine.tuning.clock).

The artifact is written into a work folder beside it and renamed into place, so an
interrupted build never leaves a directory that looks complete. `--out` must be an artifact
folder: an empty path, `.`, the current directory, the project or a folder above either, a file,
a folder holding the checkpoint, and a non-empty folder that holds no manifest.json of this kit
are refused in one line before anything is read or changed (engine.io.folder_refusal); one build
of a folder runs at a time (its lock, beside it), and a killed build's work folder is removed by
the next build (artifact_folder).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from engine import backends
from engine.core.spec import CROP_MODES, PRECISIONS, Spec, resolve_spec
from engine.io import folder_refusal, share_tree_like_root
from engine.presets import PRESETS, per_device, preset
from engine.tuning.assemble import RECHECK_DIR, assemble, measure_batch_size  # noqa: F401 - re-exported
from engine.tuning.context import AutoConfig, BuildContext, GuardConfig  # noqa: F401 - re-exported


def build(spec: Spec, checkpoint: Path | None, out: Path, backend: str = backends.DEFAULT,
          device: str = "cpu", guard: GuardConfig | None = None, auto: AutoConfig | None = None) -> dict:
    """Build the artifact for `spec` with `backend` (a name in engine.backends) and return its manifest.
    `auto`: measure the candidates on this machine and build the fastest that holds (engine.tuning.autotune),
    every phase inside one deadline kept on `auto.clock` (engine.tuning.clock). The build's state is one
    engine.tuning.context.BuildContext, made here and handed down."""
    import torch

    from engine.classify.tf32_off import set_fp32_math
    from engine.core.checkpoint import load_model
    from engine.tuning.clock import BuildClock, say

    # the device preset's values where the caller left None, looked up once
    ctx = BuildContext(spec, device, guard or GuardConfig(), checkpoint=checkpoint, auto=auto)
    guard, pre = ctx.guard, ctx.preset
    why = folder_refusal(out, "the artifact folder", is_artifact_folder, (checkpoint, guard.calibration_images))
    if why:
        raise ValueError(why)
    be = backends.get(backend) if auto is None or not auto.backend else None
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda needs a CUDA GPU on the build machine")
    if checkpoint is None and (be is None or be.NEEDS_WEIGHTS):
        raise ValueError(f"backend {backend} needs --checkpoint")
    if be is not None and spec.precision == "int8":
        why = quantized_refusal(be, backend, spec.precision, device)
        if why:
            raise ValueError(why)
    ctx.t0 = time.perf_counter()
    if auto is not None:
        ctx.clock = BuildClock(auto.deadline_s if auto.deadline_s is not None else pre.build_deadline_s,
                               {"checkpoint": pre.checkpoint_estimate_s, "calibration": pre.calibration_estimate_s,
                                "recheck": pre.compile_estimate_s, "verify": pre.verify_estimate_s}, auto.clock)
        if checkpoint is None or Path(checkpoint).is_file():   # else load_model's one error line, no plan
            say(ctx.clock.plan_line())
    math = set_fp32_math()   # the calibration reference and the re-check graph: IEEE FP32 (ENGINE_TF32)
    with artifact_folder(out) as tmp:   # OUT's lock first: a second build stops before it loads anything
        ctx.work = tmp
        with ctx.clock.phase("checkpoint") if ctx.clock else contextlib.nullcontext():
            ctx.net = load_model(spec, checkpoint) if be is None or be.NEEDS_WEIGHTS else None
        ctx.extra = {"build": {"argv": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
                     "fp32_math": math}
        if auto is not None:
            from engine.tuning import auto as build_auto

            spec, backend, meta = build_auto.build_measured(ctx, backend)
        else:
            meta = assemble(ctx, backend, spec)
    if ctx.clock is not None:
        say(ctx.clock.actual_line())
    return meta


def quantized_refusal(be, backend: str, precision: str, device: str) -> str | None:
    """Why a fixed build of a quantized precision (int8) cannot be made with `backend` here (None: it can)."""
    from engine.core.int8 import cannot_build

    if precision not in getattr(be, "QUANTIZED", ()):
        return f"--precision {precision} is built by a quantizing backend (aot), not {backend}"
    why = cannot_build(device)
    return f"--precision {precision}: {why}" if why else None


def is_artifact_folder(folder: Path) -> bool:
    """`folder` holds a manifest.json this kit wrote (its format field): a build may replace it."""
    from engine.classify.artifact import FORMAT, MANIFEST

    try:
        fmt = json.loads((folder / MANIFEST).read_text()).get("format", "")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(fmt, str) and fmt.split("/")[0] == FORMAT.split("/")[0]


@contextlib.contextmanager
def artifact_folder(out: Path):
    """Yield an empty folder to build the artifact `out` in; on a clean exit it replaces `out` whole.

    The build of OUT holds OUT's lock, PARENT/.OUT.lock, from before its work folder exists until
    the commit is done (the file is removed then): a second build of OUT stops in one line, so nothing but the lock's holder
    ever commits. The work folder PARENT/.OUT.build-<random> (the artifact being made, the search's
    candidates, the artifact it replaces) is held under its owner lock (engine.io.make_owned_temp):
    a killed build's is removed by the next build in PARENT, whatever its OUT; on every other exit
    it is removed here. The commit (two renames) runs with SIGTERM, SIGINT and SIGHUP held back,
    so a signal never leaves OUT missing between them."""
    import signal

    from engine.io import LockHeld, make_owned_temp, release_lock, sweep_abandoned, take_lock

    out = Path(os.path.realpath(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = out.parent / f".{out.name}.lock"
    try:
        lock_fd = take_lock(lock)
    except LockHeld as e:
        raise RuntimeError(f"another build of {out} is running (pid {e.holder} holds {lock}); this build stops "
                           "and changes nothing") from None
    try:
        for p in sweep_abandoned(out.parent, lambda n: n.startswith(".") and ".build-" in n):
            print(f"[engine.build] removed {p}, the work folder of a build that was killed", file=sys.stderr)
        work, owner_fd = make_owned_temp(out.parent, f".{out.name}.build-")
        try:
            tmp = work / "artifact"
            tmp.mkdir(mode=0o755)
            os.chmod(tmp, 0o755)   # whatever the umask: the run may be another (non-root) user
            yield tmp
            share_tree_like_root(tmp)   # a backend's 0600 file (or a private umask) must not lock a non-root run out
            held = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, held)
            committed = False
            try:
                if os.path.lexists(out):
                    os.replace(out, work / "replaced")
                os.replace(tmp, out)
                committed = True
            finally:
                try:
                    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
                except BaseException as e:   # a signal held back during the commit arrives now
                    e.committed = committed  # type: ignore[attr-defined]
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
            os.close(owner_fd)    # after the folder is gone: a sweeper never sees it unlocked
    finally:
        release_lock(lock_fd, lock)


ALL_BP = 1e4              # every image, in basis points: the most a disagreement budget can allow
MAX_BATCH = 4096          # images in one static batch: far past what one GPU holds at 448 px


def _batch_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto or a whole number in 1..{MAX_BATCH}, got {text!r}") from None
    if not 1 <= v <= MAX_BATCH:
        raise argparse.ArgumentTypeError(f"must be auto or a whole number in 1..{MAX_BATCH}, got {v}")
    return v


def _folder_check(text: str):
    """MODULE:FUNCTION -> the function (engine.tuning.calibrate.FolderCheck), imported now."""
    import importlib

    module, _, name = text.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name) if module and name else None
    except (ImportError, AttributeError) as e:
        raise argparse.ArgumentTypeError(f"cannot import {text!r}: {e}") from None
    if not callable(fn):
        raise argparse.ArgumentTypeError(f"must name a function as MODULE:FUNCTION, got {text!r}")
    return fn


def argument_parser(exit_on_error: bool = True) -> argparse.ArgumentParser:
    """The flags of `python -m engine.build`; exit_on_error=False raises argparse.ArgumentError
    (naming the flag) for a value argparse refuses, as a caller that maps flags to its own knobs wants."""
    from engine.cli import (
        MAX_DEADLINE_S,
        ArgumentParser,
        HelpFormatter,
        debug_flag,
        finite_float,
        json_object,
        whole_number,
    )

    seconds = finite_float(0.0, MAX_DEADLINE_S, "s", lo_open=True)
    images = whole_number(1, 10**9, "images")

    p = debug_flag(ArgumentParser(prog="python -m engine.build", description=__doc__.split("\n\n")[0],
                                  formatter_class=HelpFormatter, exit_on_error=exit_on_error))
    p.add_argument("--model", required=True, help="timm name of the model (required), e.g. eva02_large_patch14_448.mim_m38m_ft_in22k_in1k")
    p.add_argument("--checkpoint", type=Path,
                   help="local .safetensors / .pth / .bin (every backend but null needs one; default: none)")
    p.add_argument("--out", required=True, type=Path,
                   help="the artifact folder to write (required): absent, empty, or an artifact of this kit, which is "
                        "replaced as a whole, atomically; anything else is refused and left as it is")
    p.add_argument("--device", choices=tuple(PRESETS), default="cpu",
                   help="the device the artifact runs on and is measured on; it picks the preset (engine/presets/classification.py)")
    p.add_argument("--precision", choices=PRECISIONS + ("auto",),
                   help="auto: measured on this machine (engine.tuning.autotune): the fastest of the device's native "
                        "precisions that holds the guard's disagreement budget (default: the device preset's, "
                        f"engine/presets/classification.py: {per_device('precision')})")
    p.add_argument("--backend", choices=tuple(backends.BACKENDS) + ("auto",),
                   help="auto: the fastest measured of the backends that import here (default: the device "
                        f"preset's: {per_device('backend')})")
    p.add_argument("--batch-size", type=_batch_size,
                   help="static batch; auto: the fastest of the device preset's batch sizes, measured on the "
                        f"compiled graph (default: the device preset's: {per_device('batch_size')})")
    s = p.add_argument_group("measured build (any of precision, batch size, backend auto)")
    s.add_argument("--search-budget-s", type=seconds, default=None,
                   help="the search's cap: it spends at most this, and at most what the deadline leaves "
                        f"(default: the device preset's: {per_device('search_budget_s')})")
    s.add_argument("--deadline-s", type=seconds, default=None,
                   help="seconds for the whole measured (auto) build: checkpoint load, calibration reference, search, re-check "
                        "graph, verification each spend from it; past it the best verified candidate, else eager "
                        f"FP32 (default: the device preset's: {per_device('build_deadline_s')})")
    s.add_argument("--search-precisions", default=None,
                   help="comma-separated precisions to measure for --precision auto, native or not "
                        "(default: the ones this device runs natively)")
    s.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the chosen artifact's end-to-end check through scripts/run")
    p.add_argument("--input-size", type=whole_number(1, 8192, "px"),
                   help="side S of the square network input (default: the model's timm pretrained cfg)")
    p.add_argument("--crop-mode", choices=CROP_MODES,
                   help="center: the short side resized to S / crop-pct, then the centre S x S; squash: resized to "
                        "S x S directly (default: the model's timm pretrained cfg, else center)")
    p.add_argument("--crop-pct", type=finite_float(0.0, 1.0, lo_open=True),
                   help="the centre crop's share of the resized short side, in (0, 1] (default: the model's timm "
                        "pretrained cfg)")
    p.add_argument("--interpolation",
                   help="resize filter: bicubic, bilinear or nearest (default: the model's timm pretrained cfg)")
    p.add_argument("--num-classes", type=whole_number(1, 10**6), help="classes of the head (default: the model's timm pretrained cfg)")
    p.add_argument("--model-kwargs", type=json_object,
                   help="extra timm constructor kwargs as JSON (default: none)")
    g = p.add_argument_group("margin guard (precisions below fp32)")
    g.add_argument("--no-guard", dest="guard", action="store_false", help="build the raw low-precision form")
    g.add_argument("--calibration-source", choices=("photos", "renders"), default="photos",
                   help="images to choose tau on: crops of scikit-image's bundled photos, or procedural renders")
    g.add_argument("--calibration-images", type=Path,
                   help="folder of your own images (not evaluation data) to choose tau on, instead (default: none, "
                        "--calibration-source)")
    g.add_argument("--calibration-check", type=_folder_check, metavar="MODULE:FUNCTION",
                   help="function(folder, files) -> reasons to refuse --calibration-images (e.g. it holds "
                        "evaluation data) (default: none, the folder is taken as it is)")
    g.add_argument("--calibration-count", type=whole_number(16, 10**6, "images"),
                   help="calibration images tau is chosen on, at least 16 (default: under auto with a low "
                        "precision, the count whose calibration time plus a run's expected re-check time is least, "
                        f"from a pilot of the device preset's {per_device('calibration_count')}; else that many)")
    g.add_argument("--guard-budget", type=finite_float(0.0, ALL_BP, "bp", lo_open=True), metavar="BP",
                   help="disagreements with FP32 on PIL's pixels allowed, in basis points of the images (1 = 0.01 %%): "
                        "tau keeps its estimate under it, less the decoder's measured flips under auto "
                        f"(default: the device preset's: {per_device('guard_budget')})")
    g.add_argument("--guard-safety", type=finite_float(1.0, 1000.0),
                   help="factor (>= 1) on the estimated disagreements "
                        f"(default: the device preset's: {per_device('guard_safety')})")
    g.add_argument("--recheck-batch", type=_batch_size,
                   help="static batch of the FP32 re-check graph; auto: measured on the build device "
                        f"(default: the device preset's: {per_device('recheck_batch')})")
    g.add_argument("--recheck-backend", choices=tuple(backends.BACKENDS), default=None,
                   help="backend of the re-check graph (default: --backend)")
    g.add_argument("--run-images", type=images,
                   help="images one run classifies: --recheck-batch auto sizes its calls for them (default: a "
                        "long run, the fastest batch) and auto trades the calibration count against their "
                        "re-checks (default: none given, no trade: --calibration-count's images)")
    return p


def parse_args(argv: list[str] | None = None, exit_on_error: bool = True) -> argparse.Namespace:
    """The flags, checked, with the device preset's defaults filled in."""
    p = argument_parser(exit_on_error)
    a = p.parse_args(argv)
    pre = preset(a.device)
    a.precision = a.precision or pre.precision
    a.backend = a.backend or pre.backend
    a.batch_size = a.batch_size if a.batch_size is not None else pre.batch_size
    a.recheck_batch = a.recheck_batch if a.recheck_batch is not None else pre.recheck_batch
    a.calibration_trade = a.calibration_count is None      # unasked: auto trades the count from a pilot
    a.calibration_count = a.calibration_count if a.calibration_count is not None else pre.calibration_count
    a.guard_budget = a.guard_budget if a.guard_budget is not None else pre.guard_budget
    a.guard_safety = a.guard_safety if a.guard_safety is not None else pre.guard_safety
    if a.calibration_count < 16 or a.guard_safety < 1 or a.guard_budget <= 0:
        p.error("--calibration-count must be >= 16, --guard-safety >= 1 and --guard-budget > 0")
    if a.recheck_batch == "auto" and a.checkpoint is None:
        p.error("--recheck-batch auto measures the model: it needs --checkpoint")
    a.auto = "auto" in (a.precision, a.backend, a.batch_size)
    if a.auto and a.checkpoint is None:
        p.error("auto measures the model: it needs --checkpoint")
    if a.search_precisions is not None:
        a.search_precisions = tuple(x.strip() for x in a.search_precisions.split(",") if x.strip())
        bad = [x for x in a.search_precisions if x not in PRECISIONS]
        if bad or not a.search_precisions:
            p.error(f"--search-precisions takes {', '.join(PRECISIONS)}, got {', '.join(bad) or 'nothing'}")
    if a.search_budget_s is not None and a.search_budget_s <= 0:
        p.error("--search-budget-s must be > 0")
    if a.deadline_s is not None and a.deadline_s <= 0:
        p.error("--deadline-s must be > 0")
    return a


def plan(a: argparse.Namespace) -> tuple[Spec, GuardConfig, AutoConfig | None]:
    """What the parsed flags ask to build: the spec (an `auto` precision or batch starts from FP32 and
    the preset's static batch until the search picks), the guard, and what `auto` leaves to the
    measurement (None: nothing, a fixed build)."""
    fixed_batch = a.batch_size if a.batch_size != "auto" else preset(a.device).static_batch_size
    spec = resolve_spec(a.model, precision="fp32" if a.precision == "auto" else a.precision,
                        batch_size=fixed_batch, input_size=a.input_size, crop_mode=a.crop_mode,
                        crop_pct=a.crop_pct, interpolation=a.interpolation, num_classes=a.num_classes,
                        model_kwargs=a.model_kwargs)
    guard = GuardConfig(enabled=a.guard, calibration_images=a.calibration_images,
                        calibration_count=a.calibration_count, safety=a.guard_safety,
                        recheck_batch=a.recheck_batch, recheck_backend=a.recheck_backend, budget=a.guard_budget,
                        calibration_source=a.calibration_source, calibration_check=a.calibration_check,
                        run_images=a.run_images, calibration_trade=a.calibration_trade)
    auto = None
    if a.auto:
        auto = AutoConfig(a.precision == "auto", a.batch_size == "auto", a.backend == "auto",
                          a.search_precisions, a.search_budget_s, a.verify, a.deadline_s)
    return spec, guard, auto


def refuse(e: Exception, debug: bool) -> int:
    """A build that cannot be made: one `engine.build: error:` line and exit 2 (the traceback under --debug)."""
    from engine.cli import debugging

    if debugging(debug):
        raise e
    print(f"engine.build: error: {e}", file=sys.stderr)
    return 2


def _signal_name(sig: int) -> str:
    import signal

    return signal.Signals(sig).name


def report(out: Path, meta: dict) -> None:
    """The build's one stdout line: JSON naming the artifact and what was built."""
    print(json.dumps({"out": str(out), "backend": meta["backend"], "device": meta["device"],
                      "precision": meta["precision"], "batch_size": meta["batch_size"],
                      "seconds": meta["build"]["seconds"]}))


def main(argv: list[str] | None = None) -> int:
    from engine import settings
    from engine.children import Terminated, signals_exit

    a = parse_args(argv)                                                   # parse
    # --debug: the compiles read it (engine.backends.aot.quiet_reports), and so do the children
    with settings.debug_env(a.debug), signals_exit():
        try:
            spec, guard, auto = plan(a)                                    # plan
            meta = build(spec, a.checkpoint, a.out, backend=backends.DEFAULT if a.backend == "auto" else a.backend,
                         device=a.device, guard=guard, auto=auto)          # run the phases (engine.tuning.clock)
        except (OSError, ValueError, RuntimeError) as e:
            return refuse(e, a.debug)
        except (Terminated, KeyboardInterrupt) as e:   # its work folder and children are gone already
            sig = e.signal if isinstance(e, Terminated) else 2
            state = "was committed before it stopped" if getattr(e, "committed", False) else "is as it was"
            print(f"engine.build: stopped by signal {sig} ({_signal_name(sig)}): {a.out} {state}", file=sys.stderr)
            return 128 + sig
    report(a.out, meta)                                                    # write
    return 0


if __name__ == "__main__":
    sys.exit(main())
