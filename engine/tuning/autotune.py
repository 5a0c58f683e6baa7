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
   order the compiles (time the graph first, compile only what could win); the order is breadth
   first (`_candidates`): one candidate per precision and per backend before a second batch size
   of any, and fp16 not compiled where bf16 holds at the same screened cost (`Run._same_cost`);
3. trial: compile a candidate with its backend when its estimate fits the time and the disk
   left (`Run`; a compile past the preset's `compile_share` of the time left is stopped and its
   backend dropped: engine.tuning.watchdog), time the compiled graph at steady state (warm-up excluded,
   synchronised clocks, median of several calls), then classify the calibration images: FP32
   candidates must agree with the FP32 graph, low-precision ones get their guard's tau
   (engine.tuning.calibrate.choose_tau) and must hold the disagreement budget; a low-precision rate
   counts its expected re-check cost;
4. retime: a candidate within RETIME of the leader is timed again interleaved with it, and
   every rate is the median of its timings (engine.tuning.retime); at the end the KEEP best
   that hold are timed again interleaved;
5. choice: the fastest that holds; a faster one replaces a simpler one (FP32 over guarded low
   precision, no extra compile options, fewer moving parts) only beyond TIE plus the spread.

The measurements go through a `Measurer` (real: `engine.tuning.measure.Measurer`), so
the search's logic is tested with fake timings. The first candidate of each precision that compiles
nothing (the eager backend) has its agreement measured even when it is slower: `fallback_choice`
takes the best of those that held when nothing compiled is verified in time (engine.tuning.auto).
Everything measured lands in the table
the manifest records; a candidate that fails to compile, capture or agree is one line on
stderr and a row saying why, and a loser's files are removed as it loses.
"""
from __future__ import annotations

import collections
import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Protocol

from engine.presets import shared
from engine.tuning.clock import SearchDeadline
from engine.tuning.compile_failures import environmental
from engine.tuning.retime import RETIME, ROUNDS, TIE, Timer, faster, margin  # noqa: F401 - TIE: a search rule
from engine.tuning.table import LEGEND, format_table  # noqa: F401 - the table the build prints
from engine.tuning.watchdog import CompileStopped, stop_after

PRUNE = shared("search_prune")   # a (precision, batch) screened under 60 % of the best is not compiled (unless
                                 # it is its precision's best)
SIMPLER = {"fp32": 0, "bf16": 1, "fp16": 2, "fp8": 3, "fp8-torchao": 3, "int8": 4}
KEEP = shared("search_keep")     # candidates that hold and keep their compiled files for the build's verification


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
    status: str = "pending"         # chosen | holds | slower | rejected | failed | not compiled | not screened
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
    timings: list[float] = dataclasses.field(default_factory=list)   # every images/s timing of the graph
    recheck_images_per_s: float | None = None    # the re-check graph's rate its effective rate was priced at
    held: bool | None = None                     # its agreement held the budget (None: not measured); also on
                                                 # a slower candidate measured for the fallback

    def row(self) -> dict:
        c = self.candidate
        out = {"name": c.name, "precision": c.precision, "batch_size": c.batch_size, "backend": c.backend,
               "cuda_graphs": c.cuda_graphs, "options": c.options, "status": self.status}
        for k in ("why", "screened_images_per_s", "images_per_s", "effective_images_per_s", "agreement", "tau",
                  "rechecked_fraction", "estimated_per_10k", "recheck_images_per_s"):
            v = getattr(self, k)
            if v not in (None, ""):
                out[k] = round(v, 6) if isinstance(v, float) else v
        if self.timings:
            out["timings"] = [round(x, 3) for x in self.timings]
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
    """The measuring side of the search (real: engine.tuning.measure; tests: fakes)."""

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

    # optional: `discard(handle)` removes a losing candidate's files (the search calls it when it has one)


@dataclasses.dataclass
class SearchConfig:
    """What the search measures and within what: the preset's fields (batch_sizes, budget_s, options,
    cuda_graphs, compile_estimate_s) have no defaults here; engine.tuning.auto.search_config fills them
    from the device's preset (engine/presets/classification.py)."""
    precisions: tuple[str, ...]     # to measure (native ones unless asked otherwise)
    batch_sizes: tuple[int, ...]
    backends: tuple[str, ...]       # that import on this machine
    device: str
    budget_s: float                 # the whole search: screens, compiles, timings, agreement
    options: tuple[str, ...]        # compile options to try (each on the best FP32 candidate), "default" first
    cuda_graphs: tuple[bool, ...]   # on CUDA: (True, False)
    compile_estimate_s: float       # one compile's seconds before one is measured (0: the first always starts)
    options_backends: tuple[str, ...] = ()    # the backends that take those options
    compiled: tuple[str, ...] = ()  # backends whose build compiles (budgeted by their compile time)
    fp16_same_cost: float | None = None   # the preset's: fp16 beside a bf16 that holds only when its screen is
                                          # faster by more than this share (None: by anything)
    compile_share: float | None = None   # the preset's: a compile stopped past this share of the time left
                                         # when it started (None: never stopped)
    only: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)   # precisions only some
                                    # backends build (int8: the quantizing ones), and those backends


