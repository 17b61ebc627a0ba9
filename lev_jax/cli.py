"""``lev``: the console script of an installed lev-jax, one subcommand per tool.

    lev serve [--model PATH] [--port 8000] ...     the Jev-compatible HTTP server (= python -m serve)
    lev train ...                                  the training loop (= python -m train)
    lev data build|check|eval|list ...             the training mixture (= python -m data)
    lev bench export|eval|fit|sweep ...            the benchmark harness (= levbench)

``lev SUBCOMMAND --help`` shows a subcommand's own options. A subcommand's module is imported only when
it runs (``lev serve`` never loads the data pipeline); a subcommand whose module is not installed
says so in one line.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["SUBCOMMANDS", "main"]

EXIT_USAGE = 2  # as argparse exits on bad arguments

# name -> (module whose main(argv) runs it, one-line summary)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("lev_jax.server.cli", "the Jev-compatible HTTP server (POST /v1/systemone)"),
    "train": ("lev_jax.training.cli", "the training loop"),
    "data": ("lev_jax.data.cli", "build, check and export the training mixture"),
    "bench": ("lev_jax.bench.cli", "eval sets, calibration fit and the amortisation sweep (as levbench)"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = ["usage: lev {" + ",".join(SUBCOMMANDS) + "} [ARGS ...]", "", "subcommands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    lines += ["", "`lev SUBCOMMAND --help` lists a subcommand's options; `lev --version` prints the version."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(usage(), file=sys.stderr)
        return EXIT_USAGE
    name, rest = argv[0], argv[1:]
    if name in ("-h", "--help", "help"):
        print(usage())
        return 0
    if name == "--version":
        from lev_jax import __version__

        print(f"lev-jax {__version__}")
        return 0
    if name not in SUBCOMMANDS:
        print(
            f"lev: unknown subcommand {name!r} (choose from {', '.join(SUBCOMMANDS)}; see `lev --help`)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only the subcommand's own module being absent is "not available"; a missing dependency deeper
        # down is a broken install and keeps its traceback.
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise
        print(f"lev {name}: not available in this lev-jax ({module_name} is not installed)", file=sys.stderr)
        return EXIT_USAGE
    rc = module.main(rest)
    return 0 if rc is None else rc


if __name__ == "__main__":
    sys.exit(main())
