"""CLIP towers on static shapes, eager or AOTInductor-compiled, behind the ClipTowers interface.

    image graph: [B, S, S, 3] uint8 -> [B, D] float32 unit rows (mean/std folded in)
    text graph:  [B, L] int64 token ids -> [B, D] float32 unit rows (L = TEXT_LEN, or the context)

A graph runs one static batch B: a smaller batch is padded (the last row repeated), a larger
one split. On CUDA the batch is replayed from a captured CUDA graph. `aot` exports the
graph (torch.export) and compiles it with AOTInductor, reusing the EVA-02 backend's
model-agnostic pieces (engine.backends.aot: Inductor settings, package unpacking, the
in-place .so loader); loading a compiled tower only dlopens its .so, nothing compiles.

Text at a fixed L: the text tower is causal and pools at the eot token, so a prompt whose
eot lies before L gives the same row on the first L positions (towers.text_forward's
trimming, at a static length). A batch with a longer prompt runs the eager reference
(ClipTowers.encode_tokens), said once on stderr.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.backends import REFERENCE as EAGER
from engine.backends.aot import NAME as AOT
from engine.clip.towers import PRECISIONS, ClipTowers, _say_once, text_forward

TEXT_LEN = 32          # static text length: CLIP prompts are ~10-20 tokens of 77
BACKENDS = (EAGER, AOT)  # the registry's names (engine.backends); their tower forms are here


class ImageGraph(torch.nn.Module):
    """uint8 [B, S, S, 3] -> [B, D] float32 unit rows: ToTensor + Normalize + visual tower in `dtype`."""

    def __init__(self, model, spec, dtype: torch.dtype):
        super().__init__()
        self.visual = copy.deepcopy(model.visual).to(dtype).eval()
        self.dtype = dtype
        self.register_buffer("mean", torch.tensor(spec.image.mean, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(spec.image.std, dtype=torch.float32).view(1, 3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x.permute(0, 3, 1, 2).float().div(255.0) - self.mean) / self.std   # [B, 3, S, S] fp32
        return F.normalize(self.visual(x.to(self.dtype)).float(), dim=-1)


class TextGraph(torch.nn.Module):
    """int64 [B, L] -> [B, D] float32 unit rows: open_clip's encode_text on all L positions, in `dtype`."""

    def __init__(self, model, dtype: torch.dtype):
        super().__init__()
        for name in ("token_embedding", "transformer", "ln_final"):
            setattr(self, name, copy.deepcopy(getattr(model, name)).to(dtype))
        self.positional_embedding = torch.nn.Parameter(model.positional_embedding.detach().to(dtype).clone(),
                                                       requires_grad=False)
        proj = model.text_projection
        self.text_projection = copy.deepcopy(proj).to(dtype) if isinstance(proj, torch.nn.Module) else (
            None if proj is None else torch.nn.Parameter(proj.detach().to(dtype).clone(), requires_grad=False))
        self.register_buffer("attn_mask", model.attn_mask.detach().clone(), persistent=False)
        self.eval()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.normalize(text_forward(self, tokens, trim=False).float(), dim=-1)


def make_graph(kind: str, model, spec, precision: str) -> torch.nn.Module:
    """The `kind` ("image" or "text") graph of `model` in `precision` (weights cast to it; int8:
    the FP32 graph with torchao's dynamic INT8 Linears, engine.clip.int8)."""
    if precision == "int8":
        from engine.clip import int8

        return int8.quantize(make_graph(kind, model, spec, "fp32"))
    dtype = PRECISIONS[precision] or torch.float32
    return ImageGraph(model, spec, dtype) if kind == "image" else TextGraph(model, dtype)


def example_input(kind: str, spec, batch: int, text_len: int, device: str) -> torch.Tensor:
    """A batch of the graph's static shape: grey pixels, or sot + eot token rows."""
    if kind == "image":
        s = spec.image.input_size
        return torch.full((batch, s, s, 3), 128, dtype=torch.uint8, device=device)
    tok = torch.zeros(batch, text_len, dtype=torch.long, device=device)
    tok[:, 0], tok[:, 1] = 49406, 49407          # CLIP BPE's sot and eot ids
    return tok


