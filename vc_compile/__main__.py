"""``python -m vc_compile <command>`` (also installed as ``vc-compile``).

    tune    pre-tune the attention kernel of a method for a shape (see ``vc_compile/tune_cli.py``)
    warmup  build the kernels of the usual layouts into Triton's on-disk cache (``vc_compile/prebuild/warmup.py``)
    demo    the demo (``python -m vc_compile.demo``, the same options)

``--version`` and ``--help`` import neither torch nor triton.
"""
from __future__ import annotations

import sys

COMMANDS = {"tune": "pre-tune the attention kernels of a method for a shape and print the chosen configs",
            "warmup": "build the kernels of the usual attention layouts into Triton's on-disk cache (GPU, once)",
            "demo": "a clip from the shipped video DiT with every method side by side (python -m vc_compile.demo)"}


def usage() -> str:
    lines = [f"  {name:6s} {what}" for name, what in COMMANDS.items()]
    return ("usage: python -m vc_compile [--version] <command> [options]\n\ncommands:\n" + "\n".join(lines)
            + "\n\n'python -m vc_compile <command> --help' for a command's options")


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
    if argv[0] == "warmup":
        return warmup(argv[1:])
    if argv[0] == "demo":
        from vc_compile.demo.__main__ import main as demo_main

        demo_main(argv[1:])
        return 0
    from vc_compile.tune_cli import main as tune_main

    return tune_main(argv[1:])


def warmup(argv) -> int:
    import argparse

    from vc_compile.methods import warmup_variants
    from vc_compile.prebuild.warmup import PLANS, warmup as run

    METHODS = warmup_variants()

    p = argparse.ArgumentParser(prog="python -m vc_compile warmup",
                                description="Build the kernels of the supported pipelines' attention layouts into "
                                            "Triton's on-disk cache (once per machine and toolchain, on the GPU).")
    p.add_argument("--plan", default="default", choices=sorted(PLANS),
                   help="which layouts: default = Wan 2.1 1.3B 480p, 14B 720p and 480p; small = 1.3B 480p")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {sorted(METHODS)}")
    a = p.parse_args(argv)
    try:
        res = run(a.plan, [m for m in a.methods.split(",") if m], progress=lambda line: print(line, flush=True))
    except (RuntimeError, ValueError) as e:
        print(str(e), file=sys.stderr)
        return 2
    print(f"vc_compile warmup: {res['built']} kernels built in {res['jobs']} jobs, {res['cached']} found built, "
          f"{res['s']} s -> {res['cache']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
