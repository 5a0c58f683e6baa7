"""How many calibration images (engine.tuning.calibration_trade): the count with the least calibration
time plus a run's expected re-check time, from a pilot, capped; the tail bound that makes it worth it
(engine.tuning.calibrate.choose_tau's `confidence`)."""
from __future__ import annotations

import numpy as np
import pytest

from engine.presets import preset
from engine.tuning import calibration_trade as trade
from engine.tuning.calibrate import TauRule, choose_tau


def _pilot(n: int = 256, seed: int = 0) -> trade.Pilot:
    """n photo-like margins (exponential) and small rounding errors, no raw disagreement."""
    rng = np.random.default_rng(seed)
    margins = rng.exponential(1.0, n).astype(np.float32)
    low = np.arange(n)
    return trade.Pilot(low, margins, low.copy(), (margins + np.abs(rng.normal(0, 0.03, n))).astype(np.float32))


def _rule(device: str = "cpu") -> TauRule:
    pre = preset(device)
    return TauRule(pre.guard_budget, pre.guard_safety, pre.guard_confidence)


def _count(pilot, rates, run_images, cap, device="cpu", **kw) -> dict:
    return trade.choose_count(pilot, rates, trade.Trade(run_images, cap, _rule(device), **kw))


def test_the_tail_bound_tightens_with_the_sample_and_tau_with_it():
    p = _pilot(256)
    args = (p.low_top1, p.low_margins, p.ref_top1, p.ref_margins)
    point = choose_tau(*args, TauRule(10.0, 2.0))
    taus = [choose_tau(*args, TauRule(10.0, 2.0, 0.95), bound_images=n)["tau"] for n in (256, 1024, 4096, 10 ** 6)]
    assert taus == sorted(taus, reverse=True) and taus[0] > taus[-1]        # more images, smaller tau
    assert taus[-1] == pytest.approx(point["tau"], rel=0.05)                 # the bound closes on the estimate
    g = choose_tau(*args, TauRule(10.0, 2.0, 0.95))
    assert g["tau"] == taus[0] and g["margin_error"]["tail"]["scale_factor"] > 1.3


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_count_is_the_least_calibration_plus_recheck_time(device):
    p = _pilot()
    rates = trade.Rates(fp32_s=0.02, low_s=0.002, recheck_s=0.015)     # fake seconds per image
    t = _count(p, rates, 10_000, 4096, device)
    rows = t["table"]
    assert rows[0]["count"] == len(p) and rows[-1]["count"] == 4096
    for r in rows:   # each row's times follow from the rates and its projected fraction
        assert r["calibration_s"] == pytest.approx(r["count"] * 0.022, rel=1e-3)
        assert r["recheck_s"] == pytest.approx(10_000 * r["rechecked_fraction"] * 0.015, rel=1e-3, abs=1e-3)
    best = min(rows, key=lambda r: r["total_s"])
    assert t["count"] == best["count"] and t["tau"] == best["tau"]
    assert t["rechecked_fraction"] == best["rechecked_fraction"]
    fractions = [r["rechecked_fraction"] for r in rows]
    assert fractions == sorted(fractions, reverse=True) and fractions[0] > fractions[-1]


def test_cheaper_calibration_or_a_longer_run_takes_more_images_and_a_cap_binds():
    p = _pilot()
    slow, cheap = trade.Rates(0.2, 0.05, 0.015), trade.Rates(0.0005, 0.0001, 0.015)
    assert _count(p, slow, 10_000, 4096)["count"] == len(p)        # the pilot is enough
    fast = _count(p, cheap, 10_000, 4096)["count"]
    longer = _count(p, slow, 10 ** 8, 4096)["count"]
    assert fast > len(p) and longer > len(p)
    assert _count(p, cheap, 0, 4096)["count"] == len(p)            # no run: nothing to save
    capped = _count(p, cheap, 10_000, 300, cap_why="share")
    assert capped["count"] <= 300 and capped["cap"] == 300 and capped["cap_why"] == "share"
    with pytest.raises(ValueError):
        _count(p, trade.Rates(-1, 0, 0), 10, 300)


@pytest.mark.abi   # slow: a measured build of the tiny model
def test_an_auto_build_traded_its_count_and_the_manifest_records_the_trade(tmp_path, tiny_checkpoint, monkeypatch):
    import dataclasses
    import json

    from conftest import tiny_spec

    from engine import presets
    from engine.tuning import AutoConfig, GuardConfig, build
    from engine.tuning import auto as build_auto

    # a pilot of 16 renders, at most 48: the trade's whole range fits a test
    monkeypatch.setitem(presets.PRESETS, "cpu", dataclasses.replace(presets.PRESETS["cpu"], calibration_count=16,
                                                                    calibration_max_images=48, verify_images=16))
    monkeypatch.setattr(build_auto, "verify_artifact", lambda *a, **k: {"ok": True, "images": 16, "agreement": 1.0})
    # a projection that falls with the count (16 renders re-check none): the trade reads further
    real = trade.projected
    monkeypatch.setattr(trade, "projected", lambda p, n, *a: {**real(p, n, *a), "rechecked_fraction": 16 / n})
    meta = build(tiny_spec("squash", 16), tiny_checkpoint, tmp_path / "art", backend="eager", device="cpu",
                 guard=GuardConfig(calibration_source="renders", run_images=10 ** 9),
                 auto=AutoConfig(precisions=("bf16",), batch_size=False, backend=False, budget_s=20))
    t = meta["build"]["calibration"]
    assert t["precision"] == "bf16" and t["pilot"] == 16 and t["run_images"] == 10 ** 9 and t["cap"] <= 48
    assert {"count", "tau", "rechecked_fraction", "calibration_s", "recheck_s", "seconds_per_image"} <= set(t)
    assert all(v > 0 for v in t["seconds_per_image"].values())                        # measured here
    assert t["count"] == min(t["table"], key=lambda r: r["total_s"])["count"] == 48     # a run of 10^9 images
    # the images the search and the guard used are the count traded, read on from the pilot's stream
    search = meta["build"]["search"]["calibration"]
    assert search["count"] == t["taken"] == 48 and search["asked"] == 48 and search["pilot"] == 16
    on_disk = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert on_disk["build"]["calibration"]["count"] == t["count"]
