"""reploy_inspect: Reploy as an Inspect AI sandbox, `sandbox="reploy"`.

    from inspect_ai import Task
    Task(..., sandbox="reploy")                            # REPLOY_SERVER, REPLOY_TOKEN
    Task(..., sandbox=("reploy", ReployConfig(deployment="managed", exec_timeout=120)))

Registered through the `inspect_ai` entry point in pyproject.toml (`pip install .[inspect]`),
or by importing this module. Each sample gets one managed session of a `reploy serve`,
labelled with the eval run's id (one per Inspect sandbox lifecycle: an `inspect eval` and the
tasks it runs), and the eval, task and sample ids, and created with a time to live, so that
what a killed harness leaves is deleted by the reaper within the TTL; task_cleanup deletes
what its own run left (a cancelled sample's session), and `inspect sandbox cleanup reploy`
every session of the provider. Inspect writes Sample.files through write_file. Output past
the exec cap, or a file past the read cap, is Inspect's OutputLimitExceededError.

Every call runs reploy_client's blocking call in a worker thread (anyio.to_thread); the
client's connection pool lets a sample's parallel tool calls run side by side. Exec runs as
the session's runtime user, never as another: a `user` is refused with Inspect's
SandboxUserUnsupportedError.
"""

from __future__ import annotations

import functools
import re
import secrets
import signal
import sys
from typing import Any, Callable, Literal, Optional, TypeVar, Union, overload

import anyio
from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    SandboxUserUnsupportedError,
    sandboxenv,
)
from pydantic import BaseModel

import reploy_client

__version__ = "0.1.0"

T = TypeVar("T")

PROVIDER = "reploy"
LABEL_PROVIDER = "inspect-provider"  #: every session this provider makes carries it
LABEL_EVAL, LABEL_TASK, LABEL_SAMPLE = "inspect-eval", "inspect-task", "inspect-sample"
LABEL_RUN = "inspect-run"  #: the eval run that made the session (EvalRun), which task_cleanup deletes
DEFAULT_TTL_SECONDS = 6 * 3600
_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9._-]")
MAX_LABEL_VALUE_CHARS = 63
NOT_FOUND_EXIT = 127  #: a shell's exit code for a program it cannot find


class ReployConfig(BaseModel, frozen=True):
    """The sandbox's config. `server` defaults to $REPLOY_SERVER; the token is
    `token_file`'s, else $REPLOY_TOKEN's. `deployment` is one of serve's (GET /server; default
    its first). `exec_timeout` (seconds) applies when Inspect gives none (else none: serve
    runs it until it ends). `max_output_bytes` caps each stream (default Inspect's limit,
    INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE, 10 MiB; serve takes up to 16). `disk_mib` sizes each
    sample's session disk (its workspace, home and output: at least 64 MiB) and `cpus` bounds
    its container's CPU (cores, e.g. 0.5); each is passed on at create only when set, at most
    serve's own --session-disk-mib and --session-cpus (more is refused), which are the default. `sweep`
    labels each session and gives it `ttl_seconds`, for serve versions that take labels."""

    server: Optional[str] = None
    token_file: Optional[str] = None
    deployment: Optional[str] = None
    exec_timeout: Optional[int] = None
    max_output_bytes: Optional[int] = None
    disk_mib: Optional[int] = None
    cpus: Optional[float] = None
    ttl_seconds: int = DEFAULT_TTL_SECONDS
    sweep: bool = True


def signal_exit(name: Optional[str]) -> int:
    """A shell's exit code for a command a signal ended: 128 + its number. Pure."""
    try:
        return 128 + signal.Signals[name or ""].value
    except KeyError:
        return 128


def label_value(text: str) -> str:
    """A label value from an id Inspect made: its safe characters, bounded. Pure."""
    return _LABEL_VALUE_BAD.sub("-", str(text))[:MAX_LABEL_VALUE_CHARS] or "-"