@dataclasses.dataclass
class SearchResult:
    trials: list[Trial]
    ranked: list[Trial]             # the ones that hold, best first (the build verifies in this order)
    skipped: dict[str, str]         # precisions (or backends) not measured, and why
    seconds: float
    handles: dict                   # candidate name -> compiled handle (the build reuses the chosen one's files)
    dropped: dict[str, str] = dataclasses.field(default_factory=dict)   # backends dropped, and why

    def table(self) -> list[dict]:
        return [t.row() for t in self.trials]


def _say(msg: str) -> None:
    print(f"engine.build: {msg}", file=sys.stderr, flush=True)


def search(m: Measurer, cfg: SearchConfig, skipped: dict[str, str] | None = None,
           clock: Callable[[], float] = time.perf_counter, deadline=None, disk=None) -> SearchResult:
    """Screen, compile what could win within the time left, time (retiming what is within reach of the
    leader), check agreement, confirm the leaders, rank. `deadline`: an engine.tuning.clock.SearchDeadline
    kept on `clock` (default: cfg.budget_s on `clock`); `disk`: an engine.tuning.disk.WorkDisk, checked before each compile."""
    t0 = clock()
    deadline = deadline or SearchDeadline(cfg.budget_s, clock)
    trials: list[Trial] = []
    screened = _screen(m, cfg, trials, clock, deadline)
    if not screened:
        return SearchResult(trials, [], dict(skipped or {}), clock() - t0, {})
    cands, compile_anyway = _candidates(cfg, screened)
    run = Run(m, cfg, deadline, disk, trials, cands, screened)
    best_screen = max(screened.values())
    for c in cands:
        rate = screened[(c.precision, c.batch_size)]
        pruned = (c.precision, c.batch_size) not in compile_anyway and rate < PRUNE * best_screen
        run.candidate(c, rate, f"screened at {rate:.1f} images/s, under {PRUNE:.0%} of the best" if pruned else "")
    ranked = run.finish()
    if ranked:
        mark(trials, ranked[0])
    return SearchResult(trials, ranked, dict(skipped or {}), clock() - t0, run.handles, dict(run.dropped))


SCREEN_CALLS = 3     # a screen's calls of its batch: one warm-up, two timed (engine.tuning.measure.Measurer.screen)


