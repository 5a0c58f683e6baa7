"""Build the CIR gallery index: records -> decode -> CLIP image tower -> unit FP16 rows.

    scripts/build.sh --corpus DIR --index-dir DIR [--model-dir DIR] [--method slerp] ...

Reads DIR/records.jsonl ({image_id, path}; a path resolves as the task gives it: relative
to DIR, absolute as is, symlinks followed, as the reference's Image.open does;
--confine-to-corpus refuses and names an absolute path or one that leaves DIR, also through
a symlink), reads only regular files of at most ENGINE_MAX_FILE_BYTES, decodes with the
engine's decoders (dali-gpu on CUDA, dali-cpu otherwise; ENGINE_DECODER=pil is the
reference), embeds in batches, and writes the index described in engine.retrieval.index
(engine.retrieval.gallery does the work). Chunked and resumable: a killed build restarts at
its first unfinished chunk. Images no decoder can read are listed in meta.json and left out.
Build-time extras (gallery mean, `--mapping pic2word`, gallery-derived text bank, DBA):
engine.retrieval.index_extras. Env:
CLIP_MODEL_DIR, CLIP_MODEL_NAME, CLIP_DEVICE, CLIP_PRECISION, CIR_METHOD. main()'s
stop_after_chunks / p2w_stop_after end a build early, as a kill would (resumable).
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine.cli import MAX_DEADLINE_S, device_name
from engine.decoders.registry import DECODERS
from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.options import trained
from evaluator import settings as evaluator_settings
from evaluator.cir import task
from evaluator.cir.flags import add_flags, flag

STOPPED = 3  # exit status of a build ended early by main(stop_after_chunks=...) (resumable)


PROG = "scripts/build.sh"


def _error(msg: str) -> int:
    """A user mistake: one `PROG: error: MESSAGE` line (the caller returns 2)."""
    from engine.cli import error

    return error(PROG, msg)


_R = RETRIEVAL   # the defaults: the retrieval table (engine/presets/retrieval.py)
_MAX_BATCH = 4096          # images or requests in one batch
_MAX_COUNT = 10**9         # images, steps, texts: far past a gallery of a few hundred thousand
_MAX_THREADS = 1024        # reader threads
_EXTRAS = "extras"


@dataclass
class BuildConfig:
    """scripts/build.sh's settings: each field is its flag (evaluator.cir.flags: --name, type, default, help)."""
    corpus: Path = flag("folder with records.jsonl")
    index_dir: Path = flag("where the index goes (created if missing)")
    model_dir: Path | None = flag(f"CLIP folder (default: env CLIP_MODEL_DIR, else {task.CLIP_DIR}, the task's mount)",
                                          None)
    model_name: str | None = flag("architecture for a bare state dict (default: env CLIP_MODEL_NAME, else read from the folder)", None)
    decoder: str = flag("auto | " + " | ".join(DECODERS) + " (env ENGINE_DECODER; auto: dali-gpu on CUDA, "
                        "dali-cpu otherwise)", "auto", choices=("auto", *DECODERS))
    batch_size: int | None = flag("images per batch (default by device: "
                                  + ", ".join(f"{d} {b}" for d, b in _R.image_batch.items()) + ")", None,
                                  span=(1, _MAX_BATCH), unit="images")
    chunk_size: int = flag("images per resumable chunk", _R.chunk_size, span=(1, _MAX_COUNT), unit="images")
    readers: int = flag("file reader threads of the decode", _R.image_readers, span=(1, _MAX_THREADS))
    device: str | None = flag("cpu, cuda or cuda:N (env CLIP_DEVICE; default cuda when present)", None,
                              parse=device_name)
    precision: str | None = flag("fp32 | fp16 | bf16 (default: env CLIP_PRECISION, else fp16 on CUDA, fp32 on CPU)", None,
                                 choices=("fp32", "fp16", "bf16"))
    method: str = flag("default composition method recorded for scripts/run.sh (env CIR_METHOD)", _R.method,
                       env=evaluator_settings.cir_method)
    text_weight: float | None = flag("text weight recorded with the method (default: the method's own)", None,
                                     span=(0.0, 1.0))
    prompt: str | None = flag("prompt recorded with the method (default: the method's own)", None)
    force: bool = flag("rebuild even if the index is up to date", False)
    mapping: str = flag("learn a Pic2Word image-to-word mapping on the gallery (method pic2word)", "none",
                        choices=("none", *trained()), group=_EXTRAS)
    p2w_epochs: int = flag("passes over the gallery (when --p2w-steps is 0)", _R.p2w_epochs, group=_EXTRAS,
                           span=(1, 100_000))
    p2w_steps: int = flag("optimiser steps (0: epochs x N / batch)", 0, group=_EXTRAS, span=(0, _MAX_COUNT))
    p2w_batch_size: int = flag("training batch (InfoNCE negatives: batch - 1)", _R.p2w_batch_size, group=_EXTRAS,
                               span=(1, 65_536))
    p2w_lr: float = flag("peak learning rate (after the warm-up)", _R.p2w_lr, group=_EXTRAS, span=(0.0, 10.0),
                         lo_open=True)
    p2w_warmup: int = flag("linear warm-up steps before the cosine decay (-1: a tenth of the run)", -1,
                           group=_EXTRAS, span=(-1, _MAX_COUNT))
    p2w_hidden: int = flag("the mapping's MLP width", _R.p2w_hidden, group=_EXTRAS, span=(1, 65_536))
    p2w_seed: int = flag("seed of the initialisation, data order, dropout and the text bank's rows", _R.p2w_seed,
                         group=_EXTRAS, span=(0, 2**32 - 1))
    p2w_ckpt_every: int = flag("steps between training checkpoints", _R.p2w_ckpt_every, group=_EXTRAS,
                               span=(1, _MAX_COUNT))
    p2w_time_budget: float = flag("seconds of training at most", _R.p2w_time_budget, group=_EXTRAS,
                                  span=(0.0, MAX_DEADLINE_S), unit="s", lo_open=True)
    text_bank: int = flag(f"gallery-derived texts to store (-1: {_R.text_bank_size} with a mapping, else 0)", -1,
                          group=_EXTRAS, span=(-1, _MAX_COUNT))
    dba: int = flag("store DBA rows over N neighbours (0: off)", 0, group=_EXTRAS, span=(0, 10_000))
    dba_alpha: float = flag("DBA's exponent on similarities", _R.dba_alpha, group=_EXTRAS, span=(0.0, 100.0))
    dba_chunk: int = flag("gallery rows per DBA block (0: one [N, N] matrix, the reference twin)", _R.dba_chunk,
                          group=_EXTRAS, span=(0, _MAX_COUNT))
    ray: bool = flag("embed on Ray Data actors: a local Ray, or the cluster at RAY_ADDRESS (pip install '.[scale]')",
                     False)
    workers: int = flag("Ray actors, with --ray (one GPU each on CUDA)", _R.ray_workers, span=(1, 2**31 - 1))
    confine_to_corpus: bool = False      # records paths must be relative and stay inside the corpus folder
    stop_after_chunks: int = 0     # stop (resumably) after this many chunks; 0: never (main's argument)
    p2w_stop_after: int = 0        # stop (resumably) after this many Pic2Word steps; 0: never (main's argument)

    def extras(self):
        from engine.retrieval.index_extras import ExtrasConfig
        from engine.retrieval.pic2word import Pic2WordConfig

        p2w = Pic2WordConfig(hidden=self.p2w_hidden, epochs=self.p2w_epochs, steps=self.p2w_steps,
                             batch_size=self.p2w_batch_size, lr=self.p2w_lr, warmup=self.p2w_warmup,
                             seed=self.p2w_seed, ckpt_every=self.p2w_ckpt_every, time_budget_s=self.p2w_time_budget)
        return ExtrasConfig(self.mapping, p2w, self.text_bank, self.dba, self.dba_alpha, self.dba_chunk,
                            self.p2w_stop_after)


