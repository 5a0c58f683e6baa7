"""`python -m evaluator.rehearse`: the scored environment rehearsed without Docker (evaluator.rehearsal.rehearse)."""
import sys

from evaluator.rehearsal.rehearse import main

if __name__ == "__main__":
    sys.exit(main())
