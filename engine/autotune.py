"""Measure, don't assume: the build's choice of precision, batch size, backend and options.

`engine.build --precision auto --batch-size auto --backend auto` asks this module which
candidate to build, on the machine the build runs on (a benchmark's build step runs on
the scored hardware, untimed). It works like TensorRT's tactic timing or Inductor's
max-autotune, one level up:

1. candidates: the precisions the device runs natively (`native_precisions`: the CPU's
   capability as torch reports it, the GPU's compute capability; the others are listed as
   skipped, with why), the preset's batch sizes, the backends that import, CUDA graphs on
   and off, compile options that change kernels (Inductor's max-autotune on the CPU);
2. screen: every (precision, batch) once through the eager policy network, cheap, to
   order the compiles (time the graph first, compile only what could win);
3. trial: compile a candidate with its backend, time the compiled graph at steady state
   (warm-up excluded, synchronised clocks, median of several calls), then classify the
   calibration images: FP32 candidates must agree with the FP32 graph, low-precision ones
   get their guard's tau (engine.calibrate.choose_tau) and must hold the disagreement
   budget; a low-precision rate counts its expected re-check cost;
4. confirm: the leading candidates are timed again, alternated, and keep the median;
5. choice: the fastest that holds; within TIE of it, the simplest (FP32 over guarded low
   precision, no extra compile options, fewer moving parts).

The measurements go through a `Measurer` (real: `engine.autotune_measure.Measurer`), so
the search's logic is tested with fake timings. Everything measured lands in the table
the manifest records; a candidate that fails to compile, capture or agree is one line on
stderr and a row saying why.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Protocol

TIE = 0.03          # rates within 3 % of the fastest are a tie (timing noise): the simpler one wins
PRUNE = 0.6         # a (precision, batch) screened under 60 % of the best is not compiled (unless it is
                    # its precision's best)
SIMPLER = {"fp32": 0, "bf16": 1, "fp16": 2, "fp8": 3}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to build the model."""
    precision: str
    batch_size: int
    backend: str
    cuda_graphs: bool = False
    options: str = "default"        # compile options of the backend: "default" | "max-autotune"

    @property
    def name(self) -> str:
        extra = ("+graphs" if self.cuda_graphs else "") + ("" if self.options == "default" else f"+{self.options}")
        return f"{self.backend}/{self.precision}/b{self.batch_size}{extra}"

    def complexity(self) -> tuple:
        """Smaller is simpler: FP32 first, then no extra compile options, no graphs, the reference backend."""
        from engine.backends import REFERENCE

        return (SIMPLER[self.precision], self.options != "default", self.cuda_graphs, self.backend != REFERENCE,
                self.batch_size)


@dataclasses.dataclass
class Trial:
    """What was measured of one candidate, as the manifest records it."""
    candidate: Candidate
    status: str = "pending"         # chosen | holds | slower | rejected | failed | not compiled
    why: str = ""
    screened_images_per_s: float | None = None   # eager policy network (the screen)
    images_per_s: float | None = None            # the compiled graph, steady state
    effective_images_per_s: float | None = None  # with the guard's expected re-check cost
    agreement: float | None = None               # top-1 vs the FP32 graph on the calibration images, guarded
    tau: float | None = None
    rechecked_fraction: float | None = None
    estimated_per_10k: float | None = None
    seconds: float = 0.0
    guard: dict | None = None                    # choose_tau's record (low precision), for the artifact
    recheck_images_per_s: float | None = None    # the re-check graph's rate its effective rate was priced at

    def row(self) -> dict:
        c = self.candidate
        out = {"name": c.name, "precision": c.precision, "batch_size": c.batch_size, "backend": c.backend,
               "cuda_graphs": c.cuda_graphs, "options": c.options, "status": self.status}
        for k in ("why", "screened_images_per_s", "images_per_s", "effective_images_per_s", "agreement", "tau",
                  "rechecked_fraction", "estimated_per_10k", "recheck_images_per_s"):
            v = getattr(self, k)
            if v not in (None, ""):
                out[k] = round(v, 6) if isinstance(v, float) else v
        out["seconds"] = round(self.seconds, 2)
        return out


@dataclasses.dataclass
class Agreement:
    """A compiled candidate on the calibration images, against the FP32 graph."""
    agreement: float                 # guarded top-1 agreement (low rows take the FP32 answer)
    holds: bool                      # within the disagreement budget
    why: str = ""
    tau: float | None = None
    rechecked_fraction: float = 0.0
    estimated_per_10k: float | None = None
    guard: dict | None = None        # choose_tau's record, for the artifact