def export_aot(graph: torch.nn.Module, example: torch.Tensor, device: str, out_dir: Path) -> list[str]:
    """torch.export + AOTInductor of `graph` on `example`'s static shape, unpacked into `out_dir`
    (engine.backends.aot.unpack: model.so + metadata [+ kernel binaries]). Returns the file names."""
    from engine.backends.aot import inductor_configs, unpack

    graph = graph.to(device)
    with torch.no_grad():
        ep = torch.export.export(graph, (example,))
    package = out_dir.parent / f".{out_dir.name}.pt2"
    torch._inductor.aoti_compile_and_package(ep, package_path=str(package),
                                             inductor_configs=inductor_configs(device))
    try:
        return unpack(package, out_dir)
    finally:
        package.unlink(missing_ok=True)


def load_aot(out_dir: Path, device: torch.device):
    """fn(x) -> [B, D] of a compiled graph in `out_dir`, loaded in place (no compiler)."""
    from engine.backends.aot import SO, load_in_place

    run = load_in_place(out_dir / SO, device)
    return lambda x: run(x.contiguous())[0]


def graphed(fn, example: torch.Tensor):
    """fn replayed from a CUDA graph captured on `example`'s shape (CUDA only; the caller checks)."""
    static_in = example.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(2):                       # warm-up outside capture (lazy inits, allocator)
            fn(static_in)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.inference_mode():
        static_out = fn(static_in)

    def replay(x: torch.Tensor) -> torch.Tensor:
        static_in.copy_(x)
        g.replay()
        return static_out.clone()
    return replay


class Static:
    """fn on a static batch: rows padded up to `batch` (the last repeated), larger inputs split."""

    def __init__(self, fn, batch: int):
        self.fn, self.batch = fn, batch

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = []
        for lo in range(0, x.shape[0], self.batch):
            part = x[lo:lo + self.batch]
            n = part.shape[0]
            if n < self.batch:   # pad the last batch: the graph has one static shape
                part = torch.cat([part, part[-1:].expand(self.batch - n, *part.shape[1:])])
            out.append(self.fn(part)[:n])
        return torch.cat(out)


def tower_fn(kind: str, backend: str, model, spec, precision: str, batch: int, device: torch.device,
             files_dir: Path | None, text_len: int = TEXT_LEN) -> Static:
    """A runnable tower: eager builds the graph module; aot loads the .so in `files_dir`.
    On CUDA the static batch is captured in a CUDA graph."""
    if backend == EAGER:
        fn = make_graph(kind, model, spec, precision).to(device)
    elif backend == AOT:
        fn = load_aot(files_dir, device)
    else:
        raise ValueError(f"tower backend must be one of {BACKENDS}, got {backend!r}")
    if device.type == "cuda":
        fn = graphed(fn, example_input(kind, spec, batch, text_len, str(device)))
    return Static(fn, batch)


def text_len_for(spec) -> int:
    return min(TEXT_LEN, spec.context_length)


class CompiledTowers(ClipTowers):
    """ClipTowers whose encode_images / encode_tokens run the chosen static graphs; the eager
    model stays for the reference path (long prompts, pseudo-word injection, trim off)."""

    def __init__(self, base: ClipTowers, image: Static | None, text: Static | None, text_len: int, record: dict):
        self.__dict__.update(base.__dict__)
        self.image_fn, self.text_fn, self.text_len, self.record = image, text, text_len, record

    @torch.inference_mode()
    def encode_images(self, batch) -> torch.Tensor:
        if self.image_fn is None:
            return super().encode_images(batch)
        return self.image_fn(torch.as_tensor(batch).to(self.device, non_blocking=True))

    @torch.inference_mode()
    def encode_tokens(self, tokens: torch.Tensor, trim: bool | None = None) -> torch.Tensor:
        if self.text_fn is None or trim is False:
            return super().encode_tokens(tokens, trim)
        tokens = tokens.to(self.device)
        if int(tokens.argmax(dim=-1).max()) >= self.text_len:   # an eot past the graph's length
            _say_once(f"[engine] a prompt longer than the compiled text tower's {self.text_len} tokens: "
                      "that batch runs the eager text tower")
            return super().encode_tokens(tokens, trim)
        return self.text_fn(tokens[:, :self.text_len])
