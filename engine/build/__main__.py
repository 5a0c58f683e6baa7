"""`python -m engine.build`: the build command (engine.build.command)."""
import sys

from engine.build.command import main

sys.exit(main())
