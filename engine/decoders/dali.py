"""DALI decode + resize + crop, on the CPU (`dali-cpu`) or with nvJPEG (`dali-gpu`).

Sizes and crop offsets come from engine.core.geometry (torchvision's arithmetic), fed per
sample, so only the resampling kernel differs from the reference: decoding is
bit-exact with PIL's libjpeg-turbo on the CPU. Images DALI cannot match (non-JPEG
formats, JPEGs whose marker structure engine.decoders.route does not accept) or that
make a batch fail go to the PIL reference. DALI documents a pipeline that raised as
being in an undefined state: it is discarded and a fresh one built before the next batch.
"""
from __future__ import annotations

import sys

import numpy as np

from engine.core.spec import Spec
from engine.decoders.pil import PilDecoder
from engine.decoders.route import route

ISOLABLE = ("dali-cpu",)   # host output: may run in a child process (engine.decoders.isolate)
FAST_BATCH = -1            # progress() position while DALI decodes the routed batch (isolate's deadline)


class DaliDecoder:
    """Batches of encoded images -> [n, S, S, 3] uint8 (host numpy, or a CUDA tensor for gpu)."""

    def __init__(self, spec: Spec, batch_size: int, threads: int | None = None, device: str = "cpu",
                 hw_decoder_load: float | None = None):
        """hw_decoder_load: share of the GPU decode on the hardware JPEG engine (ENGINE_HW_DECODER_LOAD)."""
        if device not in ("cpu", "gpu"):
            raise ValueError(f"device must be cpu or gpu, got {device!r}")
        from engine import settings
        from engine.threads import budget

        self.spec, self.batch_size, self.device = spec, batch_size, device
        self.threads = threads or budget().decoder
        self.hw_decoder_load = settings.hw_decoder_load() if hw_decoder_load is None else hw_decoder_load
        self.name = f"dali-{device}"
        # the reference for the images routed away from DALI. On the CPU (in its own process by
        # default) DALI's workers already hold the thread budget: one PIL thread. Beside a GPU
        # decoder the CPU threads are free, and PIL runs in a child, each image under the deadline
        if device == "cpu":
            self._reference = PilDecoder(spec, batch_size, 1)
        else:
            from engine.decoders.isolate import reference_decoder

            self._reference = reference_decoder(spec, batch_size, self.threads, settings.decoder_isolate())
        # gpu: all its device work on a stream of its own, handed over with an event (engine.core.gpu_streams);
        # _copied: the event after the last copy out of DALI's output, which DALI reuses at its next run
        self.stream = None
        self._copied = None
        self._pipe = self._build()     # first: without a GPU this is what fails, saying why
        if device == "gpu":
            from engine.core.gpu_streams import producer_stream

            self.stream = producer_stream()

    def _build(self):
        from nvidia.dali import fn, pipeline_def, types

        s = self.spec.input_size
        interp = {"bicubic": types.INTERP_CUBIC, "bilinear": types.INTERP_LINEAR,
                  "nearest": types.INTERP_NN}[self.spec.interpolation]
        gpu = self.device == "gpu"
        # one batch is fed and run at a time: on the CPU the asynchronous executor would only add
        # two threads (the overlap comes from the pipeline's decode thread)
        sync = {} if gpu else {"exec_async": False, "exec_pipelined": False}

        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads,
                      device_id=0 if gpu else None, prefetch_queue_depth=1, **sync)
        def pipe():
            enc = fn.external_source(name="enc", dtype=types.UINT8)
            size = fn.external_source(name="size", dtype=types.FLOAT)     # [2] (h, w) after resize
            anchor = fn.external_source(name="anchor", dtype=types.INT64)  # [2] (top, left) of the crop
            if gpu:
                img = fn.decoders.image(enc, device="mixed", output_type=types.RGB, adjust_orientation=False,
                                        hw_decoder_load=self.hw_decoder_load, jpeg_fancy_upsampling=True)
            else:
                img = fn.decoders.image(enc, device="cpu", output_type=types.RGB, adjust_orientation=False)
            # antialiased cubic on downscales, like PIL's resize
            img = fn.resize(img, size=size, interp_type=interp, antialias=True, dtype=types.UINT8)
            img = fn.slice(img, anchor, fn.constant(idata=[s, s], dtype=types.INT64), axes=[0, 1])
            return img

        p = pipe()
        p.build()
        return p

    def decode(self, blobs: list[bytes | None], progress=None):
        """Returns (batch [n, S, S, 3] uint8, {index: reason} for images nothing could read).
        `progress(position)`: called with FAST_BATCH before DALI runs, then with each index the
        reference takes up (the isolated child reports them, for a deadline per image)."""
        n = len(blobs)
        routed, slow, failed = route(blobs, self.spec)
        fast = [i for i, _ in routed]
        sizes = [np.array([w.resize_h, w.resize_w], np.float32) for _, w in routed]   # [2] per image
        anchors = [np.array([w.top, w.left], np.int64) for _, w in routed]            # [2] per image

        out = self._empty(n)
        if fast and self._pipe is None:
            slow += fast  # no pipeline could be rebuilt: the reference decodes everything
        elif fast:
            if progress is not None:
                progress(FAST_BATCH)
            try:
                got = self._run([blobs[i] for i in fast], sizes, anchors)
            except Exception as e:  # noqa: BLE001 - DALI fails whole batches; redo them one by one
                first = (str(e).strip().splitlines() or [""])[-1][:200]
                print(f"[engine] {self.name}: batch of {len(fast)} failed ({type(e).__name__}: {first}); "
                      "decoding those images with pil and rebuilding the pipeline", file=sys.stderr)
                self._rebuild()
                slow += fast
                got = None
            if got is not None:
                if self.device == "gpu":
                    self._merge_gpu(got, fast, out)
                else:
                    out[fast] = got
        slow = sorted(slow)
        if slow:
            sub = [blobs[i] for i in slow]
            if progress is None:
                px, f = self._reference.decode(sub)                   # [m, S, S, 3] uint8, zeros where failed
            else:
                px, f = self._reference.decode(sub, lambda k: progress(slow[k]))
            failed.update({slow[k]: why for k, why in f.items()})
            if self.device == "gpu":
                from engine.core.gpu_streams import upload

                out.index_copy_(0, upload(slow, out.device), upload(px, out.device))   # pinned: no sync
            else:
                out[slow] = px
        return out, failed

    def close(self) -> None:
        """Stop the reference's child process, if any."""
        if hasattr(self._reference, "close"):
            self._reference.close()

    def _rebuild(self) -> None:
        """Drop the pipeline that raised (undefined state) and build a fresh one; if that fails,
        say so and leave every later image to the reference decoder."""
        self._pipe = None
        try:
            self._pipe = self._build()
        except Exception as e:  # noqa: BLE001 - out of memory, driver error: the reference still works
            print(f"[engine] {self.name}: cannot rebuild the pipeline ({type(e).__name__}: {e}); "
                  "decoding the rest with pil", file=sys.stderr)

    def _empty(self, n: int):
        s = self.spec.input_size
        if self.device == "gpu":
            import torch

            return torch.zeros((n, s, s, 3), dtype=torch.uint8, device="cuda")
        return np.zeros((n, s, s, 3), np.uint8)

    def _run(self, blobs, sizes, anchors):
        p = self._pipe
        if self._copied is not None:
            # the last batch's copy out of DALI's buffer (queued on this decoder's own stream, which
            # never waits for inference) must be done before DALI may reuse that buffer
            self._copied.synchronize()
            self._copied = None
        p.feed_input("enc", [np.frombuffer(b, np.uint8) for b in blobs])
        p.feed_input("size", sizes)
        p.feed_input("anchor", anchors)
        (res,) = p.run()
        if self.device == "gpu":
            return res  # TensorListGPU, converted in _merge_gpu
        return res.as_array()  # [m, S, S, 3] uint8

    def _merge_gpu(self, tl, idx, out):
        """DALI's output rows -> rows `idx` of `out`, on the current stream (the decoder's own, set
        by the pipeline): no host wait here; `_run` waits for the copy before DALI's next run."""
        import torch
        from nvidia.dali.plugin.pytorch import feed_ndarray

        from engine.core.gpu_streams import upload

        stream = torch.cuda.current_stream()
        whole = list(idx) == list(range(out.shape[0]))
        s = self.spec.input_size
        got = out if whole else torch.empty((len(idx), s, s, 3), dtype=torch.uint8, device=out.device)
        feed_ndarray(tl.as_tensor(), got, cuda_stream=stream)        # [m, S, S, 3], async on `stream`
        self._copied = torch.cuda.Event()
        self._copied.record(stream)
        if not whole:
            out.index_copy_(0, upload(idx, out.device), got)


def create(name: str, spec: Spec, batch_size: int, threads: int | None = None) -> DaliDecoder:
    """`dali-cpu` or `dali-gpu` for `spec`'s geometry."""
    return DaliDecoder(spec, batch_size, threads, device=name.split("-", 1)[1])
