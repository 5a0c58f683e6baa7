"""Answer CIR requests against a built index: one JSONL row per query, flushed as it completes.

    scripts/run.sh --index-dir DIR --queries FILE.jsonl --output FILE.jsonl [--method slerp] ...

Per batch of requests: text tower on the prompt (modification, with shared_concept when
the method's prompt uses it), the reference's stored embedding, `engine.retrieval.compose` into a
unit query, scores against the whole gallery (one matrix multiply), top 50 excluding the
reference (`kernels.topk.topk`). Output rows: {"query_id", "results": [{"image_id",
"score"}]}. An existing output resumes after its valid rows (a torn last line is dropped),
only if the same requests, method, index and CLIP wrote it (its record, beside it, holds a
digest of the requests); otherwise it is refused, naming --fresh. One run writes an output at a
time: the output is held under an exclusive lock from before it is read or changed until the run
ends, and a second run on it (whatever its flags) stops in one line, changing nothing.
A request whose reference is not in the index is answered from its text alone.
The method may add gallery-aware options (`slerp+gap+qbnorm`, `pic2word+reinspect`, ...):
engine.retrieval.query runs them; docs/retrieval_quality.md lists them. The CLIP: --model-dir,
else CLIP_MODEL_DIR, else /task/models/clip when it is there, else the folder the index records
when its digest still matches (said on stderr). Env: CLIP_MODEL_DIR, CLIP_MODEL_NAME, CLIP_DEVICE, CLIP_PRECISION, CIR_METHOD,
CIR_TEXT_WEIGHT, CIR_PROMPT, CIR_CORPUS. --bank-chunk 0 runs the reference twin of the
streamed bank statistics. Records paths are followed as the build follows them (relative to
the corpus, absolute as is, symlinks too) unless --confine-to-corpus or a confined index.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine.presets.retrieval import RETRIEVAL
from evaluator import settings as evaluator_settings
from evaluator.cir.task import TOP_K

PROG = "scripts/run.sh"


def _log(msg: str) -> None:
    print(f"[cir_run] {msg}", file=sys.stderr, flush=True)


def _error(msg: str) -> int:
    """A user mistake: one `PROG: error: MESSAGE` line (the caller returns 2)."""
    from engine.cli import error

    return error(PROG, msg)


@dataclass
class RunConfig:
    index_dir: Path
    queries: Path
    output: Path
    model_dir: Path | None = None
    model_name: str | None = None
    method: str | None = None          # None: env CIR_METHOD, else the index's recorded method
    text_weight: float | None = None
    prompt: str | None = None
    batch_size: int = RETRIEVAL.query_batch
    k: int = TOP_K
    device: str | None = None
    precision: str | None = None
    resume: bool = True
    allow_model_mismatch: bool = False
    report: Path | None = None
    corpus: Path | None = None         # image files for re-inspection (default: recorded at build time)
    confine_to_corpus: bool = False    # re-inspection: records paths must stay inside the corpus folder
    bank_chunk: int = RETRIEVAL.bank_chunk   # requests per bank-statistics block; 0: one [M, N] matrix (reference twin)


METHOD_SOURCES, PROMPT_SOURCES = "{method sources}", "{prompt sources}"   # filled in by _sources_help()


def _sources_help():
    """engine.cli.HelpFormatter that fills in the methods' and prompts' sources only when --help is
    printed: their tables import torch, which must wait for the address-space check."""
    from engine.cli import HelpFormatter

    class SourcesHelp(HelpFormatter):
        def _get_help_string(self, action) -> str:
            text = super()._get_help_string(action)
            if METHOD_SOURCES in text or PROMPT_SOURCES in text:
                from engine.retrieval.compose import method_help, prompt_help

                text = text.replace(METHOD_SOURCES, method_help()).replace(PROMPT_SOURCES, prompt_help())
            return text

    return SourcesHelp


def parse_args(argv: list[str] | None) -> RunConfig:
    """The flags, read without importing torch or numpy (the address-space check comes after)."""
    from engine.cli import ArgumentParser, corpus_flags, debug_flag, device_name, finite_float, whole_number

    p = ArgumentParser(prog="scripts/run.sh", description=__doc__.split("\n\n")[0], formatter_class=_sources_help())
    p.add_argument("--index-dir", type=Path, required=True, help="the gallery index scripts/build.sh wrote")
    p.add_argument("--queries", type=Path, required=True, help="requests JSONL, one request per line")
    p.add_argument("--output", type=Path, required=True,
                   help="results JSONL: one row per request, top --k image ids best first (resumed if partial)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="CLIP folder (default: env CLIP_MODEL_DIR, else /task/models/clip when it is there, else "
                        "the folder the index records when its digest matches)")
    p.add_argument("--model-name", default=None,
                   help="architecture for a bare state dict (env CLIP_MODEL_NAME; default: read from the folder)")
    p.add_argument("--method", default=evaluator_settings.cir_method(),
                   help="slerp | sum | text-only | pic2word, optionally +options, e.g. slerp+gap+qbnorm "
                        "(env CIR_METHOD; default: the index's, else slerp). Sources: " + METHOD_SOURCES)
    p.add_argument("--text-weight", type=finite_float(0.0, 1.0), default=evaluator_settings.cir_text_weight(),
                   help="text weight for every request (env CIR_TEXT_WEIGHT; default per method)")
    p.add_argument("--prompt", default=evaluator_settings.cir_prompt(),
                   help="auto (the method's default: plain; pic2word for pic2word), a name, or a template "
                        "with {modification} (env CIR_PROMPT). Names: " + PROMPT_SOURCES)
    p.add_argument("--batch-size", type=whole_number(1, 4096, "requests"), default=RETRIEVAL.query_batch,
                   help="requests per batch")
    p.add_argument("--k", type=whole_number(1, TOP_K), default=TOP_K, help=f"results per query (at most {TOP_K})")
    p.add_argument("--device", default=None, type=device_name,
                   help="where the CLIP towers run: cpu, cuda or cuda:N (default: env CLIP_DEVICE, else cuda when "
                        "available, else cpu)")
    p.add_argument("--precision", default=None, choices=("fp32", "fp16", "bf16"),
                   help="CLIP autocast precision: fp32, fp16 or bf16 (default: env CLIP_PRECISION, else fp16 on "
                        "CUDA and fp32 on the CPU)")
    p.add_argument("--no-resume", "--fresh", dest="resume", action="store_false",
                   help="start the output afresh (an existing output resumes only if the same requests, "
                        "method, index and CLIP wrote it)")
    p.add_argument("--allow-model-mismatch", action="store_true",
                   help="run even if the CLIP differs from the one that built the index")
    p.add_argument("--report", type=Path, default=None, help="also write the run summary JSON here (default: not written)")
    p.add_argument("--corpus", type=Path, default=evaluator_settings.cir_corpus(),
                   help="corpus folder (records.jsonl) for re-inspection (env CIR_CORPUS; default: the index's)")
    p.add_argument("--bank-chunk", type=whole_number(0, 10**9, "requests"), default=RETRIEVAL.bank_chunk,
                   help="requests per bank-statistics block (0: one [M, N] matrix, the reference twin)")
    corpus_flags(p, "re-inspection follows them, as the build does; an index built confined stays confined")
    debug_flag(p)
    a = p.parse_args(argv)
    del a.debug
    if a.allow_outside_corpus and a.confine_to_corpus:
        p.error("--allow-outside-corpus and --confine-to-corpus contradict each other")
    del a.allow_outside_corpus
    if a.bank_chunk < 0:
        p.error("--bank-chunk must be >= 0")
    if a.batch_size < 1 or not 1 <= a.k <= TOP_K:
        p.error(f"--batch-size must be >= 1 and --k in 1..{TOP_K}")
    return RunConfig(**vars(a))


def main(argv: list[str] | None = None, on_row=None, log_summary: bool = True) -> int:
    """scripts/run.sh. `on_row(n)` is called after the n-th row is written and flushed;
    `log_summary=False` keeps the run's summary JSON off stderr (a caller that reads --report)."""
    from engine.cli import guard
    from evaluator.cir.limits import exhaustion_guarded

    debug = bool(argv and "--debug" in argv)
    with interrupt_ends(PROG, "every row written so far is kept; the same command resumes"):
        return exhaustion_guarded(PROG, lambda: guard(PROG, lambda: _main(argv, on_row, log_summary), debug=debug), debug)


