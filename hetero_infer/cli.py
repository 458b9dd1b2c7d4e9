"""`hetero-infer` command line: the entry point (`python -m hetero_infer.cli`, the
`hetero-infer` script). Its subcommands are hetero_infer.commands, imported only once a
Ctrl-C is caught: this module imports nothing else at its top, so that Ctrl-C at any
point of start-up (the imports of grpc, the planes' configs, torch) ends the command
quietly with status 130, as one later does, not with a KeyboardInterrupt traceback."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run `hetero-infer ARGV` (default: sys.argv[1:]); its exit status."""
    try:
        from hetero_infer.commands import run

        return run(argv)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
