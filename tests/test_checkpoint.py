"""engine.core.checkpoint: local weights only, every format and wrapper, errors that name what differs."""
from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import pytest
import torch
from conftest import tiny_spec
from safetensors.torch import save_file

from engine.core.checkpoint import (
    CheckpointError,
    create_model,
    filter_state_dict,
    load_model,
    read_state_dict,
)


def _detached(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


@pytest.fixture(scope="module")
def tiny_sd() -> dict[str, torch.Tensor]:
    """Random-init state dict of the tiny EVA-02 (no fitting: loading is what is tested)."""
    torch.manual_seed(0)
    return _detached(create_model(tiny_spec()).state_dict())


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory, tiny_sd) -> Path:
    d = tmp_path_factory.mktemp("ckpts")
    save_file(tiny_sd, str(d / "plain.safetensors"))
    torch.save(tiny_sd, d / "plain.pth")
    torch.save(tiny_sd, d / "plain.bin")
    torch.save(tiny_sd, d / "plain.pt")
    torch.save({"state_dict": tiny_sd, "epoch": 3}, d / "wrapped_state_dict.pth")
    torch.save({"model": tiny_sd, "optimizer": {"lr": torch.tensor(0.1)}}, d / "wrapped_model.pth")
    torch.save({"state_dict": {"model": tiny_sd}}, d / "wrapped_twice.pth")
    torch.save({f"module.{k}": v for k, v in tiny_sd.items()}, d / "ddp.pth")
    save_file({f"_orig_mod.{k}": v for k, v in tiny_sd.items()}, str(d / "compiled.safetensors"))
    torch.save({"model": {f"module._orig_mod.{k}": v for k, v in tiny_sd.items()}}, d / "ddp_compiled.bin")
    torch.save({k: v.half() if v.is_floating_point() else v for k, v in tiny_sd.items()}, d / "half.pth")
    return d


def _assert_same_weights(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v), k
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not model.training


@pytest.mark.parametrize("name", ["plain.safetensors", "plain.pth", "plain.bin", "plain.pt"])
def test_formats_load(ckpt_dir, tiny_sd, name):
    sd = read_state_dict(ckpt_dir / name)
    assert set(sd) == set(tiny_sd)
    _assert_same_weights(load_model(tiny_spec(), ckpt_dir / name), tiny_sd)


@pytest.mark.parametrize("name", ["wrapped_state_dict.pth", "wrapped_model.pth", "wrapped_twice.pth", "ddp.pth",
                                  "compiled.safetensors", "ddp_compiled.bin"])
def test_wrappers_and_prefixes_are_unwrapped(ckpt_dir, tiny_sd, name):
    sd = read_state_dict(ckpt_dir / name)
    assert set(sd) == set(tiny_sd)
    _assert_same_weights(load_model(tiny_spec(), ckpt_dir / name), tiny_sd)


def test_half_precision_checkpoint_loads_as_fp32(ckpt_dir, tiny_sd):
    model = load_model(tiny_spec(), ckpt_dir / "half.pth")
    got = model.state_dict()
    for k, v in tiny_sd.items():
        if v.is_floating_point():
            assert got[k].dtype == torch.float32
            assert torch.equal(got[k], v.half().float()), k


def test_filter_drops_non_tensor_entries(tiny_sd):
    sd = filter_state_dict({**tiny_sd, "epoch": 3, "arch": "eva02"})
    assert set(sd) == set(tiny_sd)


@pytest.mark.parametrize("obj", [{}, [1, 2], {"epoch": 3, "arch": "x"}, {"state_dict": {}}])
def test_filter_without_tensors_is_an_error(obj):
    with pytest.raises(CheckpointError, match="<memory>"):
        filter_state_dict(obj)


def test_compiled_ddp_prefix_order_is_unwrapped(tiny_sd):
    sd = filter_state_dict({f"_orig_mod.module.{k}": v for k, v in tiny_sd.items()})
    assert set(sd) == set(tiny_sd)


