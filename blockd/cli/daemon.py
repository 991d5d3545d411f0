"""``blockd target --config FILE`` and ``blockd initiator``: the two daemons, in the foreground.

Signals: SIGTERM/SIGINT drain in-flight I/O, flush and exit 0 (1 when a namespace's final flush
failed); SIGHUP reloads the target's configuration (a bad new file is logged and the old configuration stays).

An entry point on top of the layers: only ``blockd/cli/`` may import ``target/`` and
``initiator/`` from ``blockd/`` (``tests/test_layers.py``), and nothing imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import structlog

from blockd import dataplane, eventloop
from blockd import log as blog
from blockd.config import ConfigError
from target.config import load
from blockd.sdnotify import Notifier

log = structlog.get_logger("blockd")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("blockd")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _data_plane_line() -> None:
    """The start-up line saying which data plane runs, and why the Python one when it does (a
    warning unless asked for: a missing extension costs speed)."""
    if dataplane.COMPILED:
        log.info(dataplane.DATA_PLANE)
    elif dataplane.FORCED_PURE:
        log.info(dataplane.DATA_PLANE, reason=dataplane.REASON)
    else:
        log.warning(dataplane.DATA_PLANE, reason=dataplane.REASON)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockd", description="NVMe over Fabrics target and initiator daemons")
    parser.add_argument("--version", action="version", version=f"blockd {_version()}, {dataplane.DATA_PLANE}")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("target", help="run the NVMe-oF target")
    t.add_argument("--config", "-c", default="/etc/blockd/target.toml", help="TOML configuration file")
    t.add_argument("--log-format", choices=("console", "json"), help="overrides [logging] format")
    t.add_argument("--log-level", help="overrides [logging] level")
    i = sub.add_parser("initiator", help="run the initiator daemon that blockctl talks to")
    i.add_argument("--socket", help="control socket (default /run/blockd/initiator.sock)")
    i.add_argument("--config", "-c", help="TOML file of connections to make at start (e.g. /etc/blockd/initiator.toml)")
    i.add_argument("--log-format", choices=("console", "json"), default="console")
    i.add_argument("--log-level", default="info")
    return parser


async def run_target(config_path: str, log_format: str | None, log_level: str | None) -> int:
    from initiator.replica import open_remote
    from target.service import TargetService

    config = load(config_path)
    blog.setup(log_format or config.log_format, log_level or config.log_level)
    _data_plane_line()
    service = TargetService(config, open_replica=open_remote)  # replicas are reached with the host library
    notify = Notifier.from_env(unset=True)
    try:
        await service.start()
    except (RuntimeError, OSError) as exc:
        log.error("cannot start the target", error=str(exc))
        notify.status(f"cannot start: {exc}")
        await service.stop()
        return 1
    log.info("target ready", status=service.describe())
    # systemd Type=notify: every namespace is open and every port listens by now
    notify.ready(service.describe())
    notify.start_watchdog()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    async def reload() -> None:
        notify.reloading()
        try:
            await service.reload(load(config_path))
        except (ConfigError, RuntimeError, OSError) as exc:
            log.error("reload failed; keeping the previous configuration", error=str(exc))
        notify.ready(service.describe())

    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(reload()))
    await stop.wait()
    log.info("stopping: draining in-flight I/O")
    notify.stopping()
    failed = await service.stop()
    notify.close()
    return 1 if failed else 0  # systemd shows the unit failed: some data may not be durable


async def run_initiator(socket: str | None, config_path: str | None = None) -> int:
    from initiator.boot import BootConnections
    from initiator.config import load as load_initiator
    from initiator.daemon import InitiatorDaemon

    config = load_initiator(config_path) if config_path else None
    notify = Notifier.from_env(unset=True)
    daemon = InitiatorDaemon(socket, config.metrics if config else None)
    await daemon.start()
    boot = BootConnections(daemon, config, notify.status) if config else None
    if boot:
        boot.start()
    notify.ready(boot.summary() if boot else "listening on " + daemon.path)
    notify.start_watchdog()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    notify.stopping("stopping: disconnecting")
    if boot:
        await boot.stop()
    await daemon.stop()
    notify.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "target":
            return eventloop.run(run_target(args.config, args.log_format, args.log_level))
        blog.setup(args.log_format, args.log_level)
        _data_plane_line()
        return eventloop.run(run_initiator(args.socket, args.config))
    except ConfigError as exc:
        print(f"blockd: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"blockd: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
