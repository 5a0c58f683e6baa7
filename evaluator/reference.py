"""`python -m evaluator.reference`: the naive FP32 reference path (PIL + timm eager, batch 1) (evaluator.contest.reference)."""
import sys

from evaluator.contest.reference import main

if __name__ == "__main__":
    sys.exit(main())
