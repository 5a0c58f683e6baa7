"""`python -m engine.presets`: both tables of defaults on stdout (it takes no arguments but --help)."""
from __future__ import annotations

from engine.presets import tables


def main(argv: list[str] | None = None) -> int:
    """Print both tables (Markdown, as the docs show them); only --help is accepted."""
    from engine.cli import ArgumentParser

    ArgumentParser(prog="python -m engine.presets", description="Print the defaults as Markdown tables: the "
                   "classification build's, one column per device (docs/classification.md), then the retrieval "
                   "engine's (docs/retrieval.md).").parse_args(argv)
    print(tables())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
