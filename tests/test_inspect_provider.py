"""The Inspect AI provider (reploy_inspect.py) against a real serve and real sessions:
Inspect's own conformance battery (inspect_ai/util/_sandbox/self_check.py), and a real eval
with Inspect's mockllm model driving the bash() tool in 4 samples at once, scored from files
read back from the sandboxes. Nothing here reaches a network: the model is mockllm, every
output carries its usage (no tokenizer), and Inspect's hub and telemetry switches are off.
"""

from __future__ import annotations

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
    ServeProcess, managed_workload, serve_processes, session_containers,
)

pytestmark = [pytest.mark.docker, pytest.mark.anyio]

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "INSPECT_DISPLAY": "none",
               "INSPECT_LOG_LEVEL": "warning"}
#: Inspect's hooks that would load a module (and may call out): none.
UNSET_ENV = ("INSPECT_TELEMETRY", "INSPECT_API_KEY_OVERRIDE", "INSPECT_REQUIRED_HOOKS")



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
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """What a killed harness left is found by its labels: task_cleanup takes its task's,
    `inspect sandbox cleanup reploy` (cli_cleanup) every session of the provider; a session
    of someone else stays."""
    environment = reploy_inspect.ReploySandboxEnvironment
    config = config_for(inspect_serve)
    left = [anyio.run(environment.sample_init, task, config, {})["default"] for task in ("a", "a", "b")]
    other = inspect_serve.api.create("not-inspects")["id"]

    def ids() -> set[str]:
        return {session["id"] for session in inspect_serve.api.call("GET", "/sessions")["sessions"]}

    anyio.run(environment.task_cleanup, "a", config, True)
    assert {e.session.id for e in left} & ids() == {left[2].session.id}
    monkeypatch.setenv("REPLOY_SERVER", inspect_serve.ready["url"])
    monkeypatch.setenv("REPLOY_TOKEN", inspect_serve.ready["token"])
    reploy_inspect.client_for.cache_clear()
    anyio.run(environment.cli_cleanup, None)
    assert {e.session.id for e in left} & ids() == set() and other in ids()
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
