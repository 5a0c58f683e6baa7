"""`python -m evaluator.cohort`: generated ImageNet-like JPEG cohorts and the tiny test checkpoint (evaluator.synthetic.cohort)."""
import sys

from evaluator.synthetic.cohort import main

if __name__ == "__main__":
    sys.exit(main())
