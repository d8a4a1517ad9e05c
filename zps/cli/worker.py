"""``zps-worker MODULE:FUNCTION``: run a training function with a connected client,
beside it the systemd notifications and watchdog, the metrics endpoint and the stop
grace period.

Exit codes: 0 done, 1 an error, 2 bad arguments or configuration,
:data:`EXIT_JOB_FAILED` the job failed, :data:`EXIT_STOP_TIMEOUT` a stop request
ignored, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import keyword
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

from zps.cli.common import add_common, add_version, run_async, settings_of, setup_logging
from zps.errors import ConfigError, JobFailedError, ZpsError
from zps.ops import malloc
from zps.ops.config import ClientConfig, Metrics, Settings, WorkerConfig, override
from zps.ops.systemd import Notifier, client_stall

log = logging.getLogger("zps")


def load_function(spec: str) -> Callable[..., Any]:
    """Import ``MODULE:FUNCTION`` (the current directory is on the path)."""
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise ConfigError(f"expected MODULE:FUNCTION, got {spec!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"cannot import module {module_name!r}: {e}") from e
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"module {module_name!r} has no function {func_name!r}")
    return cast(Callable[..., Any], func)


def keyword_args(items: Sequence[str]) -> dict[str, Any]:
    """zps-worker's ``--arg NAME=VALUE`` items as keyword arguments: each VALUE is read
    as JSON (``0.1``, ``3``, ``true``, ``[64, 32]``, ``"3"``), and one that is not JSON
    is kept as the string it is (``--arg data=/srv/adult.csv``).  Raises
    :class:`~zps.errors.ConfigError` naming an item without ``=``, a NAME that is not
    an identifier, or a NAME given twice."""
    kwargs: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.isidentifier() or keyword.iskeyword(name):
            raise ConfigError(
                f"--arg {item!r}: expected NAME=VALUE, NAME a Python identifier (lr=0.1)"
            )
        if name in kwargs:
            raise ConfigError(f"--arg {name} is given twice")
        try:
            kwargs[name] = json.loads(text)
        except ValueError:
            kwargs[name] = text
    return kwargs


def check_arguments(
    func: Callable[..., Any], target: str, args: Sequence[str], kwargs: Mapping[str, Any]
) -> None:
    """Raise :class:`~zps.errors.ConfigError` if ``func(ps, *args, **kwargs)`` cannot
    bind (a missing or unknown argument), before zps-worker connects."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return  # no signature to check (a builtin): the call says what is wrong
    try:
        signature.bind(None, *args, **kwargs)
    except TypeError as e:
        given = ", ".join(["ps", *map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        bare = signature.replace(
            parameters=[q.replace(annotation=q.empty) for q in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        hint = (
            "; zps-worker's flags (--arg) go before MODULE:FUNCTION, what follows it is ARGS"
            if "--arg" in args
            else ""
        )
        raise ConfigError(
            f"{target}{bare} cannot be called as {target}({given}): {e}{hint}"
        ) from None


#: zps-worker's exit code when its function raised JobFailedError: the job failed
#: (a task failed more often than it may), and a restart would not change that.  The
#: worker unit does not restart on it (``RestartPreventExitStatus=``).
EXIT_JOB_FAILED = 3


def worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zps-worker",
        description="Run FUNCTION(ps, *ARGS, **--arg) with a connected client: an async "
        "function gets zps.Client, a plain one the blocking zps.SyncClient.  Exit codes: "
        "0 done, 1 an error (its traceback is printed), 2 bad arguments or configuration, "
        f"{EXIT_JOB_FAILED} the job failed (JobFailedError), {EXIT_STOP_TIMEOUT} a stop "
        "request ignored, 130 interrupted.",
    )
    add_version(parser)
    parser.add_argument(
        "--broker",
        help="broker endpoint, or a broker pair as PRIMARY,BACKUP (default: [worker] broker)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        help=f"seconds before an unanswered request fails (default {ClientConfig.timeout:g})",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        help=f"seconds to wait for the broker at start-up "
        f"(default {ClientConfig.connect_timeout:g})",
    )
    parser.add_argument(
        "--acks",
        choices=["all", "1"],
        help='wait for every in-sync replica ("all", default) or the primary (1)',
    )
    parser.add_argument("--name", help="a name shown by `zps-server status`")
    parser.add_argument(
        "--mode", choices=["async", "sync", "ssp"], help="training mode of the job (default async)"
    )
    parser.add_argument(
        "--staleness",
        type=int,
        metavar="TAU",
        help="ssp: how many steps a worker may run ahead of the slowest",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument(
        "--stop-grace",
        type=float,
        metavar="SECONDS",
        help="after the first SIGTERM/SIGINT, how long the function has to see "
        "ps.stop_requested and return before zps-worker exits with code "
        f"{EXIT_STOP_TIMEOUT} (default {WorkerConfig.stop_grace:g})",
    )
    parser.add_argument(
        "--arg",
        action="append",
        default=[],
        dest="kwargs",
        metavar="NAME=VALUE",
        help="a keyword argument of FUNCTION (repeatable; before MODULE:FUNCTION): VALUE "
        'is read as JSON (0.1, 3, true, [64, 32], "3"); one that is not JSON is passed '
        "as the string it is",
    )
    parser.add_argument(
        "--stall-margin",
        type=float,
        metavar="SECONDS",
        help="under a systemd watchdog (WatchdogSec=): the pings stop when a client call "
        "is still in flight this long after its deadline (--timeout), or the blocking "
        "client's event loop has not turned for this long; the function's own code may "
        f"run as long as it needs (default: [worker] stall_margin, {WorkerConfig.stall_margin:g})",
    )
    parser.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (default: none)")
    parser.add_argument(
        "--metrics-host",
        help=f"address the metrics endpoint binds (default {Metrics.host}: this host only)",
    )
    add_common(parser, heartbeat=False)
    parser.add_argument(
        "function",
        metavar="MODULE:FUNCTION",
        nargs="?",
        help="what to run (default: [worker] function)",
    )
    parser.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="positional arguments of FUNCTION, as strings (default: [worker] args)",
    )
    return parser


class _FunctionFailed(Exception):
    """The training function raised ``error`` (which keeps its traceback)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


def _function_failed(target: str, error: Exception) -> int:
    """Print what the training function raised, with its whole traceback (the user's
    frames first), then one line naming it; returns the exit code."""
    traceback.print_exception(error, file=sys.stderr)
    print(f"zps-worker: {target} failed: {type(error).__name__}: {error}", file=sys.stderr)
    if isinstance(error, JobFailedError):
        return EXIT_JOB_FAILED
    if isinstance(error, ConfigError):
        return 2
    return 1


def _nothing_done(target: str, tasks_taken: Mapping[str, int]) -> None:
    """Say so when the function asked for tasks and got none (the job was finished)."""
    for job in sorted(job for job, n in tasks_taken.items() if n == 0):
        print(
            f"zps-worker: {target} found nothing to do: job {job!r} had no task left "
            f"(it is finished; `zps-server job reset {job}` or create_job(..., "
            "restart=True) runs it again)",
            file=sys.stderr,
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = worker_parser().parse_args(argv)
    malloc.tune()
    setup_logging(args.log_level or "info")
    run: _WorkerRun | None = None
    target = args.function or "the function"
    try:
        settings = settings_of(args)
        target = args.function or settings.worker.function or target
        if not args.function and not settings.worker.function:
            raise ConfigError("no MODULE:FUNCTION given (as an argument or [worker] function)")
        func_args = list(args.args) if args.function else list(settings.worker.args)
        func_kwargs = keyword_args(args.kwargs)
        func = load_function(target)
        check_arguments(func, target, func_args, func_kwargs)
        config = override(
            settings.client,
            timeout=args.timeout,
            connect_timeout=args.connect_timeout,
            acks=None if args.acks is None else (1 if args.acks == "1" else "all"),
            name=args.name or target,
            mode=args.mode,
            staleness=args.staleness,
        )
        broker = args.broker or ",".join(settings.worker.endpoints)
        notifier = Notifier.from_env(os.environ)
        worker = override(  # checked
            settings.worker, stop_grace=args.stop_grace, stall_margin=args.stall_margin
        )
        run = _WorkerRun(target, notifier, worker_metrics(args, settings), worker.stop_grace)
        run.stall_margin = worker.stall_margin
        run.serve()  # before connecting: a taken port fails before the worker joins a job
        if inspect.iscoroutinefunction(func):
            return run_async(
                _run_async_worker(func, broker, config, func_args, func_kwargs, run, not args.quiet)
            )
        from zps.client.sync import connect_sync

        with connect_sync(broker, config) as ps:
            ps.client.progress.enabled = not args.quiet
            _stop_on_signals(ps.client, run)
            loop = ps.client.event_loop
            assert loop is not None
            background = [
                asyncio.run_coroutine_threadsafe(c, loop)
                for c in run.start(ps.client, own_loop=True)
            ]
            try:
                try:
                    result = func(ps, *func_args, **func_kwargs)
                except Exception as e:
                    raise _FunctionFailed(e) from e
                run.returned()
                notifier.stopping()
                ps.flush()
                ps.client.progress.close()
                _nothing_done(target, ps.client.tasks_taken)
            finally:
                for future in background:
                    future.cancel()
        return int(result) if isinstance(result, int) else 0
    except _FunctionFailed as failed:
        return _function_failed(target, failed.error)
    except ConfigError as e:
        print(f"zps-worker: {e}", file=sys.stderr)
        return 2
    except JobFailedError as e:
        print(f"zps-worker: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_JOB_FAILED
    except ZpsError as e:
        print(f"zps-worker: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if run is not None:
            run.stop()


def worker_metrics(args: argparse.Namespace, settings: Settings) -> Metrics:
    """The worker's metrics endpoint: ``--metrics-port``, else ``[worker] metrics_port``
    (not ``[metrics] port``, which the broker and shards share), at ``--metrics-host``,
    else ``[metrics] host`` (loopback by default)."""
    base = replace(settings.worker.metrics, port=settings.worker.metrics_port)
    return override(base, port=args.metrics_port, host=args.metrics_host)


#: zps-worker's exit code when the training function did not return within
#: ``worker.stop_grace`` seconds of the first SIGTERM/SIGINT (as timeout(1) exits).
EXIT_STOP_TIMEOUT = 124


class _WorkerRun:
    """What zps-worker runs beside the training function: systemd notifications, the
    watchdog (a thread that pings while the client is healthy), the metrics endpoint,
    and the stop grace period."""

    def __init__(self, target: str, notifier: Notifier, metrics: Metrics, grace: float) -> None:
        self.target = target
        self.notifier = notifier
        self.metrics_config = metrics
        self.grace = grace
        self.stall_margin = WorkerConfig.stall_margin  # see client_stall
        self.client: Any = None  # the connected client, once there is one
        self.server: Any = None
        self._timer: threading.Timer | None = None
        self._done = threading.Event()
        self._pinger: threading.Thread | None = None

    def serve(self) -> None:
        """Serve metrics, /healthz and /ready if a port is configured (raises
        :class:`~zps.errors.ZpsError` naming the address if it is taken)."""
        from zps.ops.metrics import MetricsServer

        self.server = MetricsServer(self.metrics_config, self._collect, ready=self._ready)
        self.server.start()

    def _collect(self) -> Any:
        from zps.ops.metrics import client_families

        client = self.client
        if client is None:
            return []
        return client_families(
            client.meter,
            requests=client.stats.requests,
            retries=client.stats.retries,
            step=client.step,
            stop_requested=client.stop_requested,
            now=time.monotonic(),
        )

    def _ready(self) -> tuple[bool, str]:
        client = self.client
        if client is None:
            return False, "connecting to the broker"
        if client.stop_requested:
            return False, "stopping: asked to stop (SIGTERM)"
        try:
            version = client.cluster_map.version
        except ZpsError:
            return False, "not connected to the broker"
        return True, f"running {self.target}, step {client.step}, map v{version}"

    def start(self, client: Any, *, own_loop: bool) -> list[Coroutine[Any, Any, None]]:
        """The client is connected: tell systemd the worker is up and start the watchdog
        thread; returns what to run on the client's event loop (the /healthz stamp, which
        the watchdog also reads).  ``own_loop``: the client's loop runs no user code (the
        blocking client), so a loop that stops turning is a stalled client."""
        self.client = client
        self.notifier.ready(f"running {self.target}")
        assert self.server is not None
        server = self.server
        began = time.monotonic()

        def stall() -> str | None:
            stamp = server.loop_stamp
            return client_stall(
                time.monotonic(),
                deadline=client.call_deadline(),
                loop_turned=(began if stamp is None else stamp) if own_loop else None,
                margin=self.stall_margin,
            )

        self._pinger = threading.Thread(
            target=self.notifier.ping_while_healthy,
            args=(stall, self._done),
            name="zps-watchdog",
            daemon=True,
        )
        self._pinger.start()
        return [server.loop_heartbeat()]

    def stop_requested(self, client: Any, signum: int) -> None:
        """The first SIGTERM/SIGINT: ask the function to stop, and start the grace period."""
        client.stop_requested = True
        self.notifier.stopping(f"stopping {self.target}")
        log.warning(
            "signal %d: finishing the current step, then stopping: %s sees ps.stop_requested "
            "and has %gs (worker.stop_grace) to return",
            signum,
            self.target,
            self.grace,
        )
        if self._timer is None:
            self._timer = threading.Timer(self.grace, self._give_up)
            self._timer.daemon = True
            self._timer.start()

    def _give_up(self) -> None:
        log.error(
            "%s did not return within %gs of the stop request (worker.stop_grace): "
            "exiting with code %d; requests still in flight are abandoned",
            self.target,
            self.grace,
            EXIT_STOP_TIMEOUT,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_STOP_TIMEOUT)

    def returned(self) -> None:
        """The function returned: the grace period is over (flushing has its own
        deadlines)."""
        if self._timer is not None:
            self._timer.cancel()

    def stop(self) -> None:
        self.returned()
        self._done.set()
        if self._pinger is not None:
            self._pinger.join(5.0)
            self._pinger = None
        if self.server is not None:
            self.server.stop()
            self.server = None


def _stop_on_signals(client: Any, run: _WorkerRun) -> None:
    """First SIGTERM/SIGINT: ask the training function to stop after its step
    (it sees ``ps.stop_requested``) within the grace period; a second one interrupts
    at once."""

    def handler(signum: int, frame: object) -> None:
        if client.stop_requested:
            raise KeyboardInterrupt
        run.stop_requested(client, signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


async def _run_async_worker(
    func: Callable[..., Any],
    broker: str,
    config: ClientConfig,
    args: list[str],
    kwargs: dict[str, Any],
    run: _WorkerRun,
    progress: bool,
) -> int:
    from zps.client.client import Client

    async with Client(broker, config) as ps:
        ps.progress.enabled = progress
        loop = asyncio.get_running_loop()
        # A task of its own, outside any task group: its exception is raised as it is.
        training = loop.create_task(func(ps, *args, **kwargs))
        interrupted = False

        def on_signal(signum: int) -> None:
            nonlocal interrupted
            if not ps.stop_requested:
                run.stop_requested(ps, signum)
            elif not interrupted:  # the second one interrupts at once
                interrupted = True
                training.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        tasks = [loop.create_task(c) for c in run.start(ps, own_loop=False)]
        try:
            try:
                result = await training
            except asyncio.CancelledError:
                if not interrupted:
                    raise
                return 130
            except Exception as e:
                raise _FunctionFailed(e) from e
            run.returned()
            run.notifier.stopping()
            await ps.flush()
            ps.progress.close()
            _nothing_done(run.target, ps.tasks_taken)
        finally:
            training.cancel()  # a no-op once it is done
            for task in tasks:
                task.cancel()
    return int(result) if isinstance(result, int) else 0
