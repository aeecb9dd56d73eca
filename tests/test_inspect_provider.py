"""The Inspect AI provider (reploy_inspect.py) against a real serve and real sessions:
Inspect's own conformance battery (inspect_ai/util/_sandbox/self_check.py), and a real eval
with Inspect's mockllm model driving the bash() tool in 4 samples at once, scored from files
read back from the sandboxes. Nothing here reaches a network: the model is mockllm, every
output carries its usage (no tokenizer), and Inspect's hub and telemetry switches are off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

inspect_ai = pytest.importorskip("inspect_ai")

import anyio  # noqa: E402
from inspect_ai.util import SandboxUserUnsupportedError  # noqa: E402
from inspect_ai.util._sandbox.self_check import *  # noqa: E402,F401,F403 - Inspect's battery

import reploy_client  # noqa: E402
import reploy_inspect  # noqa: E402
from serve_harness import (  # noqa: E402,F401 - a fixture
    ServeProcess, managed_workload, serve_processes, session_containers, wait_until,
)

pytestmark = [pytest.mark.docker, pytest.mark.anyio]

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "INSPECT_DISPLAY": "none",
               "INSPECT_LOG_LEVEL": "warning"}
#: Inspect's hooks that would load a module (and may call out): none.
UNSET_ENV = ("INSPECT_TELEMETRY", "INSPECT_API_KEY_OVERRIDE", "INSPECT_REQUIRED_HOOKS")
ROOT = Path(__file__).resolve().parent.parent
INSPECT_EVAL_TIMEOUT_S = 600
#: The head of a task file an `inspect eval` process runs: the provider registered (the
#: repository is on its path) and configured for the test's serve.
TASK_FILE_HEAD = """
from pathlib import Path

import anyio
import reploy_inspect
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import ChatMessageAssistant, execute_tools
from inspect_ai.scorer import CORRECT, INCORRECT, Score, accuracy, scorer
from inspect_ai.solver import solver
from inspect_ai.tool import ToolCall, bash
from inspect_ai.util import sandbox

CONFIG = reploy_inspect.ReployConfig(server={server!r}, token_file={token_file!r}, ttl_seconds=600)
"""



@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def inspect_serve(docker_client: Any, managed_workload: Path) -> Iterator[ServeProcess]:  # noqa: F811
    with serve_processes(managed_workload) as start:
        yield start()


def config_for(server: ServeProcess, **extra: Any) -> reploy_inspect.ReployConfig:
    return reploy_inspect.ReployConfig(server=server.ready["url"],
                                       token_file=server.ready["token_file"], **extra)


@pytest.fixture(scope="module")
def shared_sandbox(inspect_serve: ServeProcess) -> Iterator[Any]:
    """One session for the whole battery, as Inspect's own runner shares one environment."""
    config = config_for(inspect_serve)
    anyio.run(reploy_inspect.ReploySandboxEnvironment.task_init, "self-check", config)
    environments = anyio.run(reploy_inspect.ReploySandboxEnvironment.sample_init,
                             "self-check", config, {})
    yield environments["default"]
    anyio.run(reploy_inspect.ReploySandboxEnvironment.sample_cleanup, "self-check", config,
              environments, False)


@pytest.fixture
def sandbox_env(shared_sandbox: Any, request: pytest.FixtureRequest) -> Any:
    """Inspect's hook: the environment under test, with the known failures marked."""
    name = request.node.originalname
    if name == "test_exec_as_user":  # by design: every command runs as the runtime user
        request.node.add_marker(pytest.mark.xfail(raises=SandboxUserUnsupportedError, strict=True))
    return shared_sandbox


async def test_a_user_is_refused_clearly(shared_sandbox: Any) -> None:
    with pytest.raises(SandboxUserUnsupportedError, match="runtime user"):
        await shared_sandbox.exec(["whoami"], user="root")


def test_label_values_keep_only_safe_characters() -> None:
    assert reploy_inspect.label_value("my task/1 é") == "my-task-1--"
    assert len(reploy_inspect.label_value("x" * 500)) == reploy_inspect.MAX_LABEL_VALUE_CHARS


def test_a_missing_deployment_is_named_at_task_init(inspect_serve: ServeProcess) -> None:
    config = config_for(inspect_serve, deployment="no-such-deployment")
    with pytest.raises(ValueError, match="no deployment 'no-such-deployment'"):
        anyio.run(reploy_inspect.ReploySandboxEnvironment.task_init, "t", config)


