# Reploy: the two commands of the README, plus their parts.
#   make demo   set up this machine, then run a controlled session between the examples
#   make test   set up this machine, then run the whole test suite
#   make bundle the offline bundle for air-gapped hosts, dist/reploy-VERSION-offline.tar.gz
#               (IMAGES=1 adds the examples' base images, which `make setup` builds)
#   make kube-up / kube-down  a real two-node Kubernetes cluster on loopback (docs/kubernetes.md)
PYTHON ?= python3
DEMO_DIR ?= $(CURDIR)/.reploy-demo

.PHONY: setup setup-demo demo test test-unit lint bench bench-agent clean-demo bundle kube-up kube-down

# Machine output only on stdout (`make demo | python3 -m json.tool` works): recipe lines are
# not echoed, and everything but the session's result goes to stderr.
MAKEFLAGS += --no-print-directory

setup:
	@bash scripts/setup.sh >&2

# Only what the demo needs: no Chromium and no browser image (the tests' and examples').
setup-demo:
	@bash scripts/setup.sh demo >&2

demo: setup-demo
	@echo "demo: staging and building the example deployments" >&2
	@$(PYTHON) reploy.py stage examples/controller/controller.blueprint.yaml --dir $(DEMO_DIR)/controller >&2
	@$(PYTHON) reploy.py build --dir $(DEMO_DIR)/controller >&2
	@$(PYTHON) reploy.py stage examples/workload/workload.blueprint.yaml --dir $(DEMO_DIR)/workload >&2
	@$(PYTHON) reploy.py build --dir $(DEMO_DIR)/workload >&2
	@echo "demo: running a controlled session; its result is the JSON on stdout" >&2
	@$(PYTHON) reploy.py controlled-session run \
	  --controller-dir $(DEMO_DIR)/controller --workload-dir $(DEMO_DIR)/workload \
	  --output-dir $(DEMO_DIR)/artifacts -- run-controller

test: setup
	$(PYTHON) -m pytest -q -rs tests

# Type checking (mypy.ini) and lint (ruff.toml): CI runs them before the tests.
lint: setup
	$(PYTHON) -m mypy
	$(PYTHON) -m ruff check

test-unit:
	$(PYTHON) -m pytest -q -rs tests -m "not docker"

# Figures as JSON lines on stdout (ratios against baselines measured in the same run).
bench: setup
	$(PYTHON) bench/bench_agent.py
	$(PYTHON) bench/bench_sessions.py
	$(PYTHON) bench/bench_serve.py
	$(PYTHON) bench/bench_agent_memory.py
	$(PYTHON) bench/bench_harness.py
	$(PYTHON) bench/bench_model_proxy.py --relay

bench-agent:
	$(PYTHON) bench/bench_agent.py

clean-demo:
	rm -rf $(DEMO_DIR)

bundle:
	@$(PYTHON) scripts/bundle.py --output-dir dist $(if $(filter 1,$(IMAGES)),--images)

# The cluster's JSON line (kubeconfig, a fresh namespace, nodes, server) is the only stdout;
# the first run builds Kubernetes into a cache outside the repository (10 to 14 minutes).
kube-up:
	@bash scripts/kube-cluster.sh up

kube-down:
	@bash scripts/kube-cluster.sh down