class Measurer(Protocol):
    """The measuring side of the search (real: engine.autotune_measure; tests: fakes)."""

    def screen(self, precision: str, batch_size: int) -> float:
        """images/s of the eager policy network at this precision and batch."""

    def compile(self, cand: Candidate):
        """Build the candidate's graph (in a folder of its own); returns a handle for `time`/`agree`."""

    def time(self, handle, cand: Candidate) -> float:
        """images/s of the compiled graph at steady state (CUDA graphs replayed when cand says so)."""

    def agree(self, handle, cand: Candidate) -> Agreement:
        """The candidate on the calibration images against the FP32 graph, with its guard."""

    def recheck_rate(self) -> float:
        """images/s of the guard's FP32 re-check graph at its batch on this device (measured once)."""


@dataclasses.dataclass
class SearchConfig:
    precisions: tuple[str, ...]     # to measure (native ones unless asked otherwise)
    batch_sizes: tuple[int, ...]
    backends: tuple[str, ...]       # that import on this machine
    device: str = "cpu"
    budget_s: float = 900.0         # the whole search: screens, compiles, timings, agreement
    options: tuple[str, ...] = ("default",)   # compile options to try (each on the best FP32 candidate)
    options_backends: tuple[str, ...] = ()    # the backends that take those options
    cuda_graphs: tuple[bool, ...] = (False,)  # on CUDA: (True, False)
    compiled: tuple[str, ...] = ()  # backends whose build compiles (budgeted by their compile time)


@dataclasses.dataclass
class SearchResult:
    trials: list[Trial]
    ranked: list[Trial]             # the ones that hold, best first (the build verifies in this order)
    skipped: dict[str, str]         # precisions (or backends) not measured, and why
    seconds: float
    handles: dict                   # candidate name -> compiled handle (the build reuses the chosen one's files)

    def table(self) -> list[dict]:
        return [t.row() for t in self.trials]


def _say(msg: str) -> None:
    print(f"engine.build: {msg}", file=sys.stderr, flush=True)


def search(m: Measurer, cfg: SearchConfig, skipped: dict[str, str] | None = None,
           clock: Callable[[], float] = time.perf_counter) -> SearchResult:
    """Screen, compile what could win within the budget, time, check agreement, rank."""
    from engine.backends import REFERENCE

    t0 = clock()
    left = lambda: cfg.budget_s - (clock() - t0)  # noqa: E731
    trials: list[Trial] = []
    handles: dict = {}
    # 1. screen every (precision, batch) on the eager policy network
    screened: dict[tuple[str, int], float] = {}
    for p in cfg.precisions:
        for b in cfg.batch_sizes:
            t = clock()
            try:
                screened[(p, b)] = m.screen(p, b)
            except Exception as e:  # noqa: BLE001 - a precision this machine cannot run is a row, not a crash
                why = _why(e)
                _say(f"autotune: {p} batch {b}: screen failed ({why}); not a candidate")
                trials.append(Trial(Candidate(p, b, REFERENCE), "failed", f"screen: {why}", seconds=clock() - t))
    if not screened:
        return SearchResult(trials, [], dict(skipped or {}), clock() - t0, handles)
    best_screen = max(screened.values())
    # 2. the candidates, most promising first: per backend, (precision, batch) by screened rate
    order = sorted(screened, key=lambda k: -screened[k])
    cands: list[Candidate] = []
    for be in cfg.backends:
        for p, b in order:
            for g in (cfg.cuda_graphs if cfg.device == "cuda" else (False,)):
                cands.append(Candidate(p, b, be, g))
    best_fp32 = next((k for k in order if k[0] == "fp32"), None)
    # each precision's best-screened batch is compiled whatever its eager rate (a compiled graph can
    # rank precisions differently from eager); the others only when they screen near the best
    leaders = {next(k for k in order if k[0] == p) for p in {k[0] for k in order}}
    for opt in cfg.options:
        if opt != "default" and best_fp32 is not None:
            for be in cfg.backends:
                if be in cfg.options_backends:
                    cands.append(Candidate(best_fp32[0], best_fp32[1], be, False, opt))
    compile_cost = 0.0       # the longest compile so far: a compile is started only when one fits
    built: dict[tuple, object] = {}
    for c in cands:
        trial = Trial(c, screened_images_per_s=screened[(c.precision, c.batch_size)])
        trials.append(trial)
        rate = screened[(c.precision, c.batch_size)]
        if (c.precision, c.batch_size) not in leaders and rate < PRUNE * best_screen:
            trial.status, trial.why = "not compiled", f"screened at {rate:.1f} images/s, under {PRUNE:.0%} of the best"
            continue
        key = (c.precision, c.batch_size, c.backend, c.options)
        t = clock()
        if left() <= 0:
            trial.status, trial.why = "not compiled", f"the search budget of {cfg.budget_s:.0f} s is spent"
            continue
        if key not in built:
            if c.backend in cfg.compiled and left() < 1.5 * compile_cost:
                trial.status, trial.why = "not compiled", f"{left():.0f} s of the search budget left"
                continue
            try:
                built[key] = m.compile(c)
            except Exception as e:  # noqa: BLE001 - a candidate that cannot build is skipped with its reason
                built[key] = e
            if c.backend in cfg.compiled:
                compile_cost = max(compile_cost, clock() - t)
        handle = built[key]
        if isinstance(handle, Exception):
            trial.status, trial.why = "failed", f"build: {_why(handle)}"
            trial.seconds = clock() - t
            _say(f"autotune: {c.name}: {trial.why}; skipped")
            continue
        try:
            trial.images_per_s = m.time(handle, c)
            # the fastest that holds with an exact rate (nothing re-checked): a candidate slower than it
            # cannot win whatever its agreement, so the calibration set is not classified for it
            lead = max((t for t in trials if t.status == "holds" and t.images_per_s and not t.rechecked_fraction),
                       default=None, key=lambda t: t.images_per_s)
            if lead is not None and trial.images_per_s < lead.images_per_s * (1 - TIE):
                trial.status = "slower"
                trial.why = (f"{trial.images_per_s:.1f} images/s on the graph, under {lead.images_per_s:.1f} of "
                             f"{lead.candidate.name}: agreement not measured")
                trial.seconds = clock() - t
                continue
        except Exception as e:  # noqa: BLE001 - capture or run failure: the next candidate
            trial.status, trial.why = "failed", f"run: {_why(e)}"
            trial.seconds = clock() - t
            _say(f"autotune: {c.name}: {trial.why}; skipped")
            continue
        _judge(m, trial, handle, handles)
        trial.seconds = clock() - t
    _confirm(m, trials, built, cfg)
    _readmit(m, trials, built, handles, cfg)
    _effective_rates(trials, m)
    ranked = rank(trials)
    if ranked:
        mark(trials, ranked[0])
    return SearchResult(trials, ranked, dict(skipped or {}), clock() - t0, handles)


