"""``jaxckpt goodput RUN [--process N] [--json] [--plot out.png]``: what a run's log says
about its goodput (docs/GOODPUT.md)."""

from __future__ import annotations

import argparse
import json

from ..goodput.report import goodput


def command(args: argparse.Namespace) -> int:
    """Prints the report (or its JSON) of ``args.run``; draws its timeline with ``--plot``."""
    report = goodput(args.run, process=args.process)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(report.text(), end="")
    if args.plot:
        from ..goodput.plot import plot

        plot(args.run, args.plot, process=args.process)
    return 0