def config_of(config: SandboxEnvironmentConfigType | None) -> ReployConfig:
    if config is None:
        return ReployConfig()
    if isinstance(config, ReployConfig):
        return config
    if isinstance(config, BaseModel):
        return ReployConfig(**config.model_dump())
    raise ValueError(f"the reploy sandbox takes a ReployConfig, not {config!r}")


@functools.lru_cache(maxsize=8)
def client_for(config: ReployConfig) -> reploy_client.Client:
    """One client (one connection pool) per config in this process."""
    return reploy_client.Client(config.server, token_file=config.token_file)


async def in_thread(call: Callable[..., T], *args: Any) -> T:
    return await anyio.to_thread.run_sync(functools.partial(call, *args))


def current_sample_labels() -> dict[str, str]:
    """The eval's and sample's ids, when an eval runs this sample."""
    from inspect_ai.log._samples import sample_active

    active = sample_active()
    if active is None:
        return {}
    return {LABEL_EVAL: label_value(active.eval_id),
            LABEL_SAMPLE: label_value(f"{active.sample.id}-{active.epoch}")}


class EvalRun:
    """One eval run's id, made once per Inspect sandbox lifecycle (its scope spans the
    run's task_init, samples and task_cleanup, whose task name is only "startup" and
    "shutdown"). Outside such a scope (an Inspect without one, a direct call), one per
    process."""

    def __init__(self) -> None:
        self.id = secrets.token_hex(8)


_PROCESS_RUN = EvalRun()


def current_run() -> EvalRun:
    try:
        from inspect_ai.util._sandbox.lifecycle import sandbox_lifecycle_state
    except ImportError:  # an Inspect older than its lifecycle scopes
        return _PROCESS_RUN
    scope = sandbox_lifecycle_state()
    return _PROCESS_RUN if scope is None else scope.get(EvalRun)


def output_limit_error(stdout: str, stderr: str) -> OutputLimitExceededError:
    """What Inspect's own sandboxes raise for output past the exec limit: the limit's words and
    what was kept of the output, both streams, within the limit."""
    limit_bytes = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
    kept = f"{stdout}{stderr}".encode("utf-8")[:limit_bytes].decode("utf-8", "ignore")
    return OutputLimitExceededError(SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR, kept)


