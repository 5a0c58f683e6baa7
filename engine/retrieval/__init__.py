"""Composed image retrieval: a gallery index built with a CLIP, and queries of (reference image,
modification text) answered against it.

    import engine.retrieval

    idx = engine.retrieval.open_index(INDEX_DIR)          # clip_dir=None: CLIP_MODEL_DIR, else the index's own
    idx.search(reference_image_id, "make it red", shared_concept=None, k=50, method="slerp")
    idx.search_many(requests)                             # request objects as the requests JSONL holds them

Modules: index (the on-disk format), gallery (embedding a gallery into one), extras
(build-time Pic2Word, text bank, DBA rows), query (the query pipeline), search (this API),
index_clip (finding the CLIP an index was built with), jsonl (records and requests), and
the pieces they use (compose, gap, rescore, reinspect, pic2word, embed). Importing this
package loads neither torch nor numpy; open_index does.
"""
from __future__ import annotations


def open_index(index_dir, clip_dir=None, **options):
    """engine.retrieval.search.open_index: the index in `index_dir` with its CLIP loaded; options:
    device, precision, model_name, corpus, confine_to_corpus, allow_model_mismatch, batch_size."""
    from engine.retrieval.search import open_index as open_searcher

    return open_searcher(index_dir, clip_dir, **options)
