"""FP32 means FP32: TF32 off for the matmuls and convolutions of every FP32 graph on CUDA.

torch lets cuDNN convolutions use TF32 by default (`torch.backends.cudnn.allow_tf32`),
and a process may have turned TF32 on for matmuls: the FP32 graphs here (the guard's
re-check, the calibration reference, `evaluator.reference --device cuda`) would then
round their inputs to a 10-bit mantissa, and tau would be calibrated against that. The
frozen FP32 reference answers are taken to be plain IEEE FP32; a reference known to have
run with TF32 is matched with ENGINE_TF32=1. Set once, where a runtime, a build or the
reference starts; the artifact manifest and the run's report record what was set.
"""
from __future__ import annotations


def set_fp32_math(tf32: bool | None = None) -> dict:
    """Set torch's TF32 switches for this process (ENGINE_TF32 when `tf32` is None) and return
    them as recorded: {"tf32_matmul": bool, "tf32_conv": bool}. No effect on CPU math."""
    import torch

    if tf32 is None:
        from engine import settings

        tf32 = settings.tf32()
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    return fp32_math()


def fp32_math() -> dict:
    """torch's TF32 switches as they are now."""
    import torch

    return {"tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "tf32_conv": bool(torch.backends.cudnn.allow_tf32)}