INTERRUPTED = 130   # exit status after SIGINT, as a shell reports a process it ended


@contextlib.contextmanager
def interrupt_ends(prog: str, kept: str):
    """SIGINT ends the command as SIGTERM does (its default action: at once, no teardown): one
    line on stderr, then os._exit(INTERRUPTED). What is finished is already on disk (each row is
    flushed as it is written; each chunk renamed into place), and a KeyboardInterrupt unwinding
    through the decode threads and the decoder process would take seconds and print a traceback.
    Under an address-space limit the line says the signal may be a library's own, raised when it
    could not start a thread (engine.memory.sigint_origin), not only a key or a kill.
    The previous handler comes back on leaving (in-process callers, tests)."""
    import signal
    import threading

    from engine.memory import sigint_origin

    origin = sigint_origin()   # read now: a handler that runs inside an import must not import
    said = "interrupted (SIGINT)" if origin is None else f"stopped by SIGINT ({origin})"

    def leave(signum, frame):
        try:
            sys.stderr.write(f"{prog}: {said}: {kept}\n")
            sys.stderr.flush()
        finally:
            os._exit(INTERRUPTED)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _main(argv: list[str] | None, on_row, log_summary: bool = True) -> int:
    from engine.stdio import safe_std_streams
    from evaluator.cir import resume

    safe_std_streams()   # diagnostics are best effort: a broken stderr never fails the call
    cfg = parse_args(argv)
    problem = limits_problem(cfg) or tmpdir_problem() or output_problem(cfg.output)
    if problem:
        return _error(problem)
    try:   # one writer per output: held before it is read, cut or appended, until this call ends
        held = resume.HeldOutput(cfg.output, _log)
    except resume.ResumeError as e:
        return _error(f"{e}")
    with held:
        t0 = time.perf_counter()
        from engine.retrieval.index import IndexLoadError, load_index
        from engine.retrieval.jsonl import read_requests, stderr_warn

        warn = stderr_warn("cir_run")
        try:   # the index and the requests are read before torch loads: a bad one costs no import time
            index = load_index(cfg.index_dir)
            requests = read_requests(cfg.queries, warn)
        except (IndexLoadError, OSError, ValueError) as e:
            return _error(f"{e}")
        from engine.clip.load import ClipLoadError
        from engine.retrieval.query import PipelineError

        try:
            method = chosen_method(cfg, index.meta.get("method") or {})
        except (TypeError, ValueError) as e:
            return _error(f"{e}")
        try:
            searcher = open_searcher(cfg, index, warn)
            pipe = searcher.pipeline(method, cfg.k)
            pipe.prepare(requests)
        except (ClipLoadError, OSError, PipelineError) as e:
            return _error(f"{e}")

        try:
            out, kept = resume.open_run(held, cfg, searcher, method, requests, warn, _log)
        except resume.ResumeError as e:
            return _error(f"{e}")
        with out:
            done = resume.cut_to_kept(out, kept)
            if done:
                _log(f"resuming {cfg.output}: {len(done)} rows kept")
            pending = [r for r in requests if str(r.query_id) not in done]
            t1 = time.perf_counter()
            n = answer_naming_output(cfg, pipe, pending, out, on_row)
        report(cfg, {"queries": len(requests), "answered": n, "resumed": len(done)}, method, searcher, pipe,
               (t0, t1, time.perf_counter()), log_summary)
    return 0


