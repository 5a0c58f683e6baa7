"""`python -m evaluator.cir_corpus`: a generated retrieval corpus, requests, labels and tiny CLIP (evaluator.synthetic.cir_corpus)."""
import sys

from evaluator.synthetic.cir_corpus import main

if __name__ == "__main__":
    sys.exit(main())