def test_missing_file_names_the_path(tmp_path):
    p = tmp_path / "nope" / "weights.safetensors"
    with pytest.raises(FileNotFoundError, match=str(p)):
        read_state_dict(p)
    with pytest.raises(FileNotFoundError, match=str(p)):
        load_model(tiny_spec(), p)


def test_directory_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=f"not a file: {tmp_path}"):
        read_state_dict(tmp_path)


@pytest.mark.parametrize("name, data", [
    ("random.safetensors", os.urandom(4096)),
    ("empty.safetensors", b""),
    ("text.pth", b"this is a text file, not a checkpoint\n" * 10),
    ("random.bin", os.urandom(4096)),
])
def test_unreadable_file_is_a_checkpoint_error_naming_the_path(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(data)
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint {p}"):
        read_state_dict(p)
    with pytest.raises(CheckpointError, match=str(p)):
        load_model(tiny_spec(), p)


def test_truncated_safetensors_is_a_checkpoint_error(ckpt_dir, tmp_path):
    data = (ckpt_dir / "plain.safetensors").read_bytes()
    p = tmp_path / "cut.safetensors"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=str(p)):
        load_model(tiny_spec(), p)


def test_wrong_depth_names_missing_and_unexpected_keys(tmp_path):
    shallow = dataclasses.replace(tiny_spec(), model_kwargs={"depth": 2})
    p = tmp_path / "depth2.safetensors"
    save_file(_detached(create_model(shallow).state_dict()), str(p))
    with pytest.raises(CheckpointError) as e:
        load_model(tiny_spec(), p)  # depth 4 wants blocks.2 and blocks.3
    msg = str(e.value)
    assert str(p) in msg and "missing keys" in msg and "0 unexpected keys" in msg
    assert "blocks.2." in msg
    # the other way round: the deeper checkpoint has keys the model lacks
    deep = tmp_path / "depth4.safetensors"
    save_file(_detached(create_model(tiny_spec()).state_dict()), str(deep))
    with pytest.raises(CheckpointError, match=r"0 missing keys.*unexpected keys \['blocks\.2\."):
        load_model(shallow, deep)


def test_non_eva_checkpoint_names_keys(tmp_path):
    import timm

    p = tmp_path / "resnet18.pth"
    torch.save(timm.create_model("resnet18", pretrained=False, num_classes=1000).state_dict(), p)
    with pytest.raises(CheckpointError) as e:
        load_model(tiny_spec(), p)
    msg = str(e.value)
    assert "does not match architecture Eva" in msg
    assert "cls_token" in msg or "blocks.0." in msg        # a missing EVA key is named
    assert "bn1." in msg or "conv1.weight" in msg          # an unexpected ResNet key is named


def test_wrong_head_shape_names_head_weight(tmp_path):
    p = tmp_path / "ten_classes.safetensors"
    save_file(_detached(create_model(dataclasses.replace(tiny_spec(), num_classes=10)).state_dict()), str(p))
    with pytest.raises(CheckpointError, match=r"head\.weight: checkpoint \(10, 192\) vs model \(1000, 192\)") as e:
        load_model(tiny_spec(), p)
    assert "head.bias" in str(e.value) and str(p) in str(e.value)


def test_unknown_architecture_is_a_checkpoint_error():
    spec = dataclasses.replace(tiny_spec(), model="no_such_arch_v9")
    with pytest.raises(CheckpointError, match="no_such_arch_v9"):
        create_model(spec)


def test_loading_never_touches_the_network(ckpt_dir, tiny_sd, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access during checkpoint load: {args[1:]}")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    for name in ("plain.safetensors", "plain.pth", "wrapped_model.pth", "compiled.safetensors"):
        _assert_same_weights(load_model(tiny_spec(), ckpt_dir / name), tiny_sd)