def test_an_eval_of_four_concurrent_samples_is_scored_from_their_files(
        inspect_serve: ServeProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """mockllm asks bash() to write each sample's answer (twice its input) to a file; the
    scorer reads that file back from the sample's own session."""
    from inspect_ai import Task, eval as inspect_eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import ChatMessageTool, ModelOutput, ModelUsage, get_model
    from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
    from inspect_ai.solver import TaskState, generate, use_tools
    from inspect_ai.tool import bash
    from inspect_ai.util import sandbox

    for name, value in OFFLINE_ENV.items():
        monkeypatch.setenv(name, value)
    for name in UNSET_ENV:
        monkeypatch.delenv(name, raising=False)
    usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)

    def model_turn(messages: list[Any], *_: Any) -> ModelOutput:
        if isinstance(messages[-1], ChatMessageTool):
            output = ModelOutput.from_content("mockllm/model", "done")
        else:
            number = int(str(messages[-1].text).strip())
            output = ModelOutput.for_tool_call("mockllm/model", "bash", {
                "command": f"mkdir -p out && echo $(({number} * 2)) > out/answer.txt"})
        output.usage = usage
        return output

    seen: list[dict[str, Any]] = []  # what each sample's session carried

    @scorer(metrics=[accuracy()])
    def answer_file() -> Any:
        async def score(state: TaskState, target: Target) -> Score:
            seen.append(sandbox().as_type(reploy_inspect.ReploySandboxEnvironment).session.get())
            written = (await sandbox().read_file("out/answer.txt")).strip()
            return Score(value=CORRECT if written == target.text else INCORRECT, answer=written)
        return score

    task = Task(dataset=[Sample(input=str(n), target=str(2 * n), id=f"s{n}") for n in range(1, 5)],
                solver=[use_tools(bash(timeout=60)), generate()], scorer=answer_file(),
                sandbox=("reploy", config_for(inspect_serve, ttl_seconds=600)))
    model = get_model("mockllm/model", custom_outputs=model_turn)
    before = {session["id"] for session in inspect_serve.api.call("GET", "/sessions")["sessions"]}
    logs = inspect_eval(task, model=model, log_dir=str(tmp_path / "logs"), max_samples=4,
                        display="none")
    assert logs[0].status == "success", logs[0].error
    assert logs[0].results is not None and len(logs[0].samples or []) == 4
    assert logs[0].results.scores[0].metrics["accuracy"].value == 1.0
    assert sorted(s.scores["answer_file"].answer for s in logs[0].samples or []) == ["2", "4", "6", "8"]
    after = {session["id"] for session in inspect_serve.api.call("GET", "/sessions")["sessions"]}
    assert after == before  # every sample's session is gone
    # Each sample's session carried the eval's, task's and sample's ids, and a time to live.
    eval_id = reploy_inspect.label_value(logs[0].eval.eval_id)
    assert sorted(s["labels"][reploy_inspect.LABEL_SAMPLE] for s in seen) == ["s1-1", "s2-1", "s3-1", "s4-1"]
    assert {(s["labels"][reploy_inspect.LABEL_EVAL], s["labels"][reploy_inspect.LABEL_PROVIDER])
            for s in seen} == {(eval_id, "reploy")}
    assert all("expiresAt" in s for s in seen)