def _judge(m: Measurer, trial: Trial, handle, handles: dict) -> None:
    """The candidate's agreement with the FP32 graph on the calibration set: holds or rejected."""
    c = trial.candidate
    try:
        a = m.agree(handle, c)
    except Exception as e:  # noqa: BLE001 - a run failure: the next candidate
        trial.status, trial.why = "failed", f"run: {_why(e)}"
        _say(f"autotune: {c.name}: {trial.why}; skipped")
        return
    trial.agreement, trial.tau, trial.rechecked_fraction = a.agreement, a.tau, a.rechecked_fraction
    trial.estimated_per_10k, trial.guard = a.estimated_per_10k, a.guard
    if not a.holds:
        trial.status, trial.why = "rejected", a.why or "does not hold the disagreement budget"
        _say(f"autotune: {c.name}: {trial.why}; skipped")
        return
    trial.status = "holds"
    handles[c.name] = handle


def _readmit(m: Measurer, trials: list[Trial], built: dict, handles: dict, cfg: SearchConfig) -> None:
    """A candidate called slower than a lead whose first timing the confirmation lowered is judged
    after all, and the leaders confirmed again: one disturbed timing of the lead prunes nothing."""
    def leader() -> Trial | None:
        return max((t for t in trials if t.status == "holds" and t.images_per_s and not t.rechecked_fraction),
                   default=None, key=lambda t: t.images_per_s)

    lead = leader()
    if lead is None:
        return
    again = [t for t in trials if t.status == "slower" and t.images_per_s
             and t.images_per_s >= lead.images_per_s * (1 - TIE)]
    for t in again:
        c = t.candidate
        t.why = ""
        _judge(m, t, built[(c.precision, c.batch_size, c.backend, c.options)], handles)
    if again:
        _confirm(m, trials, built, cfg)
        lead = leader() or lead
    for t in trials:   # the ones left slower name the leader as confirmed
        if t.status == "slower" and t.images_per_s:
            t.why = (f"{t.images_per_s:.1f} images/s on the graph, under {lead.images_per_s:.1f} of "
                     f"{lead.candidate.name}: agreement not measured")


def mark(trials: list[Trial], best: Trial, chosen: bool = False) -> None:
    """Say against what each other candidate that holds lost; `chosen`: `best` is the final choice."""
    rate = best.effective_images_per_s or 0.0
    for t in trials:
        if t is best:
            t.why = ""
            if chosen:
                t.status = "chosen"
        elif t.status == "holds" and t.effective_images_per_s is not None:
            t.why = f"{t.effective_images_per_s:.1f} images/s against {rate:.1f} of {best.candidate.name}"


