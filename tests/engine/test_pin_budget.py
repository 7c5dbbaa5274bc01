"""The pin budget (engine_service/core/pin_budget.py): the pool minus the running requests'
peak demand over a window, between a floor and a ceiling, against a brute-force reference on
seeded random demand sequences; reported only on moves worth telling."""

from __future__ import annotations

import random

import pytest

from engine_service.core.pin_budget import PinBudget, PinBudgetConfig


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def reference_peak(history: list[tuple[float, int]], now: float, window_s: float) -> int:
    """history: (when set, demand) in order, the last one in effect now. A demand counts while
    it was in effect at some time after now - window_s."""
    peak = history[-1][1]
    for (_, demand), (superseded, _) in zip(history, history[1:], strict=False):
        if superseded > now - window_s:
            peak = max(peak, demand)
    return peak


@pytest.mark.parametrize("seed", range(8))
def test_budget_matches_the_reference_on_random_demand(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([16, 64, 100, 1000, 4096])
    config = PinBudgetConfig(floor_fraction=rng.choice([0.0, 0.1, 0.2]),
                             ceiling_fraction=rng.choice([0.3, 0.5, 1.0]),
                             window_s=rng.choice([0.0, 1.0, 5.0, 30.0]))
    clock = FakeClock()
    budget = PinBudget(num_blocks, config, clock)
    history = [(0.0, 0)]
    for _ in range(2000):
        clock.now += rng.choice([0.0, 0.01, 0.3, 1.0, rng.expovariate(0.2)])
        if rng.random() < 0.8:
            demand = rng.randrange(0, num_blocks + 1)
            if demand != history[-1][1]:
                history.append((clock.now, demand))
            got = budget.observe(demand)
        else:
            got = budget.refresh()  # time alone passed
        peak = reference_peak(history, clock.now, config.window_s)
        assert budget.peak_demand == peak
        assert got == budget.blocks == min(budget.ceiling, max(budget.floor, num_blocks - peak))
        assert budget.floor <= got <= budget.ceiling
        reported = budget.report()
        assert reported in (None, got)
        # Between reports the budget is within the hysteresis of the last one reported, and
        # a budget at the floor or the ceiling is always reported exactly.
        assert abs(got - budget.reported) < budget.hysteresis or reported == got
        if got in (budget.floor, budget.ceiling):
            assert budget.reported == got


def test_a_burst_shrinks_the_budget_at_once_and_it_grows_back_after_the_window():
    clock = FakeClock()
    budget = PinBudget(100, PinBudgetConfig(0.1, 0.5, window_s=30.0), clock)
    assert (budget.floor, budget.ceiling, budget.blocks) == (10, 50, 50)
    assert budget.observe(25) == 50  # 75 spare, capped at the ceiling
    assert budget.observe(80) == 20  # the burst
    clock.now = 1.0
    assert budget.observe(95) == 10  # past the pool's spare room: the floor
    clock.now = 2.0
    assert budget.observe(25) == 10  # the burst ended; its peak holds for 30 s
    clock.now = 30.5
    assert budget.refresh() == 10  # 95 was in effect until t=2
    clock.now = 32.0
    assert budget.refresh() == 50  # both aged out: back to the ceiling
    assert budget.peak_demand == 25


def test_one_request_at_a_time_keeps_the_ceiling():
    """The issue's small pool: 64 blocks, 25-block requests one at a time: 39 blocks spare,
    so the whole ceiling (32) is the budget, where the fixed 10% gave 6."""
    clock = FakeClock()
    budget = PinBudget(64, clock=clock)
    fixed = PinBudget(64, PinBudgetConfig.fixed(0.1), clock)
    for step in range(40):
        clock.now = step * 0.5
        assert budget.observe(25 if step % 2 else 0) == 32
        assert fixed.observe(25 if step % 2 else 0) == 6


def test_reports_skip_small_moves():
    clock = FakeClock()
    budget = PinBudget(1000, PinBudgetConfig(0.1, 0.5, window_s=0.0,
                                             hysteresis_fraction=0.02), clock)
    assert budget.hysteresis == 20
    assert budget.report() == 500  # the first one always
    assert budget.report() is None
    budget.observe(510)  # 490: a move of 10
    assert budget.report() is None
    budget.observe(525)  # 475: 25 from the last report
    assert budget.report() == 475
    budget.observe(895)  # 105: reported (far)
    assert budget.report() == 105
    budget.observe(900)  # 100 = the floor: reported though it moved 5
    assert budget.report() == 100
    budget.forget_report()
    assert budget.report() == 100


@pytest.mark.parametrize("kwargs, field", [
    (dict(floor_fraction=-0.1), "floor_fraction"),
    (dict(ceiling_fraction=1.5), "ceiling_fraction"),
    (dict(floor_fraction=0.6, ceiling_fraction=0.5), "floor_fraction (0.6)"),
    (dict(window_s=float("inf")), "window_s"),
    (dict(window_s=-1), "window_s"),
    (dict(hysteresis_fraction=True), "hysteresis_fraction"),
])
def test_bad_settings_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        PinBudgetConfig(**kwargs)


def test_bad_demand_is_refused():
    with pytest.raises(ValueError, match="demand_blocks must be >= 0, got -1"):
        PinBudget(10).observe(-1)
    with pytest.raises(ValueError, match="num_blocks"):
        PinBudget(-3)