def limits_problem(cfg: RunConfig) -> str | None:
    """Why the run cannot start in this process (a bad ENGINE_THREADS / ENGINE_READERS, too little
    address space), checked before torch loads; sets the thread libraries' environment first."""
    from engine import threads
    from evaluator.cir.limits import query_run_problem

    try:
        threads.apply_library_env(threads.budget("cpu"))   # before numpy / torch size their pools
    except ValueError as e:
        return f"{e}"
    # before torch loads: without room, glibc may abort a thread with nothing to catch
    return query_run_problem(cfg.index_dir, cfg.model_dir)


def chosen_method(cfg: RunConfig, recorded: dict):
    """The composition method (engine.retrieval.compose.Method): the one the index records when
    no --method, --text-weight or --prompt is given, else --method (default: the recorded
    method's label, else the retrieval table's) with those options."""
    from engine.retrieval.compose import Method
    from evaluator.cir import task

    if cfg.method is None and cfg.text_weight is None and cfg.prompt is None and recorded:
        return task.check_method(Method.from_dict(recorded))   # the method recorded at build time
    return task.method(cfg.method or (Method.from_dict(recorded).label if recorded else RETRIEVAL.method),
                       cfg.text_weight, cfg.prompt)


def open_searcher(cfg: RunConfig, index, warn):
    """engine.retrieval.search.Searcher over `index` with its CLIP (the task's folder as the default)."""
    from engine.retrieval.search import ClipChoice, SearchSettings, searcher_for
    from evaluator.cir import task

    choice = ClipChoice(default_clip_dir=task.CLIP_DIR, device=cfg.device, precision=cfg.precision,
                        model_name=cfg.model_name, allow_model_mismatch=cfg.allow_model_mismatch, say=_log,
                        mismatch_hint="pass --allow-model-mismatch to run anyway")
    return searcher_for(index, cfg.model_dir, choice, SearchSettings(
        cfg.corpus, cfg.confine_to_corpus, cfg.batch_size, cfg.bank_chunk, warn, task.MAX_REINSPECT, cfg.queries))