CONFIRM_TOP, CONFIRM_ROUNDS = 3, 2


def _confirm(m: Measurer, trials: list[Trial], built: dict, cfg: SearchConfig) -> None:
    """The leading candidates timed again, alternated, CONFIRM_ROUNDS more times: each rate is the
    median of its timings, so one disturbed measurement does not decide the choice."""
    import statistics

    lead = sorted((t for t in trials if t.status == "holds" and t.images_per_s), key=lambda t: -t.images_per_s)
    lead = lead[:CONFIRM_TOP]
    if len(lead) < 2:
        return
    samples = {id(t): [t.images_per_s] for t in lead}
    for _ in range(CONFIRM_ROUNDS):
        for t in lead:
            c = t.candidate
            try:
                samples[id(t)].append(m.time(built[(c.precision, c.batch_size, c.backend, c.options)], c))
            except Exception as e:  # noqa: BLE001 - it ran before: say so and keep the earlier timings
                _say(f"autotune: {c.name}: timing again failed ({_why(e)})")
    for t in lead:
        t.images_per_s = statistics.median(samples[id(t)])


def _effective_rates(trials: list[Trial], m: Measurer | None = None) -> None:
    """A guarded candidate's rate with its expected re-check cost: each image costs 1/r, plus the
    re-checked share f at the rate of the graph that runs the re-checks, r_re (IEEE FP32 at the
    re-check batch, `m.recheck_rate()`, measured once on this device: on a GPU about a tenth of
    bf16's, so each re-check costs ~10 images): 1 / (1/r + f/r_re). Without that measurement
    (it failed: one stderr line), the best FP32 candidate's rate stands in, else the candidate's own."""
    guarded = [t for t in trials if t.status == "holds" and t.images_per_s and t.candidate.precision != "fp32"
               and t.rechecked_fraction]
    r_re = None
    if guarded and m is not None:
        try:
            r_re = m.recheck_rate()
        except Exception as e:  # noqa: BLE001 - priced with a stand-in instead, said here
            _say(f"autotune: the re-check graph's rate could not be measured ({_why(e)}); re-checks priced at "
                 "the best FP32 candidate's rate")
    if r_re is None:
        fp32 = [t.images_per_s for t in trials if t.candidate.precision == "fp32" and t.status == "holds"
                and t.images_per_s]
        r_re = max(fp32) if fp32 else None
    for t in trials:
        if t.images_per_s is None or t.status != "holds":
            continue
        f = t.rechecked_fraction or 0.0
        if t.candidate.precision == "fp32" or f == 0.0:
            t.effective_images_per_s = t.images_per_s
        elif r_re:
            t.effective_images_per_s = 1.0 / (1.0 / t.images_per_s + f / r_re)
            t.recheck_images_per_s = r_re
        else:  # no FP32 rate measured: the re-checks are costed at the low-precision rate
            t.effective_images_per_s = t.images_per_s / (1.0 + f)


def rank(trials: list[Trial]) -> list[Trial]:
    """The trials that hold, best first: the fastest, except that anything within TIE of a faster
    one and simpler goes before it."""
    ok = [t for t in trials if t.status == "holds" and t.effective_images_per_s]
    ok.sort(key=lambda t: -t.effective_images_per_s)
    out: list[Trial] = []
    while ok:
        top = ok[0].effective_images_per_s
        tied = [t for t in ok if t.effective_images_per_s >= top * (1 - TIE)]
        pick = min(tied, key=lambda t: t.candidate.complexity())
        out.append(pick)
        ok.remove(pick)
    return out


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:200]


def format_table(result: SearchResult, chosen: str | None) -> str:
    """The short table the build prints: one line per candidate, the choice marked."""
    lines = [f"{'candidate':34} {'screen':>8} {'graph':>8} {'eff.':>8} {'agree':>7} {'tau':>7}  status"]
    for t in result.trials:
        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"
        mark = "chosen" if t.candidate.name == chosen else t.status
        lines.append(f"{t.candidate.name:34} {f(t.screened_images_per_s, '8.1f')} {f(t.images_per_s, '8.1f')} "
                     f"{f(t.effective_images_per_s, '8.1f')} {f(t.agreement, '7.4f')} {f(t.tau, '7.4f')}  "
                     f"{mark}{(': ' + t.why) if t.why and mark != 'chosen' else ''}")
    for k, why in result.skipped.items():
        lines.append(f"{k:34} {'':>8} {'':>8} {'':>8} {'':>7} {'':>7}  skipped: {why}")
    return "\n".join(lines)
