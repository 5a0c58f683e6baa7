"""What every job shares, below the decoders and the backends: what a model is and how its graph is made.

    spec.py, geometry.py   the spec record (everything that decides a model's numbers); resize and crop windows
                           computed as torchvision does, which every decoder reads
    model.py, checkpoint.py   the graph (normalise, network, top-1) and its weights, read locally
    precision.py, fuse.py     the precision policy (and the precisions a device runs natively), fused layers
    gpu_streams.py         how a GPU producer (a decoder) hands a batch to its consumer (inference)
"""
