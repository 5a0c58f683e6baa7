"""`python -m evaluator.score_retrieval`: CIRCO / CIRR scoring of a retrieval results file (evaluator.cir.score)."""
import sys

from evaluator.cir.score import main

if __name__ == "__main__":
    sys.exit(main())