def _screen(m: Measurer, cfg: SearchConfig, trials: list[Trial], clock, deadline=None) -> dict[tuple[str, int], float]:
    """Every (precision, batch) once on the eager policy network: {(precision, batch): images/s}. With a
    `deadline` (an engine.tuning.clock.SearchDeadline), a screen starts only while its cost, at the seconds
    per image the screens so far took (that precision's, else the slowest), fits what is left."""
    from engine.backends import REFERENCE

    screened: dict[tuple[str, int], float] = {}
    per_image: dict[str, float] = {}          # precision -> seconds per image its screens took
    for p in cfg.precisions:
        for b in cfg.batch_sizes:
            if deadline is not None:
                left = deadline.left()
                cost = SCREEN_CALLS * b * per_image.get(p, max(per_image.values(), default=0.0))
                if left <= 0 or cost > left:
                    trials.append(Trial(Candidate(p, b, REFERENCE), "not screened",
                                        f"{left:.0f} s {deadline.what_left()} left, a screen takes about {cost:.0f} s"))
                    continue
            t = clock()
            try:
                screened[(p, b)] = m.screen(p, b)
            except Exception as e:  # noqa: BLE001 - a precision this machine cannot run is a row, not a crash
                why = _why(e)
                _say(f"autotune: {p} batch {b}: screen failed ({why}); not a candidate")
                trials.append(Trial(Candidate(p, b, REFERENCE), "failed", f"screen: {why}", seconds=clock() - t))
                continue
            per_image[p] = max(per_image.get(p, 0.0), (clock() - t) / (SCREEN_CALLS * b))
    return screened


def _candidates(cfg: SearchConfig, screened: dict) -> tuple[list[Candidate], set]:
    """The candidates in the order the search meets them, and the (precision, batch) pairs compiled
    whatever their eager rate: each precision's best-screened batch (a compiled graph can rank
    precisions differently from eager). First one candidate per precision and per backend: each
    precision's best-screened batch on every backend (the ones that compile nothing first: cheap, and
    the fallback's), precisions by their best screen (`precision_order`); only then a second batch
    size of any, the other (precision, batch) pairs by screened rate, each on every backend. So every
    precision (fp8 included) and every backend (TensorRT included) is compiled once before the
    compiles that fit are spent on batch variants of one."""
    order = sorted(screened, key=lambda k: -screened[k])
    leaders: dict[str, tuple] = {}                 # precision -> its best-screened (precision, batch)
    for k in order:
        leaders.setdefault(k[0], k)
    first = [leaders[p] for p in precision_order(leaders, screened, cfg.fp16_same_cost or 0.0)]
    rest = [k for k in order if k not in first]
    backs = sorted(cfg.backends, key=lambda be: be in cfg.compiled)   # stable: compile-free ones first
    graphs = cfg.cuda_graphs if cfg.device == "cuda" else (False,)
    cands = [Candidate(p, b, be, g) for p, b in first + rest for be in backs for g in graphs
             if p not in cfg.only or be in cfg.only[p]]   # int8: only the backends that quantize
    best_fp32 = leaders.get("fp32")
    for opt in cfg.options:
        if opt != "default" and best_fp32 is not None:
            for be in cfg.backends:
                if be in cfg.options_backends:
                    cands.append(Candidate(best_fp32[0], best_fp32[1], be, False, opt))
    return cands, set(leaders.values())


def precision_order(leaders: dict[str, tuple], screened: dict, same_cost: float) -> list[str]:
    """The precisions by their best screen, fastest first, except that fp16 comes right after bf16
    when its screen is not faster by more than `same_cost`: bf16 is measured first, and fp16 is then
    skipped where bf16 holds (`Run._same_cost`)."""
    out = sorted(leaders, key=lambda p: -screened[leaders[p]])
    if "bf16" in out and "fp16" in out and out.index("fp16") < out.index("bf16") \
            and screened[leaders["fp16"]] <= screened[leaders["bf16"]] * (1 + same_cost):
        out.remove("fp16")
        out.insert(out.index("bf16") + 1, "fp16")
    return out


FIT = shared("compile_fit")      # a compile starts when 1.5 x its estimate is left: the compile, its timings and agreement
REMOVED = "removed"  # built[key] once a compile's files are gone


def _key(c: Candidate) -> tuple:
    """The compile a candidate uses: CUDA graphs on and off share one."""
    return (c.precision, c.batch_size, c.backend, c.options)