def report(cfg: RunConfig, counts: dict, method, searcher, pipe, times: tuple[float, float, float],
           log_summary: bool = True) -> None:
    """The run summary (`counts`, then the method, the CLIP's device, the gallery, the timings from
    `times` = (start, first row, end), the pipeline's own report): one stderr line (unless
    `log_summary` is False), and the --report file when asked."""
    t0, t1, t_end = times
    rate = counts["answered"] / (t_end - t1) if t_end > t1 else 0.0
    towers = searcher.towers
    summary = {**counts, "method": method.to_dict(), "device": towers.device.type, "precision": towers.precision,
               "gallery": len(searcher.index.ids), "setup_s": round(t1 - t0, 3), "query_s": round(t_end - t1, 3),
               "queries_per_s": round(rate, 2), **pipe.report()}
    if log_summary:
        _log(json.dumps(summary))
    if cfg.report is not None:
        cfg.report.write_text(json.dumps(summary, indent=2) + "\n")


def tmpdir_problem() -> str | None:
    """Why TMPDIR cannot serve as scratch space (torch, open_clip and DALI keep caches there)."""
    from engine import settings

    d = settings.tmpdir()
    if not d.is_dir() or not os.access(d, os.W_OK | os.X_OK):
        return f"TMPDIR {d} is not a writable folder (torch, open_clip and the decoders keep their caches there)"
    return None


def output_problem(path: Path) -> str | None:
    """Why the output cannot be written (a directory, a missing folder), checked before any work."""
    if path.is_dir():
        return f"the output {path} is a directory"
    if not path.parent.is_dir():
        return f"the output folder {path.parent} does not exist"
    if path.exists() and not os.access(path, os.W_OK):
        return f"the output {path} is not writable"
    if not path.exists() and not os.access(path.parent, os.W_OK):
        return f"cannot create the output in {path.parent}: not writable"
    return None


def answer(cfg: RunConfig, pipe, pending, out, on_row=None) -> int:
    """Write one row per pending request, batch by batch (engine.retrieval.query); returns the rows written."""
    written = 0
    for lo in range(0, len(pending), cfg.batch_size):
        batch = pending[lo:lo + cfg.batch_size]
        for r, results in zip(batch, pipe.results(batch)):
            out.write((json.dumps({"query_id": r.query_id, "results": results}) + "\n").encode())
            out.flush()                                                # a killed call keeps this row
            written += 1
            if on_row is not None:
                on_row(written)
        os.fsync(out.fileno())
    return written


def answer_naming_output(cfg: RunConfig, pipe, pending, out, on_row=None) -> int:
    """answer(), with an OSError (a full disk) naming the output in its one-line message."""
    try:
        return answer(cfg, pipe, pending, out, on_row)
    except OSError as e:
        from engine.io import naming

        raise naming(e, cfg.output) from e


if __name__ == "__main__":
    sys.exit(main())
