"""The decoder fallback chain (dali-gpu -> nvjpeg -> pil; dali-cpu -> pil) on a CPU: each link that
cannot start falls to the next and says why on stderr; the plan of that chain is known without
building anything, and the build's self-check refuses a CUDA artifact that would decode slowly."""
from __future__ import annotations

import json
import sys

import pytest
from conftest import tiny_spec

from engine.decoders import make_decoder, planned_decoder, slow_decoder_reason, start_decoder


@pytest.fixture
def no_dali(monkeypatch):
    """nvidia.dali cannot be imported (a None entry in sys.modules makes `import` raise ImportError)."""
    for name in [m for m in sys.modules if m == "nvidia.dali" or m.startswith("nvidia.dali.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    for mod in ("engine.decoders.dali",):
        monkeypatch.delitem(sys.modules, mod, raising=False)


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch says a CUDA device is there (nothing is run on it: only decoders' start checks ask, and
    a GPU decoder makes its own stream)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: object())


def _lines(err: str) -> list[str]:
    """The fallback lines (DALI may print a line of its own without a newline before one)."""
    return [line[line.index("[engine] decoder "):] for line in err.splitlines() if "[engine] decoder " in line]


def test_on_a_cpu_dali_gpu_falls_to_nvjpeg_then_to_pil_saying_why(capfd):
    dec = make_decoder("dali-gpu", tiny_spec(), 4, 1)
    assert dec.name == "pil"
    lines = _lines(capfd.readouterr().err)
    assert len(lines) == 2, lines
    assert lines[0].startswith("[engine] decoder dali-gpu unavailable (") and lines[0].endswith("; using nvjpeg")
    assert "CUDA" in lines[0]
    assert lines[1] == "[engine] decoder nvjpeg unavailable (RuntimeError: nvjpeg decoding needs a CUDA GPU); using pil"
    assert planned_decoder("dali-gpu") == ("pil", ["dali-gpu: no CUDA device", "nvjpeg: no CUDA device"])


def test_without_dali_both_dali_decoders_fall_back(no_dali, capfd):
    dec = make_decoder("dali-cpu", tiny_spec(), 4, 1, isolate=False)
    assert dec.name == "pil"
    dec = make_decoder("dali-gpu", tiny_spec(), 4, 1)
    assert dec.name == "pil"
    lines = _lines(capfd.readouterr().err)
    assert [line.split(" unavailable ")[0] for line in lines] == [
        "[engine] decoder dali-cpu", "[engine] decoder dali-gpu", "[engine] decoder nvjpeg"]
    assert "ModuleNotFoundError" in lines[0] and lines[0].endswith("; using pil")
    assert "ModuleNotFoundError" in lines[1] and lines[1].endswith("; using nvjpeg")
    name, skipped = planned_decoder("dali-cpu")
    assert name == "pil" and skipped[0].startswith("dali-cpu: cannot import nvidia.dali (ModuleNotFoundError")


def test_with_a_cuda_device_but_no_dali_the_chain_stops_at_nvjpeg(no_dali, fake_cuda, capfd):
    dec = make_decoder("dali-gpu", tiny_spec(), 4, 1)
    assert dec.name == "nvjpeg"
    lines = _lines(capfd.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("[engine] decoder dali-gpu unavailable (ModuleNotFoundError")
    assert planned_decoder("dali-gpu")[0] == "nvjpeg"
    # nvjpeg sends every chroma-subsampled JPEG to PIL: slow, and said so
    why = slow_decoder_reason("cuda")
    assert why.startswith("this CUDA artifact would decode with nvjpeg, not dali-gpu (dali-gpu: cannot import")


def test_an_unknown_decoder_is_refused_and_pil_is_the_end_of_the_chain():
    with pytest.raises(ValueError, match="unknown decoder"):
        make_decoder("turbo", tiny_spec(), 4)
    assert planned_decoder("pil") == ("pil", [])


def test_slow_decoder_reason_only_speaks_of_cuda_artifacts(monkeypatch):
    import engine.decoders as decoders

    assert slow_decoder_reason("cpu") is None and slow_decoder_reason("cpu", "pil") is None
    assert slow_decoder_reason("cuda").startswith("this CUDA artifact would decode with pil")
    monkeypatch.setattr(decoders, "start_problem", lambda name: None)      # a machine where all can start
    assert slow_decoder_reason("cuda") is None
    assert slow_decoder_reason("cuda", "pil") == "this CUDA artifact would decode with pil, not dali-gpu"


def test_the_self_check_fails_a_cuda_artifact_that_would_decode_slowly(tmp_path, monkeypatch, capsys):
    from evaluator.contest import selfcheck

    art = tmp_path / "artifact"
    art.mkdir()
    (art / "manifest.json").write_text(json.dumps({"device": "cuda", "decoder": "dali-gpu"}))
    assert selfcheck.main(["run", "--artifact", str(art)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "would decode with pil, not dali-gpu" in err[0]
    assert "ENGINE_SLOW_DECODER_OK=1" in err[0]
    monkeypatch.setenv("ENGINE_SLOW_DECODER_OK", "1")
    assert selfcheck.slow_decoder(art) is None
    monkeypatch.delenv("ENGINE_SLOW_DECODER_OK")
    (art / "manifest.json").write_text(json.dumps({"device": "cpu"}))
    assert selfcheck.slow_decoder(art) is None


def test_a_decoder_can_be_built_in_the_background():
    pending = start_decoder("pil", tiny_spec(), 4, 2)
    dec = pending.result()
    assert dec.name == "pil" and dec.pool.threads == 2
    with pytest.raises(ValueError, match="unknown decoder"):
        start_decoder("turbo", tiny_spec(), 4).result()


def test_hw_decoder_load_comes_from_the_settings(monkeypatch):
    from engine import settings
    from engine.decoders.dali import DaliDecoder

    assert settings.hw_decoder_load() == 0.9
    monkeypatch.setenv("ENGINE_HW_DECODER_LOAD", "0.7")
    assert DaliDecoder(tiny_spec(), 2, 1).hw_decoder_load == 0.7
    monkeypatch.setenv("ENGINE_HW_DECODER_LOAD", "1.5")
    with pytest.raises(settings.SettingsError, match="ENGINE_HW_DECODER_LOAD"):
        settings.hw_decoder_load()