class Run:
    """One search's candidate loop. In the order a candidate meets them: a backend dropped after a
    failure of the machine (engine.tuning.compile_failures) is not compiled again; a compile starts when FIT
    x its estimate is left and the disk holds one more; after its first timing a candidate more than
    RETIME under the leader (the better of two timings, against a leader settled on SETTLED timings)
    is slower, one within RETIME is retimed interleaved with the leader and slower only beyond the
    margin; files go as soon as a candidate loses (slower, rejected, failed, ranked beyond KEEP)."""

    def __init__(self, m, cfg, deadline, disk, trials: list, cands: list, screened: dict | None = None):
        self.m, self.cfg, self.deadline, self.disk = m, cfg, deadline, disk
        self.clock = deadline.clock              # the search's clock, the one its deadline keeps
        self.screened = screened or {}           # (precision, batch) -> eager images/s
        self.trials = trials
        self.handles: dict = {}                  # candidate name -> handle, for the ones that hold and keep files
        self.built: dict = {}                    # compile key -> handle | exception | REMOVED
        self.users = collections.Counter(_key(c) for c in cands)   # candidates of each compile still to decide
        self.dropped: dict[str, str] = {}        # backend -> why it was dropped
        self.compiles: list[float] = []          # seconds of each compile (its estimate: the longest)
        self.timer = Timer(m, lambda t: self.built[_key(t.candidate)], self.clock, deadline.left)
        self._recheck: list = []                 # the re-check graph's rate (None: not measurable), asked once

    def recheck_rate(self) -> float | None:
        """The Measurer's re-check rate, asked once per search; None when it cannot be measured
        (said once on stderr: the best FP32 candidate's rate then stands in)."""
        if not self._recheck:
            try:
                self._recheck.append(self.m.recheck_rate())
            except Exception as e:  # noqa: BLE001 - priced with a stand-in instead, said here
                _say(f"autotune: the re-check graph's rate could not be measured ({_why(e)}); re-checks priced "
                     "at the best FP32 candidate's rate")
                self._recheck.append(None)
        return self._recheck[0]

    def candidate(self, c: Candidate, screened: float, pruned: str) -> None:
        trial = Trial(c, screened_images_per_s=screened)
        self.trials.append(trial)
        t = self.clock()
        try:
            self._decide(trial, pruned)
        finally:
            trial.seconds = self.clock() - t if trial.status != "not compiled" else 0.0
            self.users[_key(c)] -= 1
            self._tidy(_key(c))

    def _decide(self, trial: Trial, pruned: str) -> None:
        c = trial.candidate
        why = (pruned or (f"backend {c.backend} dropped: {self.dropped[c.backend]}" if c.backend in self.dropped
                          else self._same_cost(c)
                          or (f"{self.deadline.why_spent()} is spent" if self.deadline.left() <= 0 else "")))
        if why:
            trial.status, trial.why = "not compiled", why
            return
        key = _key(c)
        if key not in self.built and not self._compile(trial):
            return
        handle = self.built[key]
        if isinstance(handle, Exception):
            trial.status, trial.why = "failed", f"build: {_why(handle)}"
            _say(f"autotune: {c.name}: {trial.why}; skipped")
            return
        try:
            self.timer.once(trial)
        except Exception as e:  # noqa: BLE001 - capture or run failure: the next candidate
            trial.status, trial.why = "failed", f"run: {_why(e)}"
            _say(f"autotune: {c.name}: {trial.why}; skipped")
            return
        if self._slower(trial):
            if self._fallback_unmeasured(c) and _agreement(self.m, trial, handle) is not None:
                trial.why += ("; agreement measured all the same, as the fallback's candidate of its precision: "
                              + ("it holds" if trial.held else "it does not hold"))
            return
        _judge(self.m, trial, handle, self.handles)
        if trial.status == "holds":
            self._keep_best()

    def _same_cost(self, c: Candidate) -> str:
        """Why fp16 is not compiled: bf16 holds on the same backend, and fp16's eager screen at this batch
        is not faster than bf16's by more than cfg.fp16_same_cost (the same GEMM cost: what bf16 holds,
        fp16 could only tie). "" when fp16 is worth its compile."""
        if c.precision != "fp16" or ("bf16", c.batch_size) not in self.screened:
            return ""
        if not any(t.held and t.candidate.precision == "bf16" and t.candidate.backend == c.backend
                   for t in self.trials):
            return ""
        fp16, bf16 = self.screened[("fp16", c.batch_size)], self.screened[("bf16", c.batch_size)]
        same = self.cfg.fp16_same_cost or 0.0
        if fp16 > bf16 * (1 + same):
            return ""
        return (f"bf16 holds on {c.backend} at the same cost: fp16 screened {fp16:.1f} images/s, not more than "
                f"{same:.0%} over bf16's {bf16:.1f}")

    def _fallback_unmeasured(self, c: Candidate) -> bool:
        """Whether `c` needs no compile and no such candidate of its precision has held yet: its agreement is
        then measured even when it is slower, so the build's fallback has a measured candidate to take."""
        if c.backend in self.cfg.compiled:
            return False
        return not any(t.held and t.candidate.precision == c.precision and t.candidate.backend not in
                       self.cfg.compiled for t in self.trials)

    def _compile(self, trial: Trial) -> bool:
        """Compile the trial's candidate when its estimate fits the time and the disk: False (and the
        trial's row says why) when it does not; a failure is kept in `built` as the exception."""
        c = trial.candidate
        compiles, left = c.backend in self.cfg.compiled, self.deadline.left()
        cost = max(self.compiles) if self.compiles else self.cfg.compile_estimate_s
        if compiles and left < FIT * cost:
            trial.status = "not compiled"
            trial.why = f"{left:.0f} s {self.deadline.what_left()} left, a compile takes about {cost:.0f} s"
            return False
        why = self.disk.fits() if self.disk is not None else None
        if why:
            trial.status, trial.why = "not compiled", f"disk: {why}"
            _say(f"autotune: {c.name}: not compiled: {why}")
            return False
        t = self.clock()
        if self.disk is not None:
            self.disk.before()
        # the watchdog: a compile past its share of the time left is stopped (engine.tuning.watchdog)
        limit = self.cfg.compile_share * left if compiles and self.cfg.compile_share else None
        stopped = False
        try:
            with stop_after(limit):
                self.built[_key(c)] = self.m.compile(c)
        except CompileStopped as e:
            stopped = True
            self.built[_key(c)] = RuntimeError(f"compile {e}")
            self.dropped[c.backend] = (f"a compile ran past its share of the time left ({limit:.0f} s of "
                                       f"{left:.0f} s) and was stopped")
            _say(f"autotune: backend {c.backend} dropped: {c.name}'s compile ran past {limit:.0f} s "
                 f"({self.cfg.compile_share:.0%} of the {left:.0f} s left) and was stopped; its other candidates "
                 "are not compiled")
        except Exception as e:  # noqa: BLE001 - a candidate that cannot build is skipped with its reason
            self.built[_key(c)] = e
            reason = environmental(e)
            if reason:
                self.dropped[c.backend] = reason
                _say(f"autotune: backend {c.backend} dropped: {reason}; its other candidates are not compiled")
        finally:
            if self.disk is not None:
                self.disk.after()
        if compiles and not stopped:   # a stopped compile is no estimate of the others' (its backend is gone)
            self.compiles.append(self.clock() - t)
            self.deadline.compiled(self.compiles[-1])
        return True

    def _lead(self) -> Trial | None:
        """The fastest that holds with an exact rate (nothing re-checked) and still has its files."""
        return max((t for t in self.trials if t.status == "holds" and t.images_per_s and not t.rechecked_fraction
                    and t.candidate.name in self.handles), default=None, key=lambda t: t.images_per_s)

    def _slower(self, trial: Trial) -> bool:
        """Whether the trial is slower than the leader (it then cannot win whatever its agreement)."""
        lead = self._lead()
        if lead is None:
            return False
        self.timer.settle(lead)
        best = lead.images_per_s
        if trial.images_per_s < best * (1 - RETIME):
            self.timer.again(trial)     # a disturbance only slows a timing: the better of two decides
        r = max(trial.timings)
        if r < best * (1 - RETIME):
            trial.status = "slower"
            trial.why = (f"{r:.1f} images/s on the graph, under {best:.1f} of {lead.candidate.name} (more than "
                         f"{RETIME:.0%} under: not retimed): agreement not measured")
            return True
        if r > best * (1 + RETIME):
            return False
        self.timer.interleave([lead, trial])
        if not faster(lead, trial):
            return False
        trial.status = "slower"
        trial.why = (f"{trial.images_per_s:.1f} images/s on the graph (median of {len(trial.timings)}), under "
                     f"{lead.images_per_s:.1f} of {lead.candidate.name} (median of {len(lead.timings)}) by more "
                     f"than the {margin(lead, trial):.1%} margin: agreement not measured")
        return True

    def _keep_best(self) -> None:
        """Only the KEEP best that hold keep their files (the build verifies no more). A candidate is
        not dropped on one timing: one about to lose its files gets a second (the better of two
        decides) and, when that brings it within RETIME of the best, is timed interleaved with it.
        (Guarded candidates never lead the loop's retiming, and one judged before a faster candidate
        arrived was never timed against it: this is where their first timing is checked.)"""
        for t in self._ranked()[KEEP:]:
            best = self._ranked()[0]
            if len(t.timings) >= 2 or best is t:
                continue
            if not self.timer.room(1) or not self.timer.again(t):
                continue
            if max(t.timings) >= best.images_per_s * (1 - RETIME):
                self.timer.interleave([best, t])
        for t in self._ranked()[KEEP:]:
            self.handles.pop(t.candidate.name)
            self._tidy(_key(t.candidate))

    def _ranked(self) -> list[Trial]:
        """The ones that hold and keep their files, best first (effective rates brought up to date)."""
        _effective_rates(self.trials, self.recheck_rate)
        return [t for t in rank(self.trials) if t.candidate.name in self.handles]

    def _tidy(self, key: tuple) -> None:
        """Remove a compile's files once no candidate still to decide or kept uses them."""
        h = self.built.get(key)
        if h is None or h is REMOVED or isinstance(h, Exception) or self.users[key] > 0:
            return
        if any(_key(t.candidate) == key and t.candidate.name in self.handles for t in self.trials):
            return
        discard = getattr(self.m, "discard", None)
        if discard is not None:
            discard(h)
        self.built[key] = REMOVED

    def finish(self) -> list[Trial]:
        """Confirm the leaders, rank, and keep the files of the KEEP best only: the build's order."""
        _confirm(self.timer, self.trials, self.handles)
        _effective_rates(self.trials, self.recheck_rate)
        ranked = [t for t in rank(self.trials) if t.candidate.name in self.handles]
        for t in ranked[KEEP:]:
            self.handles.pop(t.candidate.name)
            self._tidy(_key(t.candidate))
        return ranked[:KEEP]


