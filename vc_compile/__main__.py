"""``python -m vc_compile <command>``.

    tune    pre-tune the attention kernel of a method for a shape (see ``vc_compile/tune_cli.py``)

(The demo is ``python -m vc_compile.demo``.)
"""
from __future__ import annotations

import sys

COMMANDS = {"tune": "pre-tune the attention kernels of a method for a shape and print the chosen configs"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:6s} {what}" for name, what in COMMANDS.items()]
        msg = "usage: python -m vc_compile <command> [options]\n\ncommands:\n" + "\n".join(lines)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"vc_compile: unknown command {argv[0]!r}\n\n{msg}", file=sys.stderr)
            return 2
        print(msg, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    from vc_compile.tune_cli import main as tune_main

    return tune_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
