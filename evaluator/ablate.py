"""`python -m evaluator.ablate`: retrieval methods compared on labelled validation data (evaluator.cir.ablate)."""
import sys

from evaluator.cir.ablate import main

if __name__ == "__main__":
    sys.exit(main())