def test_cleanup_deletes_by_label_and_only_the_providers(inspect_serve: ServeProcess,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """What a killed harness left is found by its labels: task_cleanup takes its own eval
    run's (outside an eval's lifecycle, this process's), whatever the task name Inspect gives
    it; `inspect sandbox cleanup reploy` (cli_cleanup) every session of the provider, each
    named; a session of someone else stays."""
    environment = reploy_inspect.ReploySandboxEnvironment
    config = config_for(inspect_serve)
    left = [anyio.run(environment.sample_init, task, config, {})["default"].session.id
            for task in ("a", "shutdown")]
    another_run = inspect_serve.api.create("another-eval", labels={
        reploy_inspect.LABEL_PROVIDER: "reploy", reploy_inspect.LABEL_RUN: "another-run",
        reploy_inspect.LABEL_TASK: "shutdown"})["id"]
    other = inspect_serve.api.create("not-inspects")["id"]

    def ids() -> set[str]:
        return {session["id"] for session in inspect_serve.api.call("GET", "/sessions")["sessions"]}

    anyio.run(environment.task_cleanup, "shutdown", config, True)
    assert not set(left) & ids() and {another_run, other} <= ids()
    monkeypatch.setenv("REPLOY_SERVER", inspect_serve.ready["url"])
    monkeypatch.setenv("REPLOY_TOKEN", inspect_serve.ready["token"])
    reploy_inspect.client_for.cache_clear()
    capsys.readouterr()
    anyio.run(environment.cli_cleanup, None)
    assert another_run not in ids() and other in ids()
    assert f"reploy: deleted session {another_run}" in capsys.readouterr().out
    inspect_serve.api.call("DELETE", f"/sessions/{other}", expect=204)


def test_disk_mib_and_cpus_size_each_sample_s_session(inspect_serve: ServeProcess, docker_client: Any) -> None:
    """The provider config's `disk_mib` and `cpus` reach serve's create as `diskMib` and `cpus`:
    the sample's workload sees its disk's size, its container has the CPU bound; past serve's
    own bound the sample does not start, and says why."""
    environment = reploy_inspect.ReploySandboxEnvironment
    config = config_for(inspect_serve, disk_mib=96, cpus=0.5)
    environments = anyio.run(environment.sample_init, "sized", config, {})
    try:
        sandbox = environments["default"]
        assert (sandbox.session.get()["diskMib"], sandbox.session.get()["cpus"]) == (96, 0.5)
        result = anyio.run(sandbox.exec, ["df", "-P", "-k", "."])
        assert result.success and 80 << 10 < int(result.stdout.splitlines()[1].split()[1]) <= 96 << 10
        [container] = session_containers(docker_client, inspect_serve.state_dir, sandbox.session.id)
        assert container.attrs["HostConfig"]["NanoCpus"] == 500_000_000
    finally:
        anyio.run(environment.sample_cleanup, "sized", config, environments, False)
    with pytest.raises(reploy_client.ReployError, match=r"cpus: must be at most 1, this server's bound"):
        anyio.run(environment.sample_init, "too-big", config_for(inspect_serve, cpus=64.0), {})


def inspect_eval_process(server: ServeProcess, task_file: Path, body: str, log_dir: Path,
                         **popen: Any) -> "subprocess.Popen[str]":
    """`inspect eval` of a task file (TASK_FILE_HEAD, then `body`), as a process of its own, with
    Inspect's mockllm model (which these tasks never call) and nothing that reaches a network."""
    task_file.write_text(TASK_FILE_HEAD.format(server=server.ready["url"],
                                               token_file=server.ready["token_file"]) + body)
    env = {name: value for name, value in os.environ.items() if name not in UNSET_ENV}
    env.update(OFFLINE_ENV, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "inspect_ai", "eval", task_file.name,
                             "--model", "mockllm/model", "--log-dir", str(log_dir)],
                            env=env, cwd=task_file.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def finished(process: "subprocess.Popen[str]") -> tuple[int, str]:
    output, _ = process.communicate(timeout=INSPECT_EVAL_TIMEOUT_S)
    return process.returncode, output


def eval_log(log_dir: Path) -> Any:
    """The one log an `inspect eval` process wrote."""
    from inspect_ai.log import list_eval_logs, read_eval_log

    [log] = list_eval_logs(str(log_dir))
    return read_eval_log(log)


def test_too_much_output_is_inspects_output_limit_error_in_a_real_eval(
        inspect_serve: ServeProcess, tmp_path: Path) -> None:
    """bash() running a command that prints 16 MiB of control bytes on stdout and on stderr, past
    Inspect's 10 MiB (an answer of 153 MB, each stream twice, before issue 42): the
    provider raises OutputLimitExceededError, which Inspect hands the model as a `limit` tool
    error, and the sample is scored; the eval succeeds."""
    body = """
@solver
def too_much_output():
    async def solve(state, generate):
        flood = "head -c 16777216 /dev/zero | tr '\\\\0' '\\\\1'"
        command = f"{flood}; {flood} >&2"
        state.messages.append(ChatMessageAssistant(content="", tool_calls=[
            ToolCall(id="c1", function="bash", arguments={"command": command})]))
        state.messages.extend((await execute_tools(state.messages, [bash(timeout=300)])).messages)
        return state
    return solve


@scorer(metrics=[accuracy()])
def limit_reported():
    async def score(state, target):
        error = state.messages[-1].error
        kept = state.messages[-1].text
        fits = error is not None and error.type == "limit" and "\\x01" * 1024 in kept
        return Score(value=CORRECT if fits else INCORRECT, answer=repr(error)[:300])
    return score


@task
def flood():
    return Task(dataset=[Sample(input="flood", target="limit")], solver=too_much_output(),
                scorer=limit_reported(), sandbox=("reploy", CONFIG))
"""
    code, output = finished(inspect_eval_process(inspect_serve, tmp_path / "flood.py", body,
                                                 tmp_path / "logs"))
    assert code == 0, output[-3000:]
    log = eval_log(tmp_path / "logs")
    assert log.status == "success", log.error
    [sample] = log.samples
    assert sample.scores["limit_reported"].value == "C", sample.scores
    assert "output limit of 10 MiB" in sample.scores["limit_reported"].answer


def test_an_eval_s_task_cleanup_deletes_its_own_leftovers_and_no_other_eval_s(
        inspect_serve: ServeProcess, tmp_path: Path) -> None:
    """Two `inspect eval` processes. The first holds its sample's session open (its task is
    named `shutdown`, the name Inspect gives every task_cleanup); the second leaves a session
    its sample made and never cleaned up. When the second ends, its task cleanup deletes its
    leftover and nothing of the first; the first's goes when it ends."""
    api = inspect_serve.api
    release = tmp_path / "release"
    os.mkfifo(release)
    holder = inspect_eval_process(inspect_serve, tmp_path / "holder.py", f"""
@solver
def hold():
    async def solve(state, generate):
        assert (await sandbox().exec(["true"])).success
        await anyio.to_thread.run_sync(lambda: Path({str(release)!r}).read_text())
        return state
    return solve


@task
def shutdown():
    return Task(dataset=[Sample(input="hold")], solver=hold(), sandbox=("reploy", CONFIG))
""", tmp_path / "holder-logs")

    def labelled(key: str, value: str) -> list[str]:
        return [s["id"] for s in api.call("GET", f"/sessions?label={key}={value}")["sessions"]]

    try:
        held = wait_until(lambda: labelled(reploy_inspect.LABEL_TASK, "shutdown"),
                          "the first eval's session")
        left_file = tmp_path / "left.txt"
        leaver = inspect_eval_process(inspect_serve, tmp_path / "leaver.py", f"""
@solver
def leave_one():
    async def solve(state, generate):
        made = await reploy_inspect.ReploySandboxEnvironment.sample_init("leaver", CONFIG, {{}})
        Path({str(left_file)!r}).write_text(made["default"].session.id)
        return state
    return solve


@task
def leaver():
    return Task(dataset=[Sample(input="leave")], solver=leave_one(), sandbox=("reploy", CONFIG))
""", tmp_path / "leaver-logs")
        code, output = finished(leaver)
        assert (code, eval_log(tmp_path / "leaver-logs").status) == (0, "success"), output[-3000:]
        left = left_file.read_text()
        sessions = {s["id"] for s in api.call("GET", "/sessions")["sessions"]}
        assert left not in sessions and not labelled(reploy_inspect.LABEL_TASK, "leaver")
        assert set(held) <= sessions, "the second eval's cleanup deleted the first eval's session"
        release.write_text("go\n")
        code, output = finished(holder)
        assert (code, eval_log(tmp_path / "holder-logs").status) == (0, "success"), output[-3000:]
        assert not set(held) & {s["id"] for s in api.call("GET", "/sessions")["sessions"]}
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.communicate()


def test_cleanup_without_a_serve_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`inspect sandbox cleanup reploy` with no serve listening: one line, exit 1, no traceback."""
    import socket

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        monkeypatch.setenv("REPLOY_SERVER", f"http://127.0.0.1:{unused.getsockname()[1]}")
        monkeypatch.setenv("REPLOY_TOKEN", "k" * 43)
        reploy_inspect.client_for.cache_clear()
        with pytest.raises(SystemExit) as ended:
            anyio.run(reploy_inspect.ReploySandboxEnvironment.cli_cleanup, None)
    reploy_inspect.client_for.cache_clear()
    assert ended.value.code == 1
    said = capsys.readouterr()
    assert said.out == "" and said.err.startswith("reploy: sandbox cleanup: no answer from http://127.0.0.1:")
    assert said.err.count("\n") == 1
