"""One deadline for the whole measured build, spent phase by phase.

The build's phases run one after the other: the checkpoint load, the calibration reference
(the FP32 graph on the calibration images), the search (engine.tuning.autotune), the guard's FP32
re-check graph (a second compile, below FP32), the end-to-end verification. A `BuildClock`
holds the deadline, the plan (estimated seconds per phase, printed first and recorded), what
each phase measured (printed last and recorded), and `left()`. The search spends what is left
once the phases after it are reserved at their estimates, and those estimates learn from what
was measured (the longest compile so far stands for the re-check graph's compile, the longest
verification for the next one). Every clock is injectable, so tests run on a fake one.

Each phase is cut to what it has. The calibration reference takes as many calibration images as fit
its `allowance` at the rate its first batch measured (engine.tuning.reference); the search screens and
compiles only what fits what it has left (engine.tuning.autotune); a candidate is assembled and
verified only while its estimate fits, and the end-to-end check's child gets what is left as its
timeout (engine.tuning.auto). What no clock can cut is a step already started: the checkpoint load,
the calibration's first batch (the guard's minimum, calibrate.MIN_IMAGES, through the FP32 reference
and the decoder's check), one screen call, one compile or one verification that outruns its estimate.
So the build ends within the deadline, counted from this clock's start (after the process's imports),
plus that slack: one such step, then the eager FP32 fallback's assembly (its weights written:
seconds) where nothing was verified in time, and the process's exit. On a machine as planned the
slack is at most the slowest phase's estimate (the preset's `compile_estimate_s`, 120 s on the CPU);
a tiny model's build beside two busy loops on two cores ends within 20 s of a 15 s deadline
(tests/test_build_deadline_loaded.py).
"""
from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

PHASES = ("checkpoint", "calibration", "search", "recheck", "verify")
# the longest deadline or wait the build keeps (30 days, engine.cli.MAX_DEADLINE_S): a longer one is cut
# to it, as a timeout past ~292 years overflows subprocess's and threading's nanosecond clocks
MAX_WAIT_S = 30 * 86400.0


def bounded_s(seconds: float) -> float:
    """`seconds` as a timeout subprocess and threading take: cut to [0, MAX_WAIT_S]; nan is a ValueError."""
    seconds = float(seconds)
    if seconds != seconds:
        raise ValueError("a deadline or timeout of nan seconds")
    return min(max(seconds, 0.0), MAX_WAIT_S)


class BuildClock:
    """The deadline (seconds from construction), the plan and the actuals of the build's phases."""

    def __init__(self, deadline_s: float, estimates: dict[str, float], clock: Callable[[], float] = time.monotonic):
        # negative is kept (a deadline already past), nan refused, inf and past MAX_WAIT_S cut to it
        self.deadline_s, self.clock = min(float(deadline_s), MAX_WAIT_S), clock
        if self.deadline_s != self.deadline_s:
            raise ValueError("the build's deadline is nan seconds")
        self.t0 = clock()
        self.plan = {p: float(estimates.get(p, 0.0)) for p in PHASES}   # as first planned: never changed
        self.estimate = dict(self.plan)                                 # learns from what was measured
        self.actual: dict[str, float] = {}
        self.measured: set[str] = set()                                 # phases whose estimate was measured
        self.notes: list[str] = []                                      # what the deadline cut, one line each

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float:
        """Seconds to the deadline (negative past it)."""
        return self.deadline_s - self.elapsed()

    def left_after(self, *phases: str) -> float:
        """Seconds left once `phases` (still to come) are reserved at their estimates."""
        return self.left() - sum(self.estimate[p] for p in phases)

    def allowance(self, phase: str, after: tuple[str, ...] = (), search_cap: float = 0.0) -> float:
        """Seconds `phase` may spend from now: its planned share of the deadline (its estimate, scaled
        down as every fixed phase's when the plan's fixed phases overrun the deadline), or more where the
        search could not use it anyway (what is left once `after` is reserved at its estimates and the
        search at its cap `search_cap`); never more than what is left."""
        fixed = sum(s for p, s in self.plan.items() if p != "search")
        planned = self.plan[phase] * min(1.0, self.deadline_s / fixed) if fixed > 0 else 0.0
        spare = self.left_after(*after) - search_cap
        return max(0.0, min(self.left(), max(planned, spare)))

    def fits(self, phase: str) -> bool:
        """Whether one more `phase` fits before the deadline at its estimate."""
        return self.left() >= self.estimate[phase]

    def learn(self, phase: str, seconds: float) -> None:
        """A measured `phase` (or a stand-in for it): its estimate becomes the longest so far."""
        self.estimate[phase] = max(self.estimate[phase], seconds) if phase in self.measured else seconds
        self.measured.add(phase)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as `name` (added up when a phase runs more than once)."""
        t = self.clock()
        try:
            yield
        finally:
            spent = self.clock() - t
            self.learn(name, spent)
            self.actual[name] = self.actual.get(name, 0.0) + spent

    def note(self, line: str) -> None:
        self.notes.append(line)
        say(f"deadline: {line}")

    def plan_line(self) -> str:
        return (f"deadline {self.deadline_s:.0f} s; plan: "
                + ", ".join(f"{p} {s:.0f} s" for p, s in self.plan.items() if p != "search")
                + f", search what they leave (about {self.deadline_s - sum(self.plan.values()):.0f} s)")

    def actual_line(self) -> str:
        spent = ", ".join(f"{p} {s:.0f} s" for p, s in self.actual.items())
        return f"spent {self.elapsed():.0f} s of {self.deadline_s:.0f} s ({spent or 'nothing measured'}); " \
               f"{self.left():.0f} s left"

    def record(self) -> dict:
        """What the manifest keeps: the deadline, the plan, the actuals, and what the deadline cut."""
        return {"deadline_s": round(self.deadline_s, 1), "plan_s": {p: round(s, 1) for p, s in self.plan.items()},
                "actual_s": {p: round(s, 2) for p, s in self.actual.items()}, "elapsed_s": round(self.elapsed(), 2),
                "left_s": round(self.left(), 2), "cut": list(self.notes)}


class SearchDeadline:
    """The search's side of the clock: its own budget (the preset's cap) and the build's deadline,
    less the phases that come after it; compiles measured in the search teach the re-check estimate."""

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.perf_counter,
                 build: BuildClock | None = None, after: tuple[str, ...] = ()):
        self.budget_s, self.clock, self.build, self.after = budget_s, clock, build, after
        self.t0 = clock()

    def left(self) -> float:
        own = self.budget_s - (self.clock() - self.t0)
        return own if self.build is None else min(own, self.build.left_after(*self.after))

    def compiled(self, seconds: float) -> None:
        """A compile took `seconds`: the re-check graph's compile is estimated at the longest one."""
        if self.build is not None and "recheck" in self.after:
            self.build.learn("recheck", seconds)

    def _by_deadline(self) -> bool:
        return self.build is not None and self.left() < self.budget_s - (self.clock() - self.t0)

    def what_left(self) -> str:
        """What limits the search now, as "N s {what_left()} left" reads it."""
        if self._by_deadline():
            return f"before the build's deadline ({' + '.join(self.after) or 'nothing'} reserved)"
        return "of the search budget"

    def why_spent(self) -> str:
        if self._by_deadline():
            return (f"the time before the build's deadline ({self.build.left():.0f} s left, "
                    f"{' + '.join(self.after) or 'nothing'} reserved)")
        return f"the search budget of {self.budget_s:.0f} s"


def say(msg: str) -> None:
    print(f"engine.build: {msg}", file=sys.stderr, flush=True)
