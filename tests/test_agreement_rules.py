"""The contest gate's records at their edges: one row, no row, the rate of an empty gate.
Cases the agreement tool's mutation run found untested."""
from __future__ import annotations

from evaluator.contest.agreement import Agreement, ContestGate


def test_a_single_matching_row_passes_and_no_row_fails():
    assert Agreement(1, 1, 0, 0.99).passed and ContestGate(1, 1, 0, 0.99).passed
    assert not Agreement(0, 0, 0, 0.99).passed and not ContestGate(0, 0, 0, 0.99).passed


def test_the_rate_of_an_empty_gate_is_zero():
    assert Agreement(0, 0, 3, 0.99).rate == 0.0 and ContestGate(0, 0, 0, 0.99).rate == 0.0
    assert ContestGate(3, 4, 1, 0.99).rate == 0.75 and Agreement(3, 4, 1, 0.99).rate == 0.75