def _agreement(m: Measurer, trial: Trial, handle) -> Agreement | None:
    """The candidate's agreement with the FP32 graph on the calibration set, recorded in the trial
    (None, and the trial failed, when it cannot run)."""
    c = trial.candidate
    try:
        a = m.agree(handle, c)
    except Exception as e:  # noqa: BLE001 - a run failure: the next candidate
        trial.status, trial.why = "failed", f"run: {_why(e)}"
        _say(f"autotune: {c.name}: {trial.why}; skipped")
        return None
    trial.agreement, trial.tau, trial.rechecked_fraction = a.agreement, a.tau, a.rechecked_fraction
    trial.estimated_per_10k, trial.guard, trial.held = a.estimated_per_10k, a.guard, a.holds
    return a


def _judge(m: Measurer, trial: Trial, handle, handles: dict) -> None:
    """The candidate's agreement with the FP32 graph on the calibration set: holds or rejected."""
    c = trial.candidate
    a = _agreement(m, trial, handle)
    if a is None:
        return
    if not a.holds:
        trial.status, trial.why = "rejected", a.why or "does not hold the disagreement budget"
        _say(f"autotune: {c.name}: {trial.why}; skipped")
        return
    trial.status = "holds"
    handles[c.name] = handle


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


def _confirm(timer, trials: list[Trial], handles: dict) -> None:
    """The candidates that hold and keep their files (the KEEP best) timed again interleaved (A B A B ...)
    for ROUNDS rounds: each rate is the median of all its timings, so a disturbed timing, even one that
    settled a leader, does not decide the order the build verifies them in."""
    lead = [t for t in trials if t.status == "holds" and t.images_per_s and t.candidate.name in handles]
    if len(lead) >= 2:
        timer.interleave(lead, ROUNDS)


