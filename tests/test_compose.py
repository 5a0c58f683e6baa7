"""Composition methods: slerp against the scalar formula, endpoints, fallbacks, prompts, presets."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.retrieval.compose import METHODS, Method, compose, make_method, prompt_text, slerp, text_weight


def _unit(n, d=16, seed=0):
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), dim=-1)


def test_slerp_matches_scalar_formula():
    a, b = _unit(6, seed=1), _unit(6, seed=2)
    t = torch.tensor([0.0, 0.1, 0.5, 0.8, 0.9, 1.0], dtype=torch.float64)
    got = slerp(a, b, t)
    for i in range(6):
        th = math.acos(float(a[i] @ b[i]))
        want = (math.sin((1 - t[i]) * th) * a[i] + math.sin(t[i] * th) * b[i]) / math.sin(th)
        torch.testing.assert_close(got[i], want / want.norm())
        # the result sits at fraction t of the arc from a to b
        assert math.isclose(math.acos(min(1.0, float(got[i] @ a[i]))), float(t[i]) * th, abs_tol=1e-6)
    torch.testing.assert_close(got[0], a[0])
    torch.testing.assert_close(got[-1], b[-1])


def test_slerp_degenerate_angles_fall_back_to_lerp():
    a = _unit(2)
    out = slerp(a, torch.stack([a[0], -a[1]]), torch.tensor([0.3, 0.3], dtype=torch.float64))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], a[0])                     # identical rows: stays put
    torch.testing.assert_close(out[1], a[1])                     # antipodal: normalised lerp, finite


def test_compose_methods_and_missing_reference():
    img, txt = _unit(4, seed=3), _unit(4, seed=4)
    w = torch.full((4,), 0.5, dtype=torch.float64)
    has = torch.tensor([True, True, False, True])
    for name in METHODS:
        q = compose(make_method(name), img, has, txt, w)
        torch.testing.assert_close(q.norm(dim=-1), torch.ones(4, dtype=torch.float64))
        torch.testing.assert_close(q[2], txt[2])                 # no reference image: the text alone
    torch.testing.assert_close(compose(make_method("text-only"), img, has, txt, w), txt)
    s = compose(make_method("sum"), img, has, txt, w)
    torch.testing.assert_close(s[0], F.normalize(img[0] + txt[0], dim=-1))


def test_presets_weights_and_prompts():
    m = make_method()
    assert (m.name, m.weight_concept, m.weight_plain, m.prompt) == ("slerp", 0.8, 0.9, "auto")
    assert text_weight(m, "a dog") == 0.8 and text_weight(m, None) == 0.9
    assert make_method("sum").weight_plain == 0.5
    assert make_method("slerp", text_weight=0.7).weight_concept == 0.7
    assert prompt_text(m, "make it red", "a dog") == "find a dog but make it red"   # MagicLens template
    assert prompt_text(m, "make it red", None) == "make it red"
    assert prompt_text(make_method(prompt="plain"), "make it red", "a dog") == "make it red"
    custom = make_method(prompt="{shared_concept}, {modification}")
    assert prompt_text(custom, "red", "a dog") == "a dog, red"
    assert prompt_text(custom, "red", None) == "red"            # the template needs a concept it lacks
    assert Method(**m.to_dict()) == m


@pytest.mark.parametrize("bad", [dict(name="mean"), dict(weight_plain=1.5), dict(prompt="no placeholder")])
def test_invalid_methods_are_refused(bad):
    with pytest.raises(ValueError):
        Method(**bad)
