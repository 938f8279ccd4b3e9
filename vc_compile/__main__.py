"""``python -m vc_compile <command>`` (also installed as ``vc-compile``).

    tune    pre-tune the attention kernel of a method for a shape (see ``vc_compile/tune_cli.py``)

``--version`` and ``--help`` import neither torch nor triton. (The demo is ``python -m vc_compile.demo``.)
"""
from __future__ import annotations

import sys

COMMANDS = {"tune": "pre-tune the attention kernels of a method for a shape and print the chosen configs"}


def usage() -> str:
    lines = [f"  {name:6s} {what}" for name, what in COMMANDS.items()]
    return ("usage: python -m vc_compile [--version] <command> [options]\n\ncommands:\n" + "\n".join(lines)
            + "\n\n'python -m vc_compile <command> --help' for a command's options; the demo is "
              "'python -m vc_compile.demo'")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        from vc_compile._version import __version__

        print(f"vc_compile {__version__}")
        return 0
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        if argv:
            print(f"vc_compile: unknown command {argv[0]!r}\n", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    from vc_compile.tune_cli import main as tune_main

    return tune_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
