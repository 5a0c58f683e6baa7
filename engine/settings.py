"""Every environment switch of the engine, read once, typed, checked.

The rest of the engine never reads `os.environ`: it asks here (as timm's
`layers/config.py` does). A bad value is a SettingsError naming the variable, the
value and what it accepts. Values are read on first use and kept; `reload()` forgets
them (tests that change the environment in-process call it). `check(names)` reads a
command's switches before it does anything, so a bad value is refused up front.

A switch of type 0/1 accepts one set of spellings, any case: 1, true, yes, on for
on and 0, false, no, off for off (an empty value is the default).

| variable | type | default | what it switches |
|---|---|---|---|
| ENGINE_ARTIFACT | path | artifacts/default | the artifact directory scripts/run loads |
| ENGINE_DECODER | decoder name | the artifact's | pil, dali-cpu, dali-gpu, nvjpeg: the off switch for fast decoding |
| ENGINE_CUDA_GRAPHS | 0/1 | the artifact's (1) | replay the static batch from a captured CUDA graph (an auto build records whether that measured faster) |
| ENGINE_TF32 | 0/1 | 0 | let FP32 matmuls and convolutions on CUDA use TF32 (0: IEEE FP32, as a frozen FP32 reference computes; 1: to match a reference that ran with TF32) |
| ENGINE_INT8 | 0/1 | 1 | offer the CPU build's int8 candidate to the measured search (PT2E static quantization, engine.core.int8) where the CPU has INT8 dot products and torchao imports; 0: the off switch, the search skips it with that reason |
| ENGINE_GUARD | 0/1 | 1 | re-check near-ties of a guarded low-precision artifact in FP32 (0: raw answers) |
| ENGINE_ARTIFACT_VERIFY | quick/size/sha256 | quick | a classification artifact's check before the model loads: sizes + a sampled SHA-256 of each file, sizes only, or the full SHA-256; under quick and size the full SHA-256 of every file still runs, on a thread while the model loads, and classify waits for it before the first image (engine.classify.artifact). An index's compiled CLIP tower files get their full SHA-256 at load in every mode |
| ENGINE_PIPELINE_DEPTH | int 0..64 | 2 | decoded batches in flight ahead of inference |
| ENGINE_READERS | int 1..1024 | from ENGINE_THREADS | file reader threads (engine.threads) |
| ENGINE_FAST_EXIT | 0/1 | 1 | leave without interpreter teardown once the output is synced |
| ENGINE_T0 | seconds since the epoch, 0..1e10 | process start | when the timed run began (scripts/run sets it) |
| ENGINE_THREADS | int 1..1024 | usable CPUs, at most 16 | the thread budget: DALI, torch, OpenMP and readers are sized from it (engine.threads) |
| ENGINE_MAX_FILE_BYTES | int 1..2^40 | 67108864 (64 MiB) | larger image files are refused unread |
| ENGINE_DECODER_ISOLATE | 0/1 | 1 | run the DALI CPU decoder in a child process (a native crash costs a batch, not the run) |
| ENGINE_DECODE_DEADLINE_S | seconds in (0, 86400] | 30 | longest one image may take to decode in the child decoder process: past it, that image alone is unreadable (a prediction and a stderr line), never decoded again |
| ENGINE_MAX_PIXELS | int 1..2^40 | 89478485 (PIL's bomb limit) | pixels an image may have, at its own size and resized before the crop; a larger one is refused before any allocation (unreadable) |
| ENGINE_READAHEAD_BYTES | int 1..2^40 | 268435456 (256 MiB) | encoded bytes read ahead of the decoder, and handed to it at once (a larger file is read alone) |
| ENGINE_HW_DECODER_LOAD | 0..1 | 0.9 | share of JPEG decoding DALI's GPU decoder gives the hardware JPEG engine (DALI's own default) |
| ENGINE_SLOW_DECODER_OK | 0/1 | 0 | let the build's self-check pass a CUDA artifact that would decode with anything but dali-gpu |
| ONEDNN_MAX_CPU_ISA | oneDNN ISA name | (unset: the CPU's) | oneDNN's own limit on the instructions its GEMMs use, read to know whether bf16 is native here (engine.tuning.measure) |
| OPENBLAS_NUM_THREADS | 1..1024 | 1 (engine.threads) | threads numpy's OpenBLAS starts as numpy loads (a value OpenBLAS cannot use is refused); the shell entry points and engine.threads set 1 unless it is set, and each past the first counts in the address-space need (engine.memory); OpenBLAS reads it itself |
| TMPDIR | path | /tmp | scratch space (a run keeps its own folder there and removes it on exit) |
| CLIP_MODEL_DIR | path | (the caller's) | local CLIP folder or state-dict file |
| CLIP_MODEL_NAME | str | (from the folder) | open_clip architecture of an OpenAI-style state dict |
| CLIP_DEVICE | cpu/cuda[:N] | cuda if available | where the CLIP towers run |
| CLIP_PRECISION | fp32/fp16/bf16 | fp16 on CUDA, else fp32 | CLIP autocast precision |
| CLIP_TEXT_TRIM | 0/1 | 1 | run the text tower on the used positions only (0: all 77, the reference twin) |
| CLIP_TOWERS | auto/eager | auto on CUDA, eager on the CPU | the index build measures eager/aot CLIP towers and records the one chosen, which query runs load (engine.clip.tune); eager: the off switch, at build and query time |
| ENGINE_FP8_TORCHAO | 0/1 | 1 | let an `fp8-torchao` graph take its float8 GEMMs from torchao (engine.core.fp8_torchao); 0: the engine's own fp8 GEMMs (bf16 without fp8 hardware), said in one stderr line |
| CLIP_TOWERS_INT8 | 0/1 | 1 | CLIP_TOWERS=auto on the CPU also measures torchao dynamic-INT8 tower candidates, and a query run loads a recorded int8 tower (engine.clip.int8); 0: no int8 rows measured, and an index that chose one runs eager towers, said in one line |
| KERNELS_TOPK | auto/cupy/torch | auto | force the top-k kernel or its torch twin |
| ENGINE_DEBUG | 0/1 | 0 | show the Python traceback of a user error (as `--debug` does) instead of one line, and a build's library debug output (Inductor's autotune reports) |
| OMP_WAIT_POLICY | passive/active | passive | OpenMP threads sleep between calls (busy-waiting ones starve the decoder threads on few cores); engine.threads passes it on |
| ENGINE_PROGRESS | auto/bar/lines/off | auto | progress of long steps on stderr: a bar on a terminal, a line every few seconds otherwise |
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class SettingsError(ValueError):
    """An environment variable holds a value the engine cannot use."""


_cache: dict[str, Any] = {}


def reload() -> None:
    """Forget every value read so far: the next use reads the environment again."""
    _cache.clear()


def read(name: str, parse: Callable[[str, str], Any], default: Any) -> Any:
    """`parse(name, value)` of env `name` (read once), or `default` when unset or empty."""
    if name not in _cache:
        raw = os.environ.get(name, "").strip()
        _cache[name] = default if raw == "" else parse(name, raw)
    return _cache[name]


TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def flag(name: str, raw: str) -> bool:
    """A 0/1 switch: one of TRUE or FALSE, any case."""
    value = raw.lower()
    if value not in TRUE + FALSE:
        raise SettingsError(f"{name} must be 1/true/yes/on or 0/false/no/off, got {raw!r}")
    return value in TRUE


def int_at_least(low: int) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            v = int(raw)
        except ValueError:
            raise SettingsError(f"{name} must be a whole number >= {low}, got {raw!r}") from None
        if v < low:
            raise SettingsError(f"{name} must be a whole number >= {low}, got {raw!r}")
        return v
    return parse


def choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        if raw.lower() not in choices:
            raise SettingsError(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
        return raw.lower()
    return parse


def number(name: str, raw: str) -> float:
    """A finite number (nan and inf are refused: no switch means them)."""
    import math

    try:
        v = float(raw)
    except ValueError:
        raise SettingsError(f"{name} must be a number, got {raw!r}") from None
    if not math.isfinite(v):
        raise SettingsError(f"{name} must be a finite number, got {raw!r}")
    return v


def int_in(low: int, high: int, unit: str = "") -> Callable[[str, str], int]:
    """A whole number in low..high (`unit` named in the refusal)."""
    what = f"a whole number in {low}..{high}{' ' + unit if unit else ''}"

    def parse(name: str, raw: str) -> int:
        try:
            v = int(raw)
        except ValueError:
            raise SettingsError(f"{name} must be {what}, got {raw!r}") from None
        if not low <= v <= high:
            raise SettingsError(f"{name} must be {what}, got {raw!r}")
        return v
    return parse


MAX_THREADS_SETTING = 1024        # ENGINE_THREADS, ENGINE_READERS: far past any host's cores
MAX_BYTES_SETTING = 1 << 40       # ENGINE_MAX_FILE_BYTES, ENGINE_READAHEAD_BYTES: 1 TiB
MAX_PIXELS_SETTING = 1 << 40      # ENGINE_MAX_PIXELS
MAX_EPOCH_S = 1e10                # ENGINE_T0: seconds since the epoch (the year 2286)


def path(name: str, raw: str) -> Path:
    return Path(raw)


def _decoder_name(name: str, raw: str) -> str:
    from engine.decoders.registry import DECODERS

    return choice(*DECODERS)(name, raw)


def _device(name: str, raw: str) -> str:
    if raw != "cpu" and not (raw == "cuda" or (raw.startswith("cuda:") and raw[5:].isdigit())):
        raise SettingsError(f"{name} must be cpu, cuda or cuda:N, got {raw!r}")
    return raw


def artifact() -> Path:
    return read("ENGINE_ARTIFACT", path, Path("artifacts/default"))


def decoder() -> str | None:
    return read("ENGINE_DECODER", _decoder_name, None)


def cuda_graphs() -> bool | None:
    """None: unset, the artifact decides (its manifest's `cuda_graphs`, else on)."""
    return read("ENGINE_CUDA_GRAPHS", flag, None)


def tf32() -> bool:
    return read("ENGINE_TF32", flag, False)


def artifact_verify() -> str:
    return read("ENGINE_ARTIFACT_VERIFY", choice("quick", "size", "sha256"), "quick")


def pipeline_depth() -> int:
    return read("ENGINE_PIPELINE_DEPTH", int_in(0, 64, "batches"), 2)


def readers() -> int | None:
    """The reader thread count given by ENGINE_READERS, or None (engine.threads derives it)."""
    return read("ENGINE_READERS", int_in(1, MAX_THREADS_SETTING, "threads"), None)


def fast_exit() -> bool:
    return read("ENGINE_FAST_EXIT", flag, True)


def t0() -> float | None:
    return read("ENGINE_T0", number_in(0.0, MAX_EPOCH_S), None)


def clip_model_dir() -> Path | None:
    return read("CLIP_MODEL_DIR", path, None)


def text(name: str, raw: str) -> str:
    return raw


def clip_model_name() -> str | None:
    return read("CLIP_MODEL_NAME", text, None)


def clip_device() -> str | None:
    return read("CLIP_DEVICE", _device, None)


def clip_precision() -> str | None:
    return read("CLIP_PRECISION", choice("fp32", "fp16", "bf16"), None)


def clip_text_trim() -> bool:
    return read("CLIP_TEXT_TRIM", flag, True)


def clip_towers() -> str | None:
    from engine.backends import REFERENCE  # the off value: the reference backend's name

    return read("CLIP_TOWERS", choice("auto", REFERENCE), None)


def fp8_torchao() -> bool:
    return read("ENGINE_FP8_TORCHAO", flag, True)


def clip_towers_int8() -> bool:
    return read("CLIP_TOWERS_INT8", flag, True)


def topk_backend() -> str:
    return read("KERNELS_TOPK", choice("auto", "cupy", "torch"), "auto")


def guard() -> bool:
    return read("ENGINE_GUARD", flag, True)


def int8() -> bool:
    """ENGINE_INT8: whether the CPU build's measured search offers its int8 candidate (read at build time)."""
    return read("ENGINE_INT8", flag, True)


def debug() -> bool:
    return read("ENGINE_DEBUG", flag, False)


@contextlib.contextmanager
def debug_env(on: bool) -> Iterator[None]:
    """`--debug` for one call: ENGINE_DEBUG=1 inside it (and in the processes it starts), then the
    environment as it was, so a command called in-process leaves its caller's switches alone."""
    if not on:
        yield
        return
    before = os.environ.get("ENGINE_DEBUG")
    os.environ["ENGINE_DEBUG"] = "1"
    _cache.pop("ENGINE_DEBUG", None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("ENGINE_DEBUG", None)
        else:
            os.environ["ENGINE_DEBUG"] = before
        _cache.pop("ENGINE_DEBUG", None)


def omp_wait_policy() -> str:
    """PASSIVE or ACTIVE (OpenMP's spelling)."""
    return read("OMP_WAIT_POLICY", choice("passive", "active"), "passive").upper()


def progress() -> str:
    return read("ENGINE_PROGRESS", choice("auto", "bar", "lines", "off"), "auto")


MAX_THREADS = 16  # default budget cap: many-core hosts gain little past it, and scored sandboxes bound PIDs


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, as `nproc` counts them)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads() -> int:
    return read("ENGINE_THREADS", int_in(1, MAX_THREADS_SETTING, "threads"), min(usable_cpus(), MAX_THREADS))


def max_file_bytes() -> int:
    return read("ENGINE_MAX_FILE_BYTES", int_in(1, MAX_BYTES_SETTING, "bytes"), 64 << 20)


def decoder_isolate() -> bool:
    return read("ENGINE_DECODER_ISOLATE", flag, True)


def number_in(low: float, high: float, open_low: bool = False) -> Callable[[str, str], float]:
    def parse(name: str, raw: str) -> float:
        what = f"a number {'>' if open_low else '>='} {low:g} and <= {high:g}"
        try:
            v = float(raw)
        except ValueError:
            raise SettingsError(f"{name} must be {what}, got {raw!r}") from None
        if not (low < v if open_low else low <= v) or not v <= high:
            raise SettingsError(f"{name} must be {what}, got {raw!r}")
        return v
    return parse


def decode_deadline_s() -> float:
    """Seconds one image may take in the child decoder process (engine.decoders.isolate)."""
    return read("ENGINE_DECODE_DEADLINE_S", number_in(0.0, 86400.0, open_low=True), 30.0)


def max_pixels() -> int:
    """Pixel budget of one image, at its size and resized (engine.decoders.pil.checked_window)."""
    return read("ENGINE_MAX_PIXELS", int_in(1, MAX_PIXELS_SETTING, "pixels"), 89_478_485)


def readahead_bytes() -> int:
    """Encoded bytes the pipeline's readers may hold ahead of the decoder (engine.classify.pipeline)."""
    return read("ENGINE_READAHEAD_BYTES", int_in(1, MAX_BYTES_SETTING, "bytes"), 256 << 20)


def hw_decoder_load() -> float:
    return read("ENGINE_HW_DECODER_LOAD", number_in(0.0, 1.0), 0.9)


def slow_decoder_ok() -> bool:
    return read("ENGINE_SLOW_DECODER_OK", flag, False)


def onednn_max_cpu_isa() -> str:
    """ONEDNN_MAX_CPU_ISA as set ("" when unset): oneDNN reads it itself; the engine only looks."""
    return read("ONEDNN_MAX_CPU_ISA", text, "")


def openblas_threads() -> int:
    """Threads numpy's OpenBLAS starts, from OPENBLAS_NUM_THREADS (1 when unset: engine.threads and
    the shell entry points set it so before numpy loads). OpenBLAS reads it itself and starts one
    thread per CPU for a value it cannot use; the engine refuses such a value in one line instead."""
    return min(read("OPENBLAS_NUM_THREADS", int_in(1, MAX_THREADS_SETTING, "threads"), 1), usable_cpus())


def tmpdir() -> Path:
    """TMPDIR: where every scratch file of a run goes (default /tmp)."""
    return read("TMPDIR", path, Path("/tmp"))


# every switch a classification run reads: checked up front, before anything loads
RUN_SWITCHES = ("artifact", "decoder", "cuda_graphs", "tf32", "guard", "artifact_verify", "pipeline_depth", "readers",
                "fast_exit", "t0", "threads", "max_file_bytes", "decoder_isolate", "debug", "progress", "tmpdir",
                "decode_deadline_s", "max_pixels", "readahead_bytes", "hw_decoder_load", "slow_decoder_ok",
                "omp_wait_policy")
RUN_SWITCHES += ("fp8_torchao",)   # read where an fp8-torchao graph loads


def check(names: tuple[str, ...] = RUN_SWITCHES) -> None:
    """Read every switch in `names` (getters of this module) now: raises SettingsError on the first bad one."""
    for name in names:
        globals()[name]()


def documented(doc: str | None = None) -> dict[str, str]:
    """{variable: "what it switches (default: D)"} from the table of this module's docstring
    (and of `doc`, a docstring with a `| variable | ... | default | what |` table)."""
    out: dict[str, str] = {}
    for text in (__doc__ or "", doc or ""):
        for line in text.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 3 or not cells[0] or cells[0] == "variable" or set(cells[0]) <= {"-"}:
                continue
            default = cells[-2][1:-1] if cells[-2].startswith("(") and cells[-2].endswith(")") else cells[-2]
            out[cells[0]] = f"{cells[-1]} (default: {default})"
    return out


def env_help(names: tuple[str, ...], doc: str | None = None) -> dict[str, str]:
    """`documented()` rows for `names`, in that order (the `environment:` list of a command's --help)."""
    table = documented(doc)
    return {n: table[n] for n in names}


def ray_address() -> str | None:
    """RAY_ADDRESS: the Ray cluster a Ray gallery build joins (unset: a local Ray on this machine)."""
    return read("RAY_ADDRESS", text, None)
