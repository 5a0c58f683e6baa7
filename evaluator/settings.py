"""The evaluator's environment switches (the ABIs' defaults), read once through engine.settings.

| variable | default | what it sets |
|---|---|---|
| CONTEST_MANIFEST | /contest/input/manifest.tsv | scripts/run's MANIFEST |
| CONTEST_IMAGE_ROOT | /contest/input/images | scripts/run's IMAGE_ROOT |
| CONTEST_OUTPUT | /contest/output/predictions.i32 | scripts/run's OUTPUT |
| CONTEST_REPORT | (none) | where scripts/run writes its timing JSON |
| CONTEST_CONFINE | 0 | 1: scripts/run --confine (image paths must stay inside IMAGE_ROOT's real path: untrusted inputs) |
| CIR_METHOD | the index's, else slerp | scripts/build.sh / run.sh --method |
| CIR_TEXT_WEIGHT | per method | scripts/run.sh --text-weight: a number in [0, 1] |
| CIR_PROMPT | auto | scripts/run.sh --prompt |
| CIR_CORPUS | the index's | scripts/run.sh --corpus (records for re-inspection) |
| REHEARSE_RUN_CMD | scripts/run | the command scripts/rehearse runs as the entry point |
| XDG_CACHE_HOME | ~/.cache | python -m evaluator.rehearsal.image --arch aarch64: the user's cache, where its emulated root and wheels are kept |
| ENGINE_CHECKPOINT | /checkpoint/model.safetensors | ./build.sh: the checkpoint file |
| ENGINE_MODEL | the checkpoint's record, else evaluator/contest/task.py's | ./build.sh: timm name, decides the spec |
| ENGINE_PRECISION | the device's preset (engine/presets/classification.py) | ./build.sh: auto, fp32, bf16, fp16 or fp8 (auto: the fastest native precision here that holds the guard's budget, measured) |
| ENGINE_BATCH_SIZE | the device's preset | ./build.sh: auto or a static batch (auto: the fastest of the preset's candidates) |
| ENGINE_BACKEND | the device's preset | ./build.sh: auto or a backend of engine/backends (auto: the fastest that builds here) |
| ENGINE_DEVICE | auto | ./build.sh: auto, cuda or cpu (auto: cuda when torch sees a GPU) |
| ENGINE_INPUT_SIZE | the checkpoint's record, else the model's | ./build.sh spec override: input size in px |
| ENGINE_CROP_MODE | the checkpoint's record, else the model's | ./build.sh spec override: center or squash |
| ENGINE_CROP_PCT | the checkpoint's record, else the model's | ./build.sh spec override: crop fraction |
| ENGINE_MODEL_KWARGS | the checkpoint's record, else none | ./build.sh spec override: timm kwargs as JSON |
| ENGINE_BUILD_DEADLINE_S | the device's preset (engine/presets/classification.py `build_deadline_s`) | ./build.sh: seconds, in (0, 86400], for the whole step (the build's phases, then the one-image check); past it the build keeps its best verified candidate, else eager FP32 |
| FORCE | 0 | ./build.sh: 1 rebuilds even when the artifact is current |
| PYTHON | python3 | ./build.sh: the interpreter (read by the shell script) |
"""
from __future__ import annotations

from pathlib import Path

from engine.settings import choice, flag, number_in, path, read, text


def contest_manifest() -> Path:
    return read("CONTEST_MANIFEST", path, Path("/contest/input/manifest.tsv"))


def contest_image_root() -> Path:
    return read("CONTEST_IMAGE_ROOT", path, Path("/contest/input/images"))


def contest_output() -> Path:
    return read("CONTEST_OUTPUT", path, Path("/contest/output/predictions.i32"))


def contest_report() -> Path | None:
    return read("CONTEST_REPORT", path, None)


def contest_confine() -> bool:
    return read("CONTEST_CONFINE", flag, False)


def cir_method() -> str | None:
    return read("CIR_METHOD", text, None)


def cir_text_weight() -> float | None:
    return read("CIR_TEXT_WEIGHT", number_in(0.0, 1.0), None)


