"""Classification: load an artifact and run it.

    classifier.py     engine.load's Classifier: the artifact, its decoder, its runtime; classify, report
    artifact.py       an artifact folder read and checked (manifest, digests, versions)
    runtime.py, pipeline.py, gpu_streams.py   the graph run in batches; reading, decoding and inference overlapped
    spec.py, model.py, checkpoint.py   what a model is, its graph (normalise, network, top-1), its weights
    precision.py, fuse.py, guard.py, tf32_off.py   below FP32: the policy, fused layers, the guard; FP32 kept FP32
    geometry.py       resize and crop windows computed as torchvision does
"""
