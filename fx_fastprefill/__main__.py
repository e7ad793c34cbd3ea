"""Command line: ``python -m fx_fastprefill explain MODULE:FACTORY [options]``."""

import sys

COMMANDS = ("explain",)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m fx_fastprefill explain MODULE:FACTORY [--prompt-len N] [--format text|json] "
              "[--svg PATH | --png PATH] [--graph]", file=sys.stderr)
        return 2
    from .explain import main as explain
    return explain(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