def cir_prompt() -> str | None:
    return read("CIR_PROMPT", text, None)


def cir_corpus() -> Path | None:
    return read("CIR_CORPUS", path, None)


def rehearse_run_cmd() -> str | None:
    return read("REHEARSE_RUN_CMD", text, None)


def user_cache_home() -> Path:
    return read("XDG_CACHE_HOME", path, Path.home() / ".cache")


def build_checkpoint() -> Path:
    return read("ENGINE_CHECKPOINT", path, Path("/checkpoint/model.safetensors"))


def build_device() -> str:
    return read("ENGINE_DEVICE", choice("auto", "cuda", "cpu"), "auto")


def build_deadline_s() -> float | None:
    """ENGINE_BUILD_DEADLINE_S: seconds for ./build.sh's whole step (None: the device preset's)."""
    return read("ENGINE_BUILD_DEADLINE_S", number_in(0.0, 86400.0, open_low=True), None)


def build_force() -> bool:
    return read("FORCE", choice("0", "1"), "0") == "1"


def build_knob(name: str) -> str | None:
    """A ./build.sh knob that becomes an engine.build flag, as text (None: unset); engine.build's
    parser checks it (evaluator.contest.build_step names the knob in its refusal)."""
    if name not in BUILD_FLAG_KNOBS:
        raise KeyError(f"{name} is not a build knob")
    return read(name, text, None)


# the ./build.sh knobs that are engine.build flags, in the order its log line names them
BUILD_FLAG_KNOBS = ("ENGINE_MODEL", "ENGINE_PRECISION", "ENGINE_BATCH_SIZE", "ENGINE_BACKEND", "ENGINE_INPUT_SIZE",
                    "ENGINE_CROP_MODE", "ENGINE_CROP_PCT", "ENGINE_MODEL_KWARGS")
# every variable ./build.sh reads, in the order its --help lists them
BUILD_ENV = ("ENGINE_CHECKPOINT", "ENGINE_MODEL", "ENGINE_PRECISION", "ENGINE_BATCH_SIZE", "ENGINE_BACKEND",
             "ENGINE_DEVICE", "ENGINE_ARTIFACT", "ENGINE_INPUT_SIZE", "ENGINE_CROP_MODE", "ENGINE_CROP_PCT",
             "ENGINE_MODEL_KWARGS", "ENGINE_BUILD_DEADLINE_S", "FORCE", "ENGINE_DEBUG", "PYTHON")


# every variable scripts/run reads, in the order its --help lists them
RUN_ENV = ("CONTEST_MANIFEST", "CONTEST_IMAGE_ROOT", "CONTEST_OUTPUT", "CONTEST_REPORT", "CONTEST_CONFINE",
           "ENGINE_ARTIFACT", "ENGINE_DECODER", "ENGINE_CUDA_GRAPHS", "ENGINE_TF32", "ENGINE_GUARD", "ENGINE_ARTIFACT_VERIFY",
           "ENGINE_PIPELINE_DEPTH",
           "ENGINE_THREADS", "ENGINE_READERS", "ENGINE_DECODER_ISOLATE", "ENGINE_MAX_FILE_BYTES", "ENGINE_FAST_EXIT",
           "ENGINE_DECODE_DEADLINE_S", "ENGINE_MAX_PIXELS", "ENGINE_READAHEAD_BYTES", "ENGINE_HW_DECODER_LOAD",
           "ENGINE_SLOW_DECODER_OK", "ENGINE_INT8", "ENGINE_T0", "ENGINE_PROGRESS", "ENGINE_DEBUG", "OMP_WAIT_POLICY", "TMPDIR")
RUN_ENV += ("ENGINE_FP8_TORCHAO",)   # an fp8-torchao artifact's GEMMs (engine.core.fp8_torchao)


def env_help(names: tuple[str, ...]) -> dict[str, str]:
    """{variable: "what (default: D)"} for `names`, from this module's table and engine.settings'."""
    from engine.settings import env_help as engine_env_help

    return engine_env_help(names, __doc__)
