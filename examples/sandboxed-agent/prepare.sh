#!/bin/sh
# Copies into this example's build contexts the files it takes from Reploy: reploy_driver.py (the
# small controller library) for the controller, agent.py and the fake stream-json CLI
# (tests/agent_fixtures/fake_claude.py, a stand-in for Claude Code) for the workload. Run it once
# before `reploy.py stage`:
#
#   ./prepare.sh [REPLOY_CHECKOUT]     (default: the checkout this folder sits in, ../..)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
reploy=${1:-$here/../..}
for file in examples/controller/context/reploy_driver.py agent.py tests/agent_fixtures/fake_claude.py; do
    if [ ! -f "$reploy/$file" ]; then
        echo "prepare.sh: $reploy/$file not found; pass the path of a Reploy checkout" >&2
        exit 2
    fi
done
cp "$reploy/examples/controller/context/reploy_driver.py" "$here/controller/"
cp "$reploy/agent.py" "$reploy/tests/agent_fixtures/fake_claude.py" "$here/workload/"
echo "prepare.sh: copied reploy_driver.py, agent.py and fake_claude.py into $here" >&2
