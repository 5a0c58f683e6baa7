"""`python -m evaluator.sweep`: precision x batch-size sweep of the contest path (evaluator.contest.sweep)."""
import sys

from evaluator.contest.sweep import main

if __name__ == "__main__":
    sys.exit(main())