def _effective_rates(trials: list[Trial], recheck_rate: Callable[[], float | None] | None = None) -> None:
    """A guarded candidate's rate with its expected re-check cost: each image costs 1/r, plus the
    re-checked share f at the rate of the graph that runs the re-checks, r_re (IEEE FP32 at the
    re-check batch, `recheck_rate()`: the Measurer's, asked once per search; on a GPU about a tenth
    of bf16's, so each re-check costs ~10 images): 1 / (1/r + f/r_re). Without that measurement
    (None: it failed), the best FP32 candidate's rate stands in, else the candidate's own."""
    guarded = [t for t in trials if t.held and t.images_per_s and t.candidate.precision != "fp32"
               and t.rechecked_fraction]
    r_re = None
    if guarded and recheck_rate is not None:
        r_re = recheck_rate()
    if r_re is None:
        fp32 = [t.images_per_s for t in trials if t.candidate.precision == "fp32" and t.status == "holds"
                and t.images_per_s]
        r_re = max(fp32) if fp32 else None
    for t in trials:
        if t.images_per_s is None or not t.held:
            continue
        f = t.rechecked_fraction or 0.0
        if t.candidate.precision == "fp32" or f == 0.0:
            t.effective_images_per_s = t.images_per_s
        elif r_re:
            t.effective_images_per_s = 1.0 / (1.0 / t.images_per_s + f / r_re)
            t.recheck_images_per_s = r_re
        else:  # no FP32 rate measured: the re-checks are costed at the low-precision rate
            t.effective_images_per_s = t.images_per_s / (1.0 + f)


