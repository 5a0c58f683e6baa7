"""engine/backends/trt.py on CPU: the compile options it passes are the ones the installed
torch_tensorrt's dynamo.compile names as parameters, and the manifest says which were
applied and which dropped. torch_tensorrt is a fake module in sys.modules (no TensorRT
runs); its compile mirrors 2.14's signature (keyword-only options, then **kwargs)."""
from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from engine.backends import trt


def compile_2_14(calls):
    """dynamo.compile as torch-tensorrt 2.14 declares it (the parts trt.save uses): no
    use_explicit_typing, unknown keywords land in **kwargs."""
    def compile(exported_program, inputs=None, *, arg_inputs=None, kwarg_inputs=None,
                require_full_compilation=False, min_block_size=5, **kwargs):
        calls.append({"arg_inputs": arg_inputs, "require_full_compilation": require_full_compilation,
                      "min_block_size": min_block_size, "kwargs": kwargs})
        return "compiled program"

    return compile


def compile_with_explicit_typing(calls):
    """An earlier release's signature, where use_explicit_typing is a parameter."""
    def compile(exported_program, *, arg_inputs=None, use_explicit_typing=False, min_block_size=5,
                require_full_compilation=False, **kwargs):
        calls.append({"use_explicit_typing": use_explicit_typing, "kwargs": kwargs})
        return "compiled program"

    return compile


@pytest.fixture
def fake_trt(monkeypatch):
    """install(compile) puts a torch_tensorrt with that dynamo.compile in sys.modules and makes
    save() reachable on CPU (CUDA reported present, the export replaced by a placeholder)."""
    def install(compile_fn):
        mod: Any = types.ModuleType("torch_tensorrt")   # a fake module: its attributes are set here
        mod.__version__ = "2.14.0"
        mod.dynamo = types.SimpleNamespace(compile=compile_fn)

        def save(program, path, output_format=None, arg_inputs=None):
            assert program == "compiled program" and output_format == "exported_program"
            open(path, "wb").write(b"engines")

        mod.save = save
        monkeypatch.setitem(sys.modules, "torch_tensorrt", mod)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        example = torch.zeros((2, 8, 8, 3), dtype=torch.uint8)
        monkeypatch.setattr(trt, "export_top1", lambda net, spec, device, margin: ("exported", example))

    return install


def test_an_option_the_installed_compile_lacks_is_dropped_with_one_line(fake_trt, tmp_path, capsys):
    calls = []
    fake_trt(compile_2_14(calls))
    manifest = trt.save(torch.nn.Linear(2, 2), None, "cuda", tmp_path)["trt"]
    call, = calls
    assert call["kwargs"] == {}   # use_explicit_typing never reaches **kwargs
    assert call["min_block_size"] == 1 and call["require_full_compilation"] is False   # known ones are passed
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "use_explicit_typing=True" in err[0] and "no parameter" in err[0]
    assert manifest["options"] == {"min_block_size": 1, "require_full_compilation": False}
    assert list(manifest["dropped_options"]) == ["use_explicit_typing"]
    assert "2.14.0" in manifest["dropped_options"]["use_explicit_typing"] and "**kwargs" in \
        manifest["dropped_options"]["use_explicit_typing"]
    assert manifest["torch_tensorrt"] == "2.14.0" and "explicit_typing" not in manifest
    assert (tmp_path / trt.FILES[0]).read_bytes() == b"engines"


def test_an_option_the_installed_compile_names_is_passed_and_recorded(fake_trt, tmp_path, capsys):
    calls = []
    fake_trt(compile_with_explicit_typing(calls))
    manifest = trt.save(torch.nn.Linear(2, 2), None, "cuda", tmp_path)["trt"]
    assert calls == [{"use_explicit_typing": True, "kwargs": {}}]
    assert manifest["options"] == trt.COMPILE_OPTIONS and manifest["dropped_options"] == {}
    assert capsys.readouterr().err == ""


def test_accepted_options_reads_parameters_not_kwargs(capsys):
    def only_kwargs(program, **kwargs):
        return program

    applied, dropped = trt.accepted_options(only_kwargs, {"min_block_size": 1}, "9.9")
    assert applied == {} and "no parameter 'min_block_size'" in dropped["min_block_size"]
    applied, dropped = trt.accepted_options(compile_2_14([]), {"min_block_size": 1, "debug": True}, "2.14.0")
    assert applied == {"min_block_size": 1} and list(dropped) == ["debug"]
    assert capsys.readouterr().err.count("\n") == 2