@sandboxenv(name=PROVIDER)
class ReploySandboxEnvironment(SandboxEnvironment):
    """One managed session of a `reploy serve`."""

    def __init__(self, session: reploy_client.Session, config: ReployConfig) -> None:
        super().__init__()
        self.session, self.config = session, config

    # -- lifecycle -----------------------------------------------------------------------

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return ReployConfig(**config)

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        """Checks that the server answers with this token and has the deployment."""
        settings = config_of(config)
        info = await in_thread(client_for(settings).server_info)
        deployments = info.get("deployments") or []
        if settings.deployment is not None and settings.deployment not in deployments:
            raise ValueError(f"reploy: the server has no deployment {settings.deployment!r} "
                             f"(it has {', '.join(map(str, deployments)) or 'none'})")

    @classmethod
    async def sample_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                          metadata: dict[str, str]) -> dict[str, SandboxEnvironment]:
        settings = config_of(config)
        extra: dict[str, Any] = {}
        if settings.sweep:
            extra["labels"] = {LABEL_PROVIDER: PROVIDER, LABEL_RUN: current_run().id,
                               LABEL_TASK: label_value(task_name), **current_sample_labels()}
            extra["ttl_seconds"] = settings.ttl_seconds
        if settings.disk_mib is not None:
            extra["diskMib"] = settings.disk_mib
        if settings.cpus is not None:
            extra["cpus"] = settings.cpus
        client = client_for(settings)
        session = await in_thread(functools.partial(
            client.create, name=f"inspect {task_name}"[:200], deployment=settings.deployment, **extra))
        return {"default": cls(session, settings)}

    @classmethod
    async def sample_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                             environments: dict[str, SandboxEnvironment], interrupted: bool) -> None:
        for environment in environments.values():
            if isinstance(environment, ReploySandboxEnvironment):
                await in_thread(environment.session.delete)

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                           cleanup: bool) -> None:
        """What this eval run's samples left (a cancelled sample_init, say), by its run label:
        Inspect names every task "shutdown" here, so the task name tells nothing."""
        settings = config_of(config)
        if cleanup and settings.sweep:
            await in_thread(delete_labelled, client_for(settings),
                            {LABEL_PROVIDER: PROVIDER, LABEL_RUN: current_run().id})

    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:  # noqa: A002 - Inspect's name
        """`inspect sandbox cleanup reploy [ID]`: every session of this provider (or one),
        each one removed named on stdout; a failure (no serve, no token) one line on stderr
        and exit 1, as a command line says one."""
        try:
            client = client_for(ReployConfig())
            if id is not None:
                await in_thread(client.session(id).delete)
                print(f"reploy: deleted session {reploy_client.shown(id, 64)}")
                return
            deleted = await in_thread(delete_labelled, client, {LABEL_PROVIDER: PROVIDER})
        except reploy_client.ReployError as e:
            print(f"reploy: sandbox cleanup: {e}", file=sys.stderr)
            raise SystemExit(1) from None
        for session_id in deleted:
            print(f"reploy: deleted session {reploy_client.shown(session_id, 64)}")
        print(f"reploy: {len(deleted)} session(s) deleted")

    # -- the sandbox ---------------------------------------------------------------------

    async def exec(self, cmd: list[str], input: str | bytes | None = None,  # noqa: A002
                   cwd: str | None = None, env: dict[str, str] | None = None,
                   user: str | None = None, timeout: int | None = None,
                   timeout_retry: bool = True, concurrency: bool = True) -> ExecResult[str]:
        if user is not None:
            raise SandboxUserUnsupportedError(
                f"reploy runs every command as the session's runtime user, never as {user!r}")
        timeout_s = timeout if timeout is not None else self.config.exec_timeout
        limit_bytes = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        cap_bytes = min(self.config.max_output_bytes or limit_bytes, reploy_client.MAX_EXEC_OUTPUT_BYTES)
        try:
            result = await in_thread(functools.partial(
                self.session.exec, cmd, cwd=cwd, env=env, stdin=input,
                timeout=None if timeout_s is None else float(timeout_s),
                max_output_bytes=cap_bytes))
        except FileNotFoundError as e:  # Inspect: a missing program is a failed result
            return ExecResult(success=False, returncode=NOT_FOUND_EXIT, stdout="", stderr=str(e))
        if result.timed_out:
            raise TimeoutError(f"Command timed out after {timeout_s} seconds: {cmd!r}")
        stdout = result.stdout.decode("utf-8", "replace")
        stderr = result.stderr.decode("utf-8", "replace")
        if result.truncated or len(result.stdout) > limit_bytes or len(result.stderr) > limit_bytes:
            raise output_limit_error(stdout, stderr)
        exit_code = result.exit_code if result.exit_code is not None else signal_exit(result.signal)
        return ExecResult(success=exit_code == 0, returncode=exit_code, stdout=stdout, stderr=stderr)

    async def write_file(self, file: str, contents: str | bytes) -> None:
        await in_thread(self.session.files.write, file, contents)

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> Union[str, bytes]:
        limit_bytes = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE
        try:
            data = await in_thread(self.session.files.read, file, limit_bytes)
        except reploy_client.ReployError as e:
            if e.code == "too_large":
                raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR,
                                               None) from e
            raise
        return data.decode("utf-8") if text else data


def delete_labelled(client: reploy_client.Client, labels: dict[str, str]) -> list[str]:
    """Deletes every session carrying `labels`; the ids deleted. The answer is checked
    too: a serve that does not filter by label (an older one) gets nothing deleted."""
    ids = [str(session["id"]) for session in client.sessions(labels)
           if isinstance(session.get("labels"), dict)
           and all(session["labels"].get(k) == v for k, v in labels.items())]
    for session_id in ids:
        client.session(session_id).delete()
    return ids


__all__ = ["ReployConfig", "ReploySandboxEnvironment", "delete_labelled"]
