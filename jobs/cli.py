"""The `esp-batch` console script: `esp-batch generate [CONFIG.yaml] [key=value ...]`."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

USAGE = """\
usage: esp-batch <command> [args]

commands:
  generate [CONFIG.yaml] [key=value ...] [--print-config]
            run or resume a generation job (same as python -m jobs.generate)

run `esp-batch generate --help` for the options.
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0 if args else 2
    if args[0] != "generate":
        sys.stderr.write(f"esp-batch: error: unknown command {args[0]!r}\n{USAGE}")
        return 2
    from .generate import main as generate

    return generate(args[1:])


if __name__ == "__main__":
    sys.exit(main())
