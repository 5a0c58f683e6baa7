"""`python -m evaluator.provenance`: SHA-256 and origin of every file of an artifact (evaluator.rehearsal.provenance)."""
import sys

from evaluator.rehearsal.provenance import main

if __name__ == "__main__":
    sys.exit(main())
