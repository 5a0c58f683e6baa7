"""GPU decode through torchvision's nvJPEG binding, for machines without DALI (`nvjpeg`).

Decode on the GPU (`torchvision.io.decode_jpeg(device="cuda")`), then an antialiased
bicubic resize and the crop on the GPU, with sizes and offsets from engine.core.geometry.
Images the GPU decoder does not take (other formats, CMYK, truncated) or rejects go to
the PIL reference on the CPU and are uploaded; nothing stalls on them.
"""
from __future__ import annotations

import sys

import torch

from engine.core.geometry import window
from engine.core.gpu_streams import upload
from engine.core.spec import Spec
from engine.decoders.route import route

_MODES = {"bicubic": "bicubic", "bilinear": "bilinear", "nearest": "nearest"}


def resize_crop_gpu(img: torch.Tensor, spec: Spec) -> torch.Tensor:
    """[3, H, W] uint8 CUDA -> [S, S, 3] uint8, as torchvision's tensor Resize + CenterCrop."""
    h, w = img.shape[-2:]
    win = window(w, h, spec)
    x = img
    if win.resized:
        mode = _MODES[spec.interpolation]
        x = torch.nn.functional.interpolate(img[None].float(), size=(win.resize_h, win.resize_w), mode=mode,
                                            antialias=mode != "nearest", align_corners=None if mode == "nearest"
                                            else False)[0]
        x = x.round_().clamp_(0, 255).to(torch.uint8)  # torchvision rounds uint8 results the same way
    x = x[:, win.top:win.top + win.size, win.left:win.left + win.size]
    return x.permute(1, 2, 0)


class NvjpegDecoder:
    """Batches of encoded images -> [n, S, S, 3] uint8 on the GPU."""

    name = "nvjpeg"

    def __init__(self, spec: Spec, batch_size: int, threads: int | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("nvjpeg decoding needs a CUDA GPU")
        from torchvision.io import ImageReadMode, decode_jpeg

        from engine import settings
        from engine.core.gpu_streams import producer_stream
        from engine.decoders.isolate import reference_decoder
        from engine.threads import budget

        self._decode_jpeg, self._rgb = decode_jpeg, ImageReadMode.RGB
        self.spec = spec
        # the decoder's own stream (the pipeline makes it current and hands each batch over with an
        # event), and a landing stream that only ever holds torchvision's outputs: torchvision
        # allocates them on the caller's stream but writes them from its own stream without waiting
        # for the caller, so a block freed there must carry no queued reader (engine.core.gpu_streams)
        self.stream = producer_stream()
        self._landing = producer_stream()
        # every chroma-subsampled JPEG (most photos) takes this path: the whole CPU budget decodes,
        # in a child process where each image has a deadline (ENGINE_DECODER_ISOLATE)
        self._reference = reference_decoder(spec, batch_size, threads or budget("cuda").decoder,
                                            settings.decoder_isolate())

    def decode(self, blobs: list[bytes | None]):
        n, s = len(blobs), self.spec.input_size
        out = torch.zeros((n, s, s, 3), dtype=torch.uint8, device="cuda")
        # nvJPEG: no CMYK; and torchvision's binding upsamples chroma plainly where the PIL reference
        # (libjpeg-turbo) uses fancy upsampling, so 4:2:0 / 4:2:2 JPEGs decode on the CPU, exactly
        routed, slow, failed = route(blobs, self.spec, modes=("RGB", "L"), subsampled=False)
        fast = [i for i, _ in routed]
        if fast:
            data = [torch.frombuffer(bytearray(blobs[i]), dtype=torch.uint8) for i in fast]
            try:
                imgs = self._decode(data)                                      # list of [3, H, W]
                for i, img in zip(fast, imgs):
                    out[i] = resize_crop_gpu(img, self.spec)
            except RuntimeError as e:
                print(f"[engine] nvjpeg: batch of {len(fast)} failed ({e}); decoding those images with pil",
                      file=sys.stderr)
                slow += fast
        slow = sorted(slow)
        if slow:
            px, f = self._reference.decode([blobs[i] for i in slow])    # [m, S, S, 3] uint8, zeros where failed
            failed.update({slow[k]: why for k, why in f.items()})
            out.index_copy_(0, upload(slow, out.device), upload(px, out.device))   # pinned: no sync
        return out, failed

    def _decode(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """torchvision's batched nvJPEG decode, its outputs landing on `_landing`; the current stream
        waits for them on the device and keeps them alive while its queued kernels read them."""
        here = torch.cuda.current_stream()
        with torch.cuda.stream(self._landing):
            imgs = self._decode_jpeg(data, mode=self._rgb, device="cuda")   # list of [3, H, W] uint8
        here.wait_stream(self._landing)
        for img in imgs:
            img.record_stream(here)
        return imgs

    def close(self) -> None:
        """Stop the reference's child process, if any."""
        if hasattr(self._reference, "close"):
            self._reference.close()


def create(name: str, spec: Spec, batch_size: int, threads: int | None = None) -> NvjpegDecoder:
    return NvjpegDecoder(spec, batch_size, threads)
