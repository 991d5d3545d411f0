"""How blockctl prints a report: ``-o, --output-format normal|json`` as nvme-cli spells it.

``normal`` is the human text each verb has always printed; ``json`` is one JSON document on
stdout (``blockctl iostat`` prints one per interval, a line each). Where nvme-cli has the same
report (``discover``, ``id-ctrl``, ``id-ns``, ``list``) the JSON uses nvme-cli's field names and
value forms (:mod:`blockd.cli.nvme_json`), so a script written for ``nvme ... -o json`` reads
ours; the other verbs' JSON is the daemon's own reply (docs/operations.md lists both).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

FORMATS = ("normal", "json")


def add_format_flag(parser: argparse.ArgumentParser, json_alias: bool = False) -> None:
    """``-o/--output-format`` on ``parser``; ``json_alias`` keeps the older ``--json`` (the
    target verbs had it before ``-o``) as a spelling of ``-o json``."""
    parser.add_argument("-o", "--output-format", dest="output_format", choices=FORMATS, default="normal",
                        help="output format: normal (text) or json (default normal)")
    if json_alias:
        parser.add_argument("--json", dest="output_format", action="store_const", const="json",
                            help="the same as -o json")


def wants_json(args: argparse.Namespace) -> bool:
    return getattr(args, "output_format", "normal") == "json"


def print_json(doc: Any, *, lines: bool = False) -> None:
    """``doc`` on stdout: indented as nvme-cli's, or on one line (``lines``: a stream of them)."""
    if lines:
        print(json.dumps(doc), flush=True)
    else:
        json.dump(doc, sys.stdout, indent=2)
        print()


def emit(args: argparse.Namespace, doc: Any, text: Callable[[], str]) -> None:
    """The report in the format asked for: ``doc`` as JSON, or ``text()``."""
    if wants_json(args):
        print_json(doc)
    else:
        print(text())
