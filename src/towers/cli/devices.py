"""``towers devices``: the devices, the torch version and the distributed backends of this machine."""

from __future__ import annotations

import argparse

__all__ = ["add_devices_parser", "run_devices"]


def add_devices_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("devices", help="list devices, the torch version and distributed backends")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run_devices)


def run_devices(args: argparse.Namespace) -> int:
    import json

    from towers.devices import describe_devices, format_devices

    report = describe_devices()
    print(json.dumps(report, indent=2) if args.json else format_devices(report))
    return 0