def parse_args(argv: list[str] | None) -> BuildConfig:
    from engine.cli import ArgumentParser, HelpFormatter, corpus_flags, debug_flag

    p = ArgumentParser(prog="scripts/build.sh", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    add_flags(p, BuildConfig, {_EXTRAS: p.add_argument_group("extras (docs/retrieval_quality.md)")})
    corpus_flags(p, "follow them, as the reference's Image.open does")
    debug_flag(p)
    a = p.parse_args(argv)
    del a.debug
    if a.allow_outside_corpus and a.confine_to_corpus:
        p.error("--allow-outside-corpus and --confine-to-corpus contradict each other")
    del a.allow_outside_corpus
    if (a.batch_size is not None and a.batch_size < 1) or a.chunk_size < 1 or a.readers < 1 or a.workers < 1:
        p.error("--batch-size, --chunk-size, --readers and --workers must be >= 1")
    if min(a.p2w_epochs, a.p2w_batch_size, a.p2w_ckpt_every, a.p2w_hidden) < 1 or min(a.p2w_steps, a.dba,
                                                                                        a.dba_chunk) < 0 \
            or a.p2w_warmup < -1:
        p.error("--p2w-* sizes must be >= 1 (--p2w-steps, --dba >= 0; --p2w-warmup >= -1)")
    return BuildConfig(**vars(a))


def main(argv: list[str] | None = None, stop_after_chunks: int = 0, p2w_stop_after: int = 0) -> int:
    """scripts/build.sh. The stop_* arguments end the build early, as an interruption would (resumable)."""
    from engine.cli import guard
    from evaluator.cir.limits import exhaustion_guarded
    from evaluator.cir.run import interrupt_ends

    debug = bool(argv and "--debug" in argv)
    with interrupt_ends(PROG, "finished chunks are kept; the same command resumes the build"):
        return exhaustion_guarded(PROG, lambda: guard(PROG, lambda: _main(argv, stop_after_chunks, p2w_stop_after),
                                                      debug=debug), debug)


def _main(argv: list[str] | None, stop_after_chunks: int, p2w_stop_after: int) -> int:
    from engine.stdio import safe_std_streams

    safe_std_streams()   # diagnostics are best effort: a broken stderr never fails the build
    cfg = parse_args(argv)
    from engine import threads

    try:
        threads.apply_library_env(threads.budget("cpu"))   # before numpy / torch size their pools
    except ValueError as e:   # a bad ENGINE_THREADS / ENGINE_READERS
        _error(f"{e}")
        return 2
    from engine.memory import RETRIEVAL_BUILD
    from evaluator.cir.limits import address_space_problem, clip_folder_guess

    problem = address_space_problem(RETRIEVAL_BUILD, "an index build", clip_folder_guess(cfg.model_dir))
    if problem:   # before torch loads: without room, glibc may abort a thread with nothing to catch
        _error(problem)
        return 2
    cfg.stop_after_chunks, cfg.p2w_stop_after = stop_after_chunks, p2w_stop_after
    t_start = time.perf_counter()
    from engine.io import folder_refusal, mark_owned
    from engine.retrieval.index import is_index_folder
    from engine.retrieval.jsonl import read_input, read_records, stderr_warn
    from evaluator.cir import task
    from evaluator.cir.run import tmpdir_problem

    problem = tmpdir_problem()
    if problem:
        _error(f"{problem}")
        return 2
    if cfg.ray:
        from engine.retrieval import ray_session

        try:   # before the CLIP loads: Ray Data importable, RAY_ADDRESS answering, room in TMPDIR
            ray_session.preflight()
        except ray_session.RayBuildError as e:
            _error(f"{e}")
            return e.status
    try:
        method = task.method(cfg.method, cfg.text_weight, cfg.prompt)
    except ValueError as e:
        _error(f"{e}")
        return 2
    if method.name == "pic2word" and cfg.mapping != "pic2word":
        _error("--method pic2word needs the mapping: add --mapping pic2word")
        return 2
    records_path = cfg.corpus / "records.jsonl"
    if not records_path.is_file():
        _error(f"{records_path} not found (or not a regular file)")
        return 2
    why = folder_refusal(cfg.index_dir, "the index dir", is_index_folder, (cfg.corpus,))
    if why:
        _error(why)
        return 2
    try:
        cfg.index_dir.mkdir(exist_ok=True)
        mark_owned(cfg.index_dir, "index")
    except OSError as e:
        _error(f"cannot create the index dir {cfg.index_dir}: {e.strerror or e}")
        return 2
    if not os.access(cfg.index_dir, os.W_OK):
        _error(f"the index dir {cfg.index_dir} is not writable")
        return 2
    try:
        records = read_records(records_path, stderr_warn("cir_build"))
        records_sha = hashlib.sha256(read_input(records_path)).hexdigest()
    except (OSError, ValueError) as e:
        _error(f"cannot read {records_path}: {e}")
        return 2
    if not records:
        _error(f"{records_path} holds no usable records")
        return 2

    from engine.clip.load import ClipLoadError, load_clip
    from engine.clip.towers import ClipTowers, default_device

    if cfg.batch_size is None:
        cfg.batch_size = RETRIEVAL.image_batch_for(cfg.device or default_device())
    try:
        model, spec, info = load_clip(task.clip_dir(cfg.model_dir), cfg.model_name, cfg.batch_size)
    except (ClipLoadError, OSError) as e:
        _error(f"{e}")
        return 2
    towers = ClipTowers(model, spec, cfg.device, cfg.precision)
    threads.apply_torch(threads.budget(towers.device.type))
    t_loaded = time.perf_counter()
    from engine.retrieval import gallery
    from engine.retrieval.index import IndexLoadError

    job = gallery.BuildJob(records, records_sha, towers, info, method.to_dict(), corpus=cfg.corpus,
                           index_dir=cfg.index_dir, extras=cfg.extras(), decoder=cfg.decoder,
                           batch_size=cfg.batch_size, chunk_size=cfg.chunk_size, readers=cfg.readers,
                           confine_to_corpus=cfg.confine_to_corpus, force=cfg.force,
                           stop_after_chunks=cfg.stop_after_chunks, t_start=t_start, t_loaded=t_loaded)
    build = _ray_build(cfg, towers, info) if cfg.ray else gallery.build
    errors = (IndexLoadError,)
    if cfg.ray:
        from engine.retrieval.build_ray import RayBuildError

        errors = (IndexLoadError, RayBuildError)
    try:
        done = build(job)
    except errors as e:
        _error(f"{e}")
        return getattr(e, "status", 2)
    return 0 if done else STOPPED


def _ray_build(cfg: BuildConfig, towers, info):
    """--ray: the build with its chunks embedded on Ray actors (engine.retrieval.build_ray); Ray's
    failures end it in one line (build_ray.RayBuildError), a signal too."""
    import functools

    from engine.retrieval import build_ray

    tower_args = (str(info["dir"]), cfg.model_name, cfg.batch_size, str(towers.device), towers.precision)
    return functools.partial(build_ray.build, tower_args=tower_args, workers=cfg.workers, prog=PROG)

if __name__ == "__main__":
    sys.exit(main())
