"""`ffr`: one command for every user task. Each subcommand's --help says what it does.

This is the top of the import graph: each package adds its own commands (`models.cli.commands`,
`coordinator.cli`, `edge_client.cli`, `edge_client.device_cli`, `fleet.cli`) and none of them
imports this module, so imports only run downward.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from models.cli.common import Parser, one_line
from models.faces.datasets import DatasetError

LOGGERS = ("ffr", "models", "edge_client", "coordinator", "protocol")


def command_group(sub, name: str, help: str):
    """`ffr NAME COMMAND ...`: a group of related subcommands."""
    return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".").add_subparsers(
        dest=f"{name}_command", required=True, metavar="COMMAND"
    )


def build_parser(models_only: bool = False) -> argparse.ArgumentParser:
    """Every command; `models_only`: the models' commands alone (`ffr.models_only`), which import no broker, web
    service or signing library."""
    from models.cli import commands as models_cli

    parser = Parser(prog="ffr", description="ffr-edge: federated face recognition for edge devices.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars or info messages")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    models_cli.add_commands(sub)
    if not models_only:
        _add_service_commands(sub)
    return parser


GROUPS = (  # (command, its module, help, the extra that installs what it imports)
    ("coordinator", "coordinator.cli", "the federation coordinator service", "coordinator"),
    ("edge", "edge_client.cli", "the edge device daemon", "edge,coordinator"),
    ("fleet", "fleet.cli", "fleet simulation: partition, simulate, report", "train,coordinator"),
    ("device", "edge_client.device_cli", "enrol, verify and identify people on this device (ONNX only)", "edge"),
)


def _add_service_commands(sub) -> None:
    """Each group from its own package; a group whose libraries this install lacks (a device with only the `edge`
    extra has no pydantic, paho or torch) is still listed, and says which extra brings it instead of failing every
    other command."""
    import importlib

    for name, module, help, extra in GROUPS:
        try:
            add_commands = importlib.import_module(module).add_commands
        except ModuleNotFoundError as exc:
            _missing_group(sub, name, help, extra, exc.name or str(exc))
            continue
        add_commands(command_group(sub, name, help))


def _missing_group(sub, name: str, help: str, extra: str, missing: str) -> None:
    def fail(args) -> int:
        raise ValueError(f"`ffr {name}` needs {missing}, which this install lacks: pip install 'ffr-edge[{extra}]'")

    group = sub.add_parser(name, help=f"{help} (not installed: needs the {extra} extra)", add_help=True)
    group.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    group.set_defaults(func=fail)


def main(argv: list[str] | None = None, models_only: bool = False) -> int:
    parser = build_parser(models_only)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command as typed: resume hints repeat it
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    # MLflow's own INFO lines ("Creating initial MLflow database tables...") only with -v; ffr names the store itself
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "INFO" if args.verbose else "WARNING")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    for name in LOGGERS:
        logging.getLogger(name).setLevel(level)
    try:
        return args.func(args)
    except (DatasetError, ValueError) as exc:
        return _fail(args, one_line(exc))
    except OSError as exc:  # a path that cannot be read or written, a full disk, a refused connection: not a bug
        return _fail(args, _os_error(exc))
    except KeyboardInterrupt:
        _end_progress_bars()
        print(f"{_name(args)}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug is one line too; -v shows where
        if args.verbose:
            raise
        return _fail(args, f"unexpected {type(exc).__name__}: {one_line(exc)} (run with -v for the traceback)")


def _os_error(exc: OSError) -> str:
    """'Not a directory: /etc/passwd/x' rather than '[Errno 20] Not a directory: ...' (a message of ours as is)."""
    if exc.filename is None or not exc.strerror:
        return one_line(exc)
    return f"{exc.strerror}: {exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 else "")


def _name(args) -> str:
    sub = getattr(args, f"{args.command}_command", None)
    return f"ffr {args.command}{' ' + sub if sub else ''}"


def _fail(args, message: str) -> int:
    """The one error convention: `ffr COMMAND: error: ...` on its own line on stderr, exit 2; with --json, also a
    JSON object with an `error` field on stdout."""
    _end_progress_bars()
    if getattr(args, "json", False):
        import json

        print(json.dumps({"error": message, "command": _name(args)}), flush=True)
    print(f"{_name(args)}: error: {message}", file=sys.stderr)
    return 2


def _end_progress_bars() -> None:
    """A progress bar left open by the error would otherwise share its line with the message."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    bars = list(getattr(tqdm, "_instances", []))
    for bar in bars:
        bar.close()
    if bars:
        sys.stderr.write("\n")  # a bar that is not kept ends with a carriage return, not a new line
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
