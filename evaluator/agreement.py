"""`python -m evaluator.agreement`: top-1 agreement of predictions with a reference at the contest gate (evaluator.contest.agreement)."""
import sys

from evaluator.contest.agreement import main

if __name__ == "__main__":
    sys.exit(main())