def rank(trials: list[Trial], eligible: Callable[[Trial], bool] = lambda t: t.status == "holds") -> list[Trial]:
    """The trials that hold (`eligible`), best first: the fastest by effective rate, except that a simpler
    one goes first unless the faster is faster by more than the margin (TIE plus the timings' spread)."""
    ok = [t for t in trials if eligible(t) and t.effective_images_per_s]
    ok.sort(key=lambda t: -t.effective_images_per_s)
    out: list[Trial] = []
    while ok:
        top = ok[0]
        tied = [t for t in ok if not faster(top, t, rate=lambda x: x.effective_images_per_s)]
        pick = min(tied, key=lambda t: t.candidate.complexity())
        out.append(pick)
        ok.remove(pick)
    return out


def fallback_choice(trials: list[Trial], compiled: tuple[str, ...], verify: list[dict]) -> Trial | None:
    """The build's fallback when nothing compiled, held and was verified in time: the best (as `rank`
    orders them) of the candidates that need no compile (not in `compiled`: the reference backend) and
    held their agreement in the search, guarded below fp32, leaving out any that failed its assembly or
    whose own end-to-end check counted too many disagreements (`verify`: the build's records); a
    check that could not run (the deadline, a run that failed) says nothing against the candidate.
    None when there is none: the build is then eager FP32."""
    refuted = {v["candidate"] for v in verify
               if not v.get("ok") and ("disagreements" in v or str(v.get("why", "")).startswith("assembly"))}
    picks = rank(trials, lambda t: bool(t.held) and t.candidate.backend not in compiled
                 and t.candidate.name not in refuted)
    return picks[0] if picks else None


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:200]
