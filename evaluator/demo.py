"""`python -m evaluator.demo`: the main job on the embedded default: cohort, artifact, ABI, agreement, timing (evaluator.contest.demo)."""
import sys

from evaluator.contest.demo import main

if __name__ == "__main__":
    sys.exit(main())
