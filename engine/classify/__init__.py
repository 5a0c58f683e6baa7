"""Classification: load an artifact and run it.

    classifier.py     engine.load's Classifier: the artifact, its decoder, its runtime; classify, report
    artifact.py       an artifact folder read and checked (manifest, digests, versions)
    runtime.py, pipeline.py   the graph run in batches; reading, decoding and inference overlapped
    guard.py, tf32_off.py     below FP32: the margin guard; FP32 kept FP32

The spec, the graph, its weights and its precision policy are engine.core's (the decoders and
the backends read them too).
"""
