"""Loading without random initialisation: the network is built on the meta device, the
weights file's tensors are assigned into it and the non-persistent buffers (RoPE tables,
EVA's zero k-bias) computed after; it answers bit for bit as the reference load does
(random init on the CPU, the weights copied in)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_spec
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

from engine.backends import eager
from engine.core.checkpoint import MetaLoadError, create_model, load_model, materialize_buffers
from engine.core.model import wrap
from engine.core.precision import apply_policy

# in-place random fills: what every timm / torch.nn.init initialiser comes down to
_RANDOM = {"uniform_", "normal_", "bernoulli_", "random_", "exponential_", "cauchy_", "log_normal_", "geometric_"}


class RandomFills(TorchDispatchMode):
    """Counts random in-place fills, split by whether the tensor filled has storage."""

    def __init__(self):
        super().__init__()
        self.real = self.meta = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _RANDOM:
            if args[0].is_meta:
                self.meta += 1
            else:
                self.real += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A random tiny EVA-02 saved as an eager artifact's weights file (FP32 safetensors)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("meta") / eager.FILES[0]
    save_file({k: v.detach().clone().contiguous() for k, v in create_model(tiny_spec()).state_dict().items()},
              str(path))
    return path


def _pixels(n: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (n, 112, 112, 3), dtype=torch.uint8, generator=g)  # [B, S, S, 3] uint8


def _artifact(path, precision: str):
    """What eager.load reads of an artifact: its spec, the weights file, its manifest's meta."""
    return SimpleNamespace(spec=tiny_spec(precision=precision), path=lambda name: path.parent / name, meta={})


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_meta_load_answers_bit_for_bit_as_the_reference_load(weights, precision):
    spec = tiny_spec(precision=precision)
    ref = load_model(spec, weights, meta=False)
    new = load_model(spec, weights)
    got = dict(new.named_buffers())
    for name, t in ref.named_buffers():              # non-persistent ones too: rope.pos_embed, k_bias
        assert torch.equal(got[name], t) and got[name].dtype == t.dtype, name
    x = _pixels()
    with torch.inference_mode():
        want = wrap(ref, spec, "cpu").logits(x)
        assert torch.equal(eager.load(_artifact(weights, precision), torch.device("cpu")).fn.logits(x), want)
        assert torch.equal(wrap(new, spec, "cpu").logits(x), want)


def test_a_wrong_rope_table_would_be_seen(weights):
    """The comparison above can fail: a RoPE table off by one ulp changes the logits."""
    spec = tiny_spec()
    net = load_model(spec, weights)
    x = _pixels()
    with torch.inference_mode():
        want = wrap(net, spec, "cpu").logits(x)
        net.rope.pos_embed.copy_(torch.nextafter(net.rope.pos_embed, torch.tensor(2.0)))
        assert not torch.equal(wrap(net, spec, "cpu").logits(x), want)


def test_no_parameter_is_initialised_on_the_eager_load(weights, monkeypatch):
    seen = []
    orig = torch.nn.Module.load_state_dict

    def record(self, sd, *args, **kwargs):   # what the model holds when the weights arrive
        seen.append((type(self).__name__, [t.is_meta for t in self.parameters()]))
        return orig(self, sd, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "load_state_dict", record)
    for precision in ("fp32", "bf16"):
        with RandomFills() as fills:
            eager.load(_artifact(weights, precision), torch.device("cpu"))
        assert fills.real == 0, f"{fills.real} random fills of real tensors while loading ({precision})"
        assert fills.meta > 0            # timm's initialisers did run, on shapes only
    eva = [flags for name, flags in seen if name == "Eva"]
    assert eva and all(all(flags) for flags in eva)
    # the counter sees the reference load's initialisation: the check above can fail
    with RandomFills() as fills:
        load_model(tiny_spec(), weights, meta=False)
    assert fills.real > 0


def test_a_buffer_without_its_hook_falls_back_to_the_reference_saying_why(weights, monkeypatch, capsys):
    from timm.layers.pos_embed_sincos import RotaryEmbeddingCat

    monkeypatch.setattr(RotaryEmbeddingCat, "init_non_persistent_buffers", None)
    net = load_model(tiny_spec(), weights)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "meta-device load of eva02_tiny_patch14_224 failed" in err
    assert "RotaryEmbeddingCat rope has buffers ['bands', 'pos_embed']" in err and "on the CPU" in err
    ref = load_model(tiny_spec(), weights, meta=False)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), ref.state_dict().values()))
    assert torch.equal(net.rope.pos_embed, ref.rope.pos_embed)


def test_materialize_names_a_module_it_cannot_fill():
    with torch.device("meta"):
        m = torch.nn.Module()
        m.register_buffer("table", torch.empty(3), persistent=False)
    with pytest.raises(MetaLoadError, match=r"Module <root> has buffers \['table'\]"):
        materialize_buffers(m)


def test_policy_copy_shares_storage_and_leaves_the_original_as_it_was(weights):
    net = load_model(tiny_spec(), weights)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    ptr = net.patch_embed.proj.weight.data_ptr()
    low = apply_policy(net, "bf16")
    fp32 = apply_policy(net, "fp32").to(torch.float64)    # moving the copy moves none of the original
    assert low.patch_embed.proj.weight.data_ptr() == ptr  # FP32 parts: the same storage, no 1.2 GB copy
    assert fp32.patch_embed.proj.weight.dtype == torch.float64
    assert net.patch_embed.proj.weight.dtype == torch.float32 and net.patch_embed.proj.weight.data_ptr() == ptr
    assert type(net.blocks[0].attn.qkv) is torch.nn.Linear and net.blocks[0].attn.q_bias is not None
    after = net.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], v) for k, v in before.items())


def test_half_checkpoint_assigned_as_fp32(tmp_path, weights):
    from safetensors.torch import load_file

    p = tmp_path / "half.safetensors"
    save_file({k: v.half() for k, v in load_file(str(weights)).items()}, str(p))
    net = load_model(dataclasses.replace(tiny_spec()), p)
    assert {t.dtype for t in net.state_dict().values()} == {torch.float32}
