"""The search's candidate loop (engine.autotune.search): each candidate compiled when its estimate
fits the time and the disk left, timed, retimed against the leader when within reach, judged,
and its files removed as soon as it loses.

Rules, in the order a candidate meets them:
- a backend whose compile failed for a reason of the machine (engine.compile_failures) is
  dropped after that one failure: its other candidates are rows saying so, never compiled;
- a compile starts only when FIT x its estimate (the longest compile so far, or the first
  estimate) is left of the search's time, and the disk has what one compile needs;
- the first timing: when it and one more are both more than RETIME under the leader (a median
  of SETTLED timings), the candidate is slower and its agreement is not measured; within RETIME of the leader, both
  are timed again interleaved, and it is slower only when the leader's median beats its own by
  more than the margin (engine.autotune_retime);
- files go as soon as a candidate loses: slower, rejected, failed, or ranked beyond the KEEP
  that the build may verify.
"""
from __future__ import annotations

import collections
import sys

from engine import autotune as at
from engine.autotune_retime import RETIME, Timer, faster, margin
from engine.compile_failures import environmental

FIT = 1.5           # a compile starts when 1.5 x its estimate is left: the compile, its timings and agreement
REMOVED = "removed"  # built[key] once a compile's files are gone


def _key(c: at.Candidate) -> tuple:
    """The compile a candidate uses: CUDA graphs on and off share one."""
    return (c.precision, c.batch_size, c.backend, c.options)


def _say(msg: str) -> None:
    print(f"engine.build: autotune: {msg}", file=sys.stderr, flush=True)


class Run:
    """The state of one search's candidate loop."""

    def __init__(self, m, cfg, clock, deadline, disk, trials: list, cands: list):
        self.m, self.cfg, self.clock, self.deadline, self.disk = m, cfg, clock, deadline, disk
        self.trials = trials
        self.handles: dict = {}                  # candidate name -> handle, for the ones that hold and keep files
        self.built: dict = {}                    # compile key -> handle | exception | REMOVED
        self.users = collections.Counter(_key(c) for c in cands)   # candidates of each compile still to decide
        self.dropped: dict[str, str] = {}        # backend -> why it was dropped
        self.compile_cost = cfg.compile_estimate_s   # the first estimate, then the longest compile measured
        self.compile_measured = False
        self.timer = Timer(m, lambda t: self.built[_key(t.candidate)], clock, deadline.left)

    def candidate(self, c: at.Candidate, screened: float, pruned: str) -> None:
        trial = at.Trial(c, screened_images_per_s=screened)
        self.trials.append(trial)
        t = self.clock()
        try:
            self._decide(trial, pruned)
        finally:
            trial.seconds = self.clock() - t if trial.status != "not compiled" else 0.0
            self.users[_key(c)] -= 1
            self._tidy(_key(c))

    def _decide(self, trial: at.Trial, pruned: str) -> None:
        c = trial.candidate
        if pruned:
            trial.status, trial.why = "not compiled", pruned
            return
        if c.backend in self.dropped:
            trial.status, trial.why = "not compiled", f"backend {c.backend} dropped: {self.dropped[c.backend]}"
            return
        if self.deadline.left() <= 0:
            trial.status, trial.why = "not compiled", f"{self.deadline.why_spent()} is spent"
            return
        key = _key(c)
        if key not in self.built and not self._compile(trial):
            return
        handle = self.built[key]
        if isinstance(handle, Exception):
            trial.status, trial.why = "failed", f"build: {at._why(handle)}"
            _say(f"{c.name}: {trial.why}; skipped")
            return
        try:
            self.timer.once(trial)
        except Exception as e:  # noqa: BLE001 - capture or run failure: the next candidate
            trial.status, trial.why = "failed", f"run: {at._why(e)}"
            _say(f"{c.name}: {trial.why}; skipped")
            return
        if self._slower(trial):
            return
        at._judge(self.m, trial, handle, self.handles)
        if trial.status == "holds":
            self._keep_best()

    def _compile(self, trial: at.Trial) -> bool:
        """Compile the trial's candidate when its estimate fits the time and the disk: False (and the
        trial's row says why) when it does not; a failure is kept in `built` as the exception."""
        c = trial.candidate
        compiles = c.backend in self.cfg.compiled
        left = self.deadline.left()
        if compiles and left < FIT * self.compile_cost:
            trial.status = "not compiled"
            trial.why = (f"{left:.0f} s {self.deadline.what_left()} left, a compile takes about "
                         f"{self.compile_cost:.0f} s")
            return False
        why = self.disk.fits() if self.disk is not None else None
        if why:
            trial.status, trial.why = "not compiled", f"disk: {why}"
            _say(f"{c.name}: not compiled: {why}")
            return False
        t = self.clock()
        if self.disk is not None:
            self.disk.before()
        try:
            self.built[_key(c)] = self.m.compile(c)
        except Exception as e:  # noqa: BLE001 - a candidate that cannot build is skipped with its reason
            self.built[_key(c)] = e
            reason = environmental(e)
            if reason:
                self.dropped[c.backend] = reason
                _say(f"backend {c.backend} dropped: {reason}; its other candidates are not compiled")
        finally:
            if self.disk is not None:
                self.disk.after()
        if compiles:
            spent = self.clock() - t
            self.compile_cost = max(self.compile_cost, spent) if self.compile_measured else spent
            self.compile_measured = True
            self.deadline.compiled(spent)
        return True

    def _lead(self) -> at.Trial | None:
        """The fastest that holds with an exact rate (nothing re-checked) and still has its files."""
        return max((t for t in self.trials if t.status == "holds" and t.images_per_s and not t.rechecked_fraction
                    and t.candidate.name in self.handles), default=None, key=lambda t: t.images_per_s)

    def _slower(self, trial: at.Trial) -> bool:
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
        """Only the KEEP best that hold keep their files (the build verifies no more)."""
        at._effective_rates(self.trials)
        for t in [t for t in at.rank(self.trials) if t.candidate.name in self.handles][at.KEEP:]:
            self.handles.pop(t.candidate.name)
            self._tidy(_key(t.candidate))

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

    def finish(self) -> list[at.Trial]:
        """Confirm the leaders, rank, and keep the files of the KEEP best only: the build's order."""
        at._confirm(self.timer, self.trials, self.handles)
        at._effective_rates(self.trials)
        ranked = [t for t in at.rank(self.trials) if t.candidate.name in self.handles]
        for t in ranked[at.KEEP:]:
            self.handles.pop(t.candidate.name)
            self._tidy(_key(t.candidate))
        return ranked[:at.KEEP]
