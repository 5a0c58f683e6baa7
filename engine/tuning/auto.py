"""`engine.build ... auto`: measure the candidates here, build the fastest that holds, verify it end
to end, and fall back to what is known to work.

First the decoder (engine.tuning.decoder_choice): the device's fast one unless its own flips against
PIL break the disagreement budget, then the next, PIL last; precision gets the budget it
leaves. After the search (engine.tuning.autotune) ranks the candidates that hold that budget, the
first is assembled into the artifact (its compiled graph reused from the search, the guard's
re-check graph added below fp32, the decoder recorded) and run through `scripts/run` with
that decoder on JPEGs at natural sizes (the decoder check's: each decoder resizes them itself); its answers are counted against
FP32 on PIL's pixels, beside the decoder's own flips, and the total must be within the gate
the budget allows on that many images (engine.tuning.calibrate.allowed_disagreements, the preset's
verify_alpha); on CUDA the artifact runs in this process instead of a scripts/run child
(`_run_here` says why). A candidate that fails that is one stderr line, and the next is tried;
when none is left, the build falls back to the fastest measured candidate that compiles nothing
and held its agreement (eager bf16 with its guard on a GPU; `_fallback`), and only when none did to
the plain eager FP32 path without CUDA graphs (with the chosen decoder), said loudly. The manifest's `build.search` records every candidate measured, the
verification and the choice; `build.decoder` the decoders measured.

The build's state is one engine.tuning.context.BuildContext, made by engine.tuning.command.build; what
this module learns (the decoder, the calibration reference, the search's result, its record and
verifications) goes into it, and each step reads it there.

One deadline covers it all (engine.tuning.clock): the calibration reference takes only the images
that fit its share at the rate measured here (engine.tuning.reference), the search spends what it
has left once the re-check graph and one verification are reserved at their estimates; a ranked
candidate is assembled and verified only while its estimate fits, and when none was verified in
time the build is that fallback (the manifest's `fallback` says why and which, `clock` what each
phase planned and took). The search's work folder holds every candidate's files and Inductor cache, a
loser's removed as it loses (engine.tuning.disk: its size, free space and peak).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine import backends, children
from engine.core.spec import Spec
from engine.presets import shared
from engine.tuning import assemble as parts
from engine.tuning import autotune

if TYPE_CHECKING:
    from engine.tuning.context import BuildContext

REPO = Path(__file__).resolve().parents[2]


def _say(msg: str) -> None:
    print(f"engine.build: {msg}", file=sys.stderr, flush=True)


def search_config(ctx: BuildContext, backend: str) -> tuple[autotune.SearchConfig, dict]:
    """The candidates `ctx.auto` measures on this machine (`backend`: the one a fixed backend names),
    and what it skips (with why)."""
    from engine.tuning.measure import importable_backends, measurable_precisions

    spec, device, auto, pre = ctx.spec, ctx.device, ctx.auto, ctx.preset
    skipped: dict[str, str] = {}
    if auto.precision:
        if auto.precisions:
            precisions = tuple(auto.precisions)
        else:
            native, skipped = measurable_precisions(device)
            precisions = tuple(native)
    else:
        precisions = (spec.precision,)
    batches = pre.batch_sizes if auto.batch_size else (spec.batch_size,)
    if auto.backend:
        names, why = importable_backends(device)
        skipped.update(why)
    else:
        names = [backend]
    mods = {n: backends.get(n) for n in names}
    precisions, only = _quantized(precisions, mods, device, skipped)
    with_options = tuple(n for n, m in mods.items() if set(pre.options) & set(getattr(m, "OPTIONS", ())) - {"default"})
    cfg = autotune.SearchConfig(precisions, tuple(batches), tuple(names), device,
                                budget_s=auto.budget_s if auto.budget_s is not None else pre.search_budget_s,
                                options=pre.options, options_backends=with_options, cuda_graphs=pre.cuda_graphs,
                                compile_estimate_s=pre.compile_estimate_s,
                                compiled=tuple(n for n, m in mods.items() if getattr(m, "COMPILES", False)),
                                fp16_same_cost=pre.fp16_same_cost, compile_share=pre.compile_share,
                                only=only)
    return cfg, skipped


def _quantized(precisions: tuple[str, ...], mods: dict, device: str, skipped: dict) -> tuple[tuple[str, ...], dict]:
    """(precisions, {quantized precision: the backends that build it}): a quantized precision (int8)
    is measured only on the backends that list it (their QUANTIZED) and only where it can be built at
    all (engine.core.int8.cannot_build: its off switch, the device, torchao); else it is left out
    with its reason in `skipped`, asked for by --search-precisions or not."""
    only: dict[str, tuple[str, ...]] = {}
    kept = []
    for p in precisions:
        if p != "int8":
            kept.append(p)
            continue
        from engine.core.int8 import cannot_build

        builders = tuple(n for n, m in mods.items() if p in getattr(m, "QUANTIZED", ()))
        why = cannot_build(device) or (None if builders else f"built only by a quantizing backend (aot), not "
                                                             f"{', '.join(mods) or 'none'}")
        if why:
            skipped[p] = why
        else:
            kept.append(p)
            only[p] = builders
    return tuple(kept), only


def build_measured(ctx: BuildContext, backend: str):
    """Search, assemble the best candidate in `ctx.work`, verify it, all inside `ctx.clock`'s deadline (an
    engine.tuning.clock.BuildClock; None: the device preset's, from now); returns (spec, backend, manifest).
    The context gains the decoder, the calibration reference and the search's result on the way."""
    from engine.core.model import wrap
    from engine.tuning import reference
    from engine.tuning.clock import BuildClock

    pre, spec, device, guard, net = ctx.preset, ctx.spec, ctx.device, ctx.guard, ctx.net
    if ctx.clock is None:
        ctx.clock = BuildClock(pre.build_deadline_s, {"recheck": pre.compile_estimate_s,
                                                      "verify": pre.verify_estimate_s})
    bclock = ctx.clock
    cfg, skipped = search_config(ctx, backend)
    with bclock.phase("calibration"):
        # the FP32 reference on as many calibration images as fit the phase's share (engine.tuning.reference)
        low = guard.enabled and any(p != "fp32" for p in cfg.precisions)
        after = (("recheck",) if low else ()) + (("verify",) if ctx.auto.verify else ())
        seconds = bclock.allowance("calibration", after, cfg.budget_s)
        end = bclock.clock() + seconds
        ref = wrap(net, dataclasses.replace(spec, precision="fp32"), device, margin=True)
        stream = parts.calibration_stream(spec, guard)
        fit = reference.fitted(ref, stream, guard.calibration_count,
                               reference.Window(seconds, bclock.clock, device, later=_decoder_passes(device)))
        _choose_decoder(ctx, len(fit.pixels))
        guard = ctx.guard                                  # precision's share of the budget now
        pilot = (next((p for p in cfg.precisions if p != "fp32"), None)
                 if low and guard.calibration_trade and guard.run_images else None)   # no run size: no trade
        if pilot is not None:
            # the count: calibration seconds against a run's expected re-check seconds (engine.tuning.calibration_trade)
            from engine.tuning import calibration_trade

            fit, trade = calibration_trade.extended(
                fit, ref, wrap(net, dataclasses.replace(spec, precision=pilot), device, margin=True), stream,
                reference.Window(end - bclock.clock(), bclock.clock, device),
                calibration_trade.Trade(guard.run_images, pre.calibration_max_images, parts.tau_rule(guard, pre)))
            trade["precision"] = pilot
            _say(f"calibration: {trade['count']} images (pilot {trade['pilot']}, cap {trade['cap']}: "
                 f"{trade['cap_why']}): expected tau {trade['tau']:.4g}, re-checked fraction "
                 f"{trade['rechecked_fraction']:.1%}; about {trade['calibration_s']:.0f} s of calibration against "
                 f"{trade['recheck_s']:.0f} s of re-checks in a run of {trade['run_images']} images")
            ctx.extra = {**ctx.extra, "build": {**ctx.extra["build"], "calibration": trade}}
        if fit.cut:
            bclock.note(fit.cut)
        ctx.calibration = fit
    work = Path(tempfile.mkdtemp(prefix="search.", dir=ctx.work.parent))   # the candidates' graphs, in the build's work folder
    try:
        return _search_and_assemble(ctx, cfg, skipped, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _decoder_passes(device: str) -> float:
    """The decoder check's passes over each calibration image after the reference's (engine.tuning.decoder_choice):
    PIL's and the fast decoder's, each read and classified; none when the first decoder that can start is PIL."""
    from engine import settings
    from engine.decoders import start_problem
    from engine.tuning import decoder_choice as build_decoder

    for name in build_decoder.order(device, settings.decoder()):
        if name == build_decoder.REFERENCE:
            return 0.0
        if start_problem(name) is None:
            return 2.0
    return 0.0


def _choose_decoder(ctx: BuildContext, count: int) -> None:
    """The first decoder whose own flips, on JPEGs at natural sizes through its own resize, leave
    precision a budget (engine.tuning.decoder_choice; `count` of them, at most the preset's verify_images);
    ENGINE_DECODER pins the first. The context gains its record (`decoder`, the manifest's extras) and
    its guard precision's share of the budget."""
    from engine import settings
    from engine.tuning import decoder_choice as build_decoder

    guard = ctx.guard
    choice = build_decoder.for_build(ctx.net, ctx.spec, ctx.device, guard.budget,
                                     min(count, ctx.preset.verify_images), first=settings.decoder())
    _say(f"decoder {choice.name}: precision gets {choice.precision_budget:.4g} of the {guard.budget:g} basis "
         "points of the disagreement budget")
    ctx.decoder = choice.record()
    ctx.extra = {**ctx.extra, "decoder": choice.name, "build": {**ctx.extra["build"], "decoder": ctx.decoder}}
    ctx.guard = dataclasses.replace(guard, budget=choice.precision_budget)


def _search_and_assemble(ctx: BuildContext, cfg: autotune.SearchConfig, skipped: dict, work: Path):
    """The search in `work` on the context's calibration reference, then the ranked candidates verified
    in order, else the fallback: (spec, backend, manifest)."""
    from engine.tuning.clock import SearchDeadline
    from engine.tuning.disk import WorkDisk
    from engine.tuning.measure import Measurer

    bclock, device = ctx.clock, ctx.device
    low = ctx.guard.enabled and any(p != "fp32" for p in cfg.precisions)
    after = (("recheck",) if low else ()) + (("verify",) if ctx.auto.verify else ())
    deadline = SearchDeadline(cfg.budget_s, bclock.clock, bclock, after)
    _say(f"autotune: measuring {', '.join(cfg.precisions)} x batch {', '.join(map(str, cfg.batch_sizes))} x "
         f"{', '.join(cfg.backends)} on {device_name(device)} (budget {cfg.budget_s:.0f} s"
         + (f", cut to the {deadline.left():.0f} s the deadline leaves)" if deadline.left() < cfg.budget_s - 0.5 else ")")
         + (f"; skipped: {'; '.join(f'{k}: {v}' for k, v in skipped.items())}" if skipped else ""))
    m = Measurer(ctx, work)
    disk = WorkDisk(work, 3 * _weight_bytes(ctx.net))
    with bclock.phase("search"):
        result = autotune.search(m, cfg, skipped, clock=bclock.clock, deadline=deadline, disk=disk)
    import torch

    ctx.search = result
    ctx.search_record = {"device": device_name(device), "threads": torch.get_num_threads(), "budget_s": cfg.budget_s,
                         "seconds": round(result.seconds, 1), "calibration": ctx.calibration.origin,
                         "skipped": result.skipped, "dropped": result.dropped, "tie": autotune.TIE,
                         "retime": autotune.RETIME, "prune": autotune.PRUNE, "keep": autotune.KEEP,
                         "disk": disk.record()}
    ctx.verified = []
    done = _verify_in_order(ctx, work)
    if done is not None:
        return done
    return _fallback(ctx, cfg)


def _fallback(ctx: BuildContext, cfg: autotune.SearchConfig):
    """Nothing held, built and verified in time: the best measured candidate that needs no compile and
    held its agreement in the search (autotune.fallback_choice: on a GPU eager bf16 with its guard, ~7-9x
    eager FP32's rate), its re-check graph eager (nothing compiles after the deadline ran out); else, or
    when that cannot be assembled, the plain eager FP32 path without CUDA graphs. One stderr line says
    why and what; the manifest's `fallback` says it too. Returns (spec, backend, manifest)."""
    result, verify, spec, bclock = ctx.search, ctx.verified, ctx.spec, ctx.clock
    cut = any(v.get("deadline") for v in verify) or any(
        "deadline" in t.why for t in result.trials if t.status in ("not compiled", "not screened"))
    why = ("the build's deadline left no time to measure and verify a candidate" if cut and not result.ranked
           else "the build's deadline left no time to verify another candidate" if cut
           else "no measured candidate held, built and verified")
    _say("autotune:\n" + autotune.format_table(result, None))
    pick = autotune.fallback_choice(result.trials, cfg.compiled, verify)
    if pick is not None:
        c = pick.candidate
        cspec = dataclasses.replace(spec, precision=c.precision, batch_size=c.batch_size)
        gargs = (pick.guard, ctx.calibration.origin) if c.precision != "fp32" else None
        what = (f"{c.name}, the fastest measured candidate that compiles nothing and held its agreement "
                f"({pick.effective_images_per_s:.1f} images/s"
                + (f", guarded: tau {pick.tau:.4g}, its re-check graph eager" if gargs else "") + ")")
        _say(f"autotune: WARNING: {why}; falling back to {what}; not verified end to end")
        _clear(ctx.work)
        guard = ctx.guard
        ctx.guard = dataclasses.replace(guard, recheck_backend=backends.REFERENCE)   # nothing compiles now
        try:
            with bclock.phase("recheck" if gargs else "verify"):
                ctx.search_record["clock"] = bclock.record()
                meta = _assemble(ctx, c, cspec, gargs=gargs, fallback=f"{what}: {why}; not verified")
            return cspec, c.backend, meta
        except Exception as e:  # noqa: BLE001 - said, and the plain path below is the artifact
            _say(f"autotune: the fallback {c.name} cannot be assembled ({autotune._why(e)}); building eager FP32")
            _clear(ctx.work)
            ctx.guard = guard
    else:
        _say(f"autotune: WARNING: {why}; no candidate that compiles nothing held its agreement: building the plain "
             "eager FP32 path without CUDA graphs (not verified end to end: it is the reference's own network, "
             "with the run's decoder)")
    c = autotune.Candidate("fp32", spec.batch_size, backends.REFERENCE)
    fspec = dataclasses.replace(spec, precision="fp32")
    ctx.search_record["clock"] = bclock.record()
    meta = _assemble(ctx, c, fspec, fallback=f"eager FP32 without CUDA graphs: {why}; not verified")
    return fspec, backends.REFERENCE, meta


def _verify_in_order(ctx: BuildContext, work: Path):
    """Assemble and verify the ranked candidates in order while the deadline allows one more; the first
    that passes is the artifact: (spec, backend, manifest), or None when none did in time."""
    from engine.tuning.measure import own_inductor_cache

    result, verify, guard, bclock, tmp = ctx.search, ctx.verified, ctx.guard, ctx.clock, ctx.work
    for trial in result.ranked:
        c = trial.candidate
        guarded = guard.enabled and c.precision != "fp32"
        # the guard's re-check graph: a compiling backend's compile is reserved at its estimate before it
        # starts (the longest compile so far); an eager one compiles nothing and is priced in `verify`
        compiles = guarded and getattr(backends.get(guard.recheck_backend or c.backend), "COMPILES", False)
        need = ((bclock.estimate["recheck"] if compiles else 0.0)
                + (bclock.estimate["verify"] if ctx.auto.verify else 0.0))
        if bclock.left() < need:
            bclock.note(f"{c.name} not assembled or verified: {bclock.left():.0f} s left, it needs about {need:.0f} s")
            verify.append({"candidate": c.name, "ok": False, "deadline": True,
                           "why": f"not attempted: {bclock.left():.0f} s left of the deadline, about {need:.0f} s needed"})
            break
        cspec = dataclasses.replace(ctx.spec, precision=c.precision, batch_size=c.batch_size)
        # the re-check graph's compile: its Inductor cache in the work folder, removed with it
        cache = work / ".inductor" / "recheck" if compiles else None
        _clear(tmp)
        try:
            with bclock.phase("recheck" if guarded else "verify"), own_inductor_cache(cache):
                saved = _adopt(result.handles[c.name], tmp)
                gargs = (trial.guard, ctx.calibration.origin) if c.precision != "fp32" else None
                ctx.search_record["clock"] = bclock.record()
                meta = _assemble(ctx, c, cspec, saved, gargs, chosen=c.name)
        except Exception as e:  # noqa: BLE001 - a candidate that cannot be assembled: the next one
            trial.status, trial.why = "failed", f"assembly: {autotune._why(e)}"
            _say(f"autotune: {c.name}: cannot assemble the artifact ({autotune._why(e)}); trying the next")
            verify.append({"candidate": c.name, "ok": False, "why": f"assembly: {autotune._why(e)}"})
            continue
        try:
            with bclock.phase("verify"):
                v = (verify_artifact(ctx, cspec, timeout=max(bclock.left(), 1.0)) if ctx.auto.verify
                     else {"ok": True, "skipped": "verification off"})
        except (OSError, ValueError, RuntimeError, subprocess.SubprocessError) as e:
            v = {"ok": False, "why": autotune._why(e)}
        verify.append({"candidate": c.name, **v})
        if v["ok"]:
            autotune.mark(result.trials, trial, chosen=True)
            ctx.search_record["clock"] = bclock.record()
            meta = _rewrite(ctx, meta)    # the record with its verification
            _say("autotune:\n" + autotune.format_table(result, c.name))
            _say(f"autotune: chose {c.name}: {trial.effective_images_per_s:.1f} images/s on the compiled graph"
                 + (f", verified end to end: {v['agreement']:.2%} of {v['images']} images agree with FP32 eager"
                    if "agreement" in v else ""))
            return cspec, c.backend, meta
        trial.status, trial.why = "failed", f"end-to-end check: {v['why']}"
        _say(f"autotune: {c.name} failed its end-to-end check ({v['why']}); trying the next")
    return None


def _weight_bytes(net) -> int:
    return sum(t.numel() * t.element_size() for t in list(net.parameters()) + list(net.buffers()))


def _assemble(ctx: BuildContext, c: autotune.Candidate, cspec: Spec, saved: dict | None = None,
              gargs: tuple | None = None, chosen: str | None = None, fallback: str | None = None) -> dict:
    """Candidate `c` as the artifact in `ctx.work` (the guard below fp32, with `gargs`: (choose_tau's
    record, origin); the manifest with the search's record; `chosen`: its name when verified, `fallback`:
    why the build is a fallback)."""
    search = {**ctx.search_record, "candidates": ctx.search.table(), "chosen": chosen, "verify": ctx.verified,
              "fallback": fallback}
    ex = {**ctx.extra, "build": {**ctx.extra["build"], "search": search}, "cuda_graphs": bool(c.cuda_graphs)}
    return parts.assemble(ctx, c.backend, cspec, ex, saved, gargs)


def _rewrite(ctx: BuildContext, meta: dict) -> dict:
    """manifest.json again, its search record now with the final table, the verification and the clock."""
    from engine.classify.artifact import DIGEST_KEY, write_manifest
    from engine.core.spec import Spec as SpecType

    own = ("format", "spec", "backend", "device", "precision", "batch_size", "checkpoint", "files", "versions",
           "graph", DIGEST_KEY)
    extra = {k: v for k, v in meta.items() if k not in own}
    extra["build"] = {**extra["build"], "search": {**extra["build"]["search"], "candidates": ctx.search.table(),
                                                   "verify": ctx.verified, "clock": ctx.search_record["clock"]}}
    ck = meta["checkpoint"]
    (ctx.work / "manifest.json").unlink()
    return write_manifest(ctx.work, SpecType.from_dict(meta["spec"]), meta["backend"], meta["device"],
                          Path(ck["path"]) if ck else None, ck["sha256"] if ck else None, extra)


def _clear(tmp: Path) -> None:
    """Empty the artifact folder (what a candidate that failed left there)."""
    for p in tmp.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def _adopt(handle, tmp: Path) -> dict:
    """The search's files of the chosen candidate, moved into the artifact; their manifest extras."""
    for p in handle.folder.iterdir():
        os.replace(p, tmp / p.name)
    handle.folder = tmp
    return handle.extras


def device_name(device: str) -> str:
    """The machine a figure holds for: the CPU capability as torch reports it, or the GPU."""
    import platform

    import torch

    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        return f"{p.name} (compute capability {p.major}.{p.minor})"
    return f"{platform.machine()} CPU, capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs"


def verify_artifact(ctx: BuildContext, spec: Spec, timeout: float = shared("verify_timeout_s"),
                    in_process: bool | None = None) -> dict:
    """The artifact in `ctx.work` (built for `spec`) end to end through scripts/run on the preset's
    verify_images JPEG files at natural sizes (the decoder check's: engine.tuning.decoder_choice.natural_jpegs,
    each decoder resizing them itself), with the decoder the build chose (`ctx.decoder`:
    build_decoder.Choice.record()), against FP32 on PIL's pixels (the reference, `ctx.net`). Two counts:
    the decoder's own flips (FP32 on its pixels against FP32 on PIL's) and the total (the artifact against
    FP32 on PIL's pixels); ok when the total is within calibrate.allowed_disagreements(the budget, n, the
    preset's verify_alpha). `timeout`: the seconds the whole check may take (scripts/run gets what the
    in-process passes leave of it, at least a second). `in_process` (None: on CUDA): the artifact runs
    here, through the API scripts/run calls, not in a child (`_run_here` says why)."""
    from engine.core.model import wrap
    from engine.tuning import calibrate
    from engine.tuning import decoder_choice as build_decoder

    artifact, net, device, decoder = ctx.work, ctx.net, ctx.device, ctx.decoder
    count, alpha = ctx.preset.verify_images, ctx.preset.verify_alpha
    end = time.monotonic() + timeout

    name, budget = decoder["name"], decoder["budget_per_10k"]
    blobs, _ = build_decoder.natural_jpegs(spec, count)
    n = len(blobs)
    fp32 = wrap(net, dataclasses.replace(spec, precision="fp32"), device)

    def classify(px: np.ndarray) -> np.ndarray:
        return calibrate.classify(fp32, px, calibrate.REFERENCE_BATCH, margin=False, device=device)[0]

    pil, _ = build_decoder.start(build_decoder.REFERENCE, spec, calibrate.REFERENCE_BATCH)
    want = classify(build_decoder.decoded(pil, blobs, calibrate.REFERENCE_BATCH)[0])        # [n] the reference's answers
    own = {"flips": 0, "per_10k": 0.0}
    if name != build_decoder.REFERENCE:
        dec, why = build_decoder.start(name, spec, calibrate.REFERENCE_BATCH)
        if dec is None:
            return {"ok": False, "images": n, "decoder": name, "why": f"decoder {name} cannot start: {why}"}
        own = build_decoder.flips(dec, blobs, classify, want)
        getattr(dec, "close", lambda: None)()
    here = device == "cuda" if in_process is None else in_process
    got, run = (_run_here(artifact, blobs, name) if here
                else _run_script(artifact, blobs, name, max(end - time.monotonic(), 1.0)))
    if "why" in run:
        return {"ok": False, "images": n, "decoder": name, **run}
    total = int((got != want).sum()) if len(got) == n else n
    gate = calibrate.allowed_disagreements(budget, n, alpha)
    res = {"images": n, "decoder": name, "decoder_flips": own["flips"], "decoder_per_10k": own["per_10k"],
           "disagreements": total, "per_10k": round(build_decoder.rate_bp(total, n), 3), "allowed": gate,
           "budget_per_10k": budget, "alpha": alpha, "agreement": round(1 - total / n, 5) if n else 0.0,
           **run, "ok": total <= gate and len(got) == n}
    if not res["ok"]:
        res["why"] = (f"{total} of {n} images disagree with FP32 on PIL's pixels (the decoder {name} "
                      f"alone: {own['flips']}), over the {gate} a budget of {budget:g} basis points allows")
    return res


def _run_here(artifact: Path, blobs: list[bytes], decoder: str) -> tuple[np.ndarray, dict]:
    """(top-1 [n] int32, {wall_s, images_per_s, cuda_graph, where} or {why}) of the artifact loaded in
    this process through the engine's API (engine.load, what scripts/run calls), with `decoder` in this
    process too.

    Why here on CUDA: by the time it verifies, this process has measured the search on the GPU, so it
    holds a CUDA context, and torch gives a context back only at the process's exit. A child
    (scripts/run, or a decoder isolated in one) must open a context of its own, which the GPU's
    EXCLUSIVE_PROCESS compute mode refuses while this one lives: the check would then fail every
    candidate for a reason of the machine. Here it runs where the context already is, so it cannot
    depend on anything being released. What it leaves out against scripts/run (the process's start,
    its imports, the entry point's argument handling) is checked by the build's own one-image run of
    scripts/run after the build (`./build.sh`), and by the tests. No clock cuts it: it is one of the
    steps already started that the deadline's slack covers."""
    from engine.classify.classifier import Classifier

    t = time.perf_counter()
    try:
        with Classifier(artifact, decoder=decoder, isolate=False) as clf:
            got = clf.classify_bytes(blobs)
            rep = clf.report()
    except Exception as e:  # noqa: BLE001 - a candidate that cannot run: the check fails, saying why
        return np.zeros(0, np.int32), {"why": f"the artifact cannot run in the build's process: "
                                              f"{type(e).__name__}: {e}"[:300]}
    return got, {"wall_s": round(time.perf_counter() - t, 2), "images_per_s": rep.get("images_per_s"),
                 "cuda_graph": rep.get("runtime", {}).get("cuda_graph"), "where": "in the build's process"}


def _run_script(artifact: Path, blobs: list[bytes], decoder: str, timeout: float) -> tuple[np.ndarray, dict]:
    """(top-1 [n] int32, {wall_s, images_per_s, cuda_graph} or {why}) of scripts/run over `blobs`
    written as files, with `decoder` (the one the artifact records, named explicitly)."""
    from engine.tuning.clock import bounded_s  # a timeout subprocess can hold: a huge deadline is cut

    with tempfile.TemporaryDirectory(prefix="engine-verify-") as d:
        root = Path(d)
        (root / "images").mkdir()
        rows = []
        for i, blob in enumerate(blobs):
            (root / "images" / f"v{i:04d}.jpg").write_bytes(blob)
            rows.append(f"v{i}\tv{i:04d}.jpg\n")
        (root / "manifest.tsv").write_text("".join(rows))
        out, report = root / "pred.i32", root / "report.json"      # outside IMAGE_ROOT (root/images)
        env = {**os.environ, "ENGINE_ARTIFACT": str(artifact), "ENGINE_DECODER": decoder}
        t = time.perf_counter()
        try:   # stopped with every process it started once the deadline's time is up
            r = children.run([str(REPO / "scripts" / "run"), str(root / "manifest.tsv"), str(root / "images"),
                              str(out), "--report", str(report)], env=env, capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, timeout=bounded_s(timeout), grace_s=2.0)
        except subprocess.TimeoutExpired:
            r = None
        wall = time.perf_counter() - t
        if r is None:
            return np.zeros(0, np.int32), {"why": f"scripts/run did not finish in the {timeout:.0f} s the build's "
                                                  "deadline left; it was stopped"}
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
            return np.zeros(0, np.int32), {"why": f"scripts/run exited {r.returncode}: {last}"}
        rep = json.loads(report.read_text()) if report.is_file() else {}
        return np.fromfile(out, "<i4"), {"wall_s": round(wall, 2), "images_per_s": rep.get("images_per_s"),
                                         "cuda_graph": rep.get("runtime", {}).get("cuda_graph")}
