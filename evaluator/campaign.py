"""`python -m evaluator.campaign`: evidence campaigns: run, verify, package, render (evaluator.evidence.campaign)."""
import sys

from evaluator.evidence.campaign import main

if __name__ == "__main__":
    sys.exit(main())
