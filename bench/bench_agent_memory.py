#!/usr/bin/env python3
"""What an idle agent's interpreter holds, by component, in the managed example's image; prints
one JSON line per figure (like bench_serve.py). MiB of anonymous memory (RssAnon: the heap, the
stacks, what the process made; not the shared interpreter and library pages):

  agent_memory_bare_python        a bare `python3 -I -S`: the floor any Python agent pays
  agent_memory_start_modules      the standard modules importing agent.py loads, imported alone
  agent_memory_code_bytecode      agent.py's own module on top of those, from serve's bytecode
  agent_memory_code_source        the same compiled from the source (what every agent paid before
                                  serve's bytecode, and what an image of another python3 pays)

Each sample is one short container of the same image and sandbox flags as a session's
(reploy.ContainerSpec), agent.py and its bytecode mounted as serve mounts them.

  python3 bench/bench_agent_memory.py [--rounds N]    (needs the engine and the base images: make setup)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import docker  # noqa: E402

import reploy  # noqa: E402
import reploy_serve  # noqa: E402
from bench_serve import BASELINE_LABELS, figure  # noqa: E402
from conftest import remove_built_images, stage_and_build, staged_deployment_ids  # noqa: E402
from serve_harness import wait_until  # noqa: E402

#: Run in the container: prints the RssAnon (KiB) before and after its step, or (`modules`)
#: the modules importing the agent loads.
PROBE = """
import sys
def anon():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:"))
step, names, bare = sys.argv[1], sys.argv[2:], anon()
if step == "modules":
    before = set(sys.modules)
    sys.path.insert(0, "/opt/reploy")
    import agent
    print(" ".join(sorted(set(sys.modules) - before - {"agent"})))
else:
    for name in names:
        __import__(name)
    if step == "agent":
        sys.path.insert(0, "/opt/reploy")
        import agent
    print(bare, anon())
"""


def probe(backend: reploy.DockerBackend, runtime: reploy.Runtime, image_id: str,
          mounts: tuple[reploy.Mount, ...], *argv: str) -> str:
    """The probe's output in one container of the session's sandbox, removed after."""
    spec = reploy.ContainerSpec(role="bench", image_id=image_id, command=("python3", "-I", "-S", "-c", PROBE, *argv),
                                runtime=runtime, environment={}, labels=BASELINE_LABELS, mounts=mounts, init=True)
    container_id = backend.create(spec)
    try:
        backend.start(container_id)
        wait_until(lambda: (backend.container_state(container_id) or {}).get("Status") == "exited", "the probe")
        return backend.log_tail(container_id).decode().strip()
    finally:
        backend.remove_container(container_id)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    client = docker.from_env()
    base = Path(tempfile.mkdtemp(prefix="bench-agent-memory-"))
    try:
        workload = base / "workload"
        stage_and_build(ROOT / "examples/managed/managed.blueprint.yaml", workload)
        deployment = reploy.load_deployment(workload)
        assert deployment.current is not None
        runtime, image_id = deployment.blueprint.runtime, deployment.current.image_id
        reploy_serve.compile_agent_bytecode(base / "bytecode")
        with_bytecode = reploy_serve.agent_mounts(base / "bytecode")
        source_only = with_bytecode[:1]
        backend = reploy.DockerBackend()
        modules = probe(backend, runtime, image_id, with_bytecode, "modules").split()
        samples: dict[str, list[float]] = {"bare_python": [], "start_modules": [],
                                           "code_bytecode": [], "code_source": []}
        for _ in range(rounds):
            bare, started = map(int, probe(backend, runtime, image_id, with_bytecode, "stdlib", *modules).split())
            _, from_bytecode = map(int, probe(backend, runtime, image_id, with_bytecode, "agent", *modules).split())
            _, from_source = map(int, probe(backend, runtime, image_id, source_only, "agent", *modules).split())
            for name, kib in (("bare_python", bare), ("start_modules", started - bare),
                              ("code_bytecode", from_bytecode - started), ("code_source", from_source - started)):
                samples[name].append(kib / 1024)
        for name, values in samples.items():
            figure(f"agent_memory_{name}", "MiB", values)
        print(json.dumps({"start_modules": modules}), file=sys.stderr)
    finally:
        remove_built_images(client, staged_deployment_ids(base))
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
