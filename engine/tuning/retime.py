"""Timings that noise cannot turn into a choice: medians of interleaved timings, and a margin.

One timing of a compiled graph can be disturbed (another build on the machine, a clock boost,
a page fault storm). So the search never decides on one timing between candidates within
reach of each other (RETIME, 15 %): a candidate that close to the leader is timed again
interleaved with it, A B A B ..., at least ROUNDS rounds (more, up to MAX_ROUNDS, while the
timings of either spread over more than STEADY), and each rate is the median of all its timings. A candidate replaces a simpler one only when its median is faster by more than
TIE plus the spread of their timings (the larger relative median absolute deviation of the
two); within that, the simpler one stays. A candidate more than RETIME under the leader may
still be pruned on its first timing (the leader's own rate is a median of at least SETTLED
timings by then).
"""
from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

from engine.presets import shared

TIE = shared("retime_tie")                # medians within 5 % (plus the timings' spread) are a tie: the simpler candidate wins
RETIME = shared("retime_window")          # candidates within 15 % of the leader are timed again, interleaved with it
ROUNDS = shared("retime_rounds")          # interleaved rounds (A B) of such a retiming, at least
MAX_ROUNDS = shared("retime_max_rounds")  # ... and more, up to this many, while a trial's timings spread over more than STEADY
STEADY = shared("retime_steady")          # relative median absolute deviation of a trial's timings that counts as steady
SETTLED = shared("retime_settled")        # timings of the leader before a candidate is pruned against it


def spread(timings: list[float]) -> float:
    """Relative median absolute deviation of the timings (0 for fewer than two)."""
    if len(timings) < 2:
        return 0.0
    med = statistics.median(timings)
    return statistics.median(abs(x - med) for x in timings) / med if med else 0.0


def margin(a, b) -> float:
    """The relative margin by which one of trials `a`, `b` must be faster to count as faster."""
    return TIE + max(spread(a.timings), spread(b.timings))


def faster(a, b, rate: Callable = lambda t: t.images_per_s) -> bool:
    """Whether trial `a` is faster than trial `b` beyond the margin (on medians)."""
    return rate(a) > rate(b) * (1 + margin(a, b))


class Timer:
    """Times trials through the measurer, each timing appended to the trial's `timings` and its rate
    the median; `left()` says how much time the search has, a round starts only when it fits."""

    def __init__(self, m, handle_of: Callable, clock: Callable[[], float], left: Callable[[], float]):
        self.m, self.handle_of, self.clock, self.left = m, handle_of, clock, left
        self.cost = 0.0     # the longest single timing so far, seconds

    def once(self, trial) -> float:
        """One timing of `trial` (raises what the measurer raises)."""
        t = self.clock()
        r = self.m.time(self.handle_of(trial), trial.candidate)
        self.cost = max(self.cost, self.clock() - t)
        trial.timings.append(r)
        trial.images_per_s = statistics.median(trial.timings)
        return r

    def again(self, trial) -> bool:
        """One more timing of a trial that ran before; a failure is one line and keeps its timings."""
        try:
            self.once(trial)
            return True
        except Exception as e:  # noqa: BLE001 - it ran before: say so and keep the earlier timings
            print(f"engine.build: autotune: {trial.candidate.name}: timing again failed "
                  f"({type(e).__name__}: {e})"[:300], file=sys.stderr, flush=True)
            return False

    def room(self, timings: int) -> bool:
        return self.left() > self.cost * timings

    def settle(self, trial) -> None:
        """Time `trial` until it has SETTLED timings (while the budget allows)."""
        while len(trial.timings) < SETTLED and self.room(1) and self.again(trial):
            pass

    def interleave(self, trials: list, rounds: int = ROUNDS) -> int:
        """At least `rounds` rounds of one timing each, in turn (A B A B ...), more (up to MAX_ROUNDS)
        while one of the trials' timings is not steady; returns the rounds run."""
        done = 0
        while done < rounds or (done < MAX_ROUNDS and any(spread(t.timings) > STEADY for t in trials)):
            if not self.room(len(trials)):
                break
            for t in trials:
                self.again(t)
            done += 1
        return done
