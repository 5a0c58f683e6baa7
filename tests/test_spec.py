"""engine.core.spec: the one record that decides preprocessing, resolved offline from timm's pretrained cfg."""
from __future__ import annotations

import dataclasses
import json

import pytest

from engine.core.spec import Spec, resolve_spec

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
L448 = "eva02_large_patch14_448"


@pytest.mark.parametrize("model, size, crop_mode", [
    (f"{L448}.mim_m38m_ft_in22k_in1k", 448, "squash"),
    (f"{L448}.mim_in22k_ft_in22k_in1k", 448, "squash"),
    (f"{L448}.mim_in22k_ft_in1k", 448, "center"),
    ("eva02_tiny_patch14_336.mim_in22k_ft_in1k", 336, "center"),
])
def test_resolve_from_timm_pretrained_cfg(model, size, crop_mode, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    s = resolve_spec(model)
    assert s.model == model
    assert s.input_size == size
    assert s.crop_mode == crop_mode
    assert s.crop_pct == 1.0
    assert s.interpolation == "bicubic"
    assert s.mean == pytest.approx(CLIP_MEAN) and s.std == pytest.approx(CLIP_STD)
    assert isinstance(s.mean, tuple) and isinstance(s.std, tuple)
    assert s.num_classes == 1000
    assert (s.precision, s.model_kwargs) == ("fp32", {})
    assert s.scale_size == size  # crop_pct 1.0: no resize margin
    assert s.arch == model.split(".", 1)[0]


OVERRIDES = {
    "input_size": 224,
    "crop_mode": "center",
    "crop_pct": 0.875,
    "interpolation": "bilinear",
    "mean": (0.5, 0.5, 0.5),
    "std": (0.25, 0.25, 0.25),
    "precision": "bf16",
    "batch_size": 7,
    "num_classes": 10,
    "model_kwargs": {"depth": 2},
}


def test_every_field_is_overridable():
    # the override set must cover every field except the name itself
    assert set(OVERRIDES) == {f.name for f in dataclasses.fields(Spec)} - {"model"}
    s = resolve_spec(f"{L448}.mim_m38m_ft_in22k_in1k", **OVERRIDES)
    for k, v in OVERRIDES.items():
        assert getattr(s, k) == v, k
    assert s.scale_size == 256  # floor(224 / 0.875)


@pytest.mark.parametrize("field_name", sorted(OVERRIDES))
def test_single_override_leaves_the_rest(field_name):
    base = resolve_spec(f"{L448}.mim_m38m_ft_in22k_in1k")
    s = resolve_spec(f"{L448}.mim_m38m_ft_in22k_in1k", **{field_name: OVERRIDES[field_name]})
    assert getattr(s, field_name) == OVERRIDES[field_name]
    assert s == dataclasses.replace(base, **{field_name: OVERRIDES[field_name]})


def test_overrides_given_as_lists_become_tuples():
    s = resolve_spec(f"{L448}.mim_m38m_ft_in22k_in1k", mean=[0.1, 0.2, 0.3], std=[1, 1, 1])
    assert s.mean == (0.1, 0.2, 0.3) and s.std == (1.0, 1.0, 1.0)


def test_none_overrides_are_ignored():
    name = f"{L448}.mim_m38m_ft_in22k_in1k"
    nones = {k: None for k in OVERRIDES}
    assert resolve_spec(name, **nones) == resolve_spec(name)


@pytest.mark.parametrize("field_name, value", [
    ("crop_mode", "border"),
    ("crop_mode", "Center"),
    ("precision", "int4"),
    ("precision", "float32"),
    ("crop_pct", 0.0),
    ("crop_pct", -0.5),
    ("crop_pct", 1.01),
    ("crop_pct", float("nan")),
    ("interpolation", "lanczos"),
    ("input_size", 0),
    ("batch_size", -1),
])
def test_invalid_values_raise_naming_the_field(field_name, value):
    with pytest.raises(ValueError, match=field_name):
        resolve_spec(f"{L448}.mim_m38m_ft_in22k_in1k", **{field_name: value})
    with pytest.raises(ValueError, match=field_name):
        Spec(**{"model": "m", "input_size": 224, field_name: value})


def test_dict_round_trip():
    s = resolve_spec(f"{L448}.mim_in22k_ft_in1k", **OVERRIDES)
    d = s.to_dict()
    assert isinstance(d["mean"], list) and isinstance(d["std"], list)
    assert Spec.from_dict(d) == s
    assert Spec.from_dict(json.loads(s.to_json())) == s  # through JSON, as in the manifest
    assert json.loads(s.to_json()) == d
    d["model_kwargs"]["depth"] = 99  # a deep copy: callers may mutate it
    assert s.model_kwargs == {"depth": 2}


def test_from_dict_rejects_unknown_fields():
    d = resolve_spec(f"{L448}.mim_m38m_ft_in22k_in1k").to_dict()
    d["resize_mode"] = "shorter"
    d["zz_extra"] = 1
    with pytest.raises(ValueError, match=r"unknown spec fields.*resize_mode.*zz_extra"):
        Spec.from_dict(d)


def test_from_dict_does_not_mutate_its_input():
    d = resolve_spec(f"{L448}.mim_m38m_ft_in22k_in1k").to_dict()
    before = json.dumps(d, sort_keys=True)
    Spec.from_dict(d)
    assert json.dumps(d, sort_keys=True) == before


def test_unknown_model_needs_input_size():
    with pytest.raises(ValueError, match="no pretrained cfg.*not_a_timm_model"):
        resolve_spec("not_a_timm_model")
    s = resolve_spec("not_a_timm_model", input_size=64, crop_mode="squash")
    assert (s.input_size, s.crop_mode, s.crop_pct) == (64, "squash", 1.0)


def test_arch_without_tag_uses_default_cfg():
    s = resolve_spec("eva02_tiny_patch14_224")
    assert (s.input_size, s.crop_mode, s.crop_pct) == (224, "center", 0.9)
    assert s.scale_size == 248  # floor(224 / 0.9), as timm computes it
    assert s.num_classes == 1000  # the MIM cfg says 0 classes; the classifier spec keeps 1000


def test_unknown_tag_falls_back_to_the_architecture_cfg():
    # documented in resolve_spec: "Unknown tags fall back to the architecture's default cfg"
    s = resolve_spec(f"{L448}.some_private_finetune")
    assert s.model == f"{L448}.some_private_finetune"
    assert (s.input_size, s.crop_mode, s.crop_pct) == (448, "squash", 1.0)
