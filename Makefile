# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Each creates .venv and installs the project with the pinned versions in constraints.txt.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
WORK ?= work
# helm, kubeconform and the Kubernetes/KubeRay schemas (scripts/k8s_tools.sh), and the local control plane of
# the cluster tests (scripts/k8s_control_plane.sh): built from Go modules, cached
K8S_TOOLS_DIR ?= $(HOME)/.cache/fp8rl/tools
# The venv is installed by uv (from PyPI into the venv): parallel downloads, and the packages hard-linked from its
# cache (~/.cache/uv), so a second venv takes seconds and almost no disk. --compile-bytecode as pip does: without
# the .pyc files (uv writes none by default) every process compiles what it imports, twice the CPU of an import of
# torch + transformers + MLflow, each time where PYTHONDONTWRITEBYTECODE is set. The system's CA store (a TLS
# proxy's CA); PIP_INDEX_URL, where set, is the index.
UV_VERSION ?= 0.13.9
UV_INSTALL := UV_NATIVE_TLS=1 $(BIN)/uv pip install --python $(BIN)/python $(if $(PIP_INDEX_URL),--index-url $(PIP_INDEX_URL))

.PHONY: install demo test lint typecheck k8s-tools images node-deps cluster-up cluster-down e2e e2e-check e2e-prepare chart-recipes mlflow-ui-shots clean

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; assert (3, 11) <= sys.version_info[:2] <= (3, 12), "fp8rl needs Python 3.11 or 3.12"'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv==$(UV_VERSION)
	$(UV_INSTALL) -q --compile-bytecode -c constraints.txt -e ".[dev]"
	@rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

demo: install
	$(BIN)/python -m pipelines.submit recipe-comparison --local --work-dir $(WORK)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

k8s-tools: install
	PYTHON=$(BIN)/python FP8RL_TOOLS_DIR=$(K8S_TOOLS_DIR) scripts/k8s_tools.sh
	FP8RL_TOOLS_DIR=$(K8S_TOOLS_DIR) scripts/k8s_control_plane.sh

# The container images on local stand-ins of their public base images, with podman: for a build host that reaches
# no registry (CI; root). With docker and the public bases: images/build.sh. The image tests (tests/image) run
# the images this builds; IMAGES=runtime or "runtime component" for the GPU image (long: images/README.md).
IMAGES ?= component
images:
	scripts/container_tools.sh
	images/build.sh --local-base $(IMAGES)

# The local cluster's real node (containerd, the CNI plugins; root): what the real-node tests and cluster-up need.
node-deps:
	scripts/container_tools.sh --node

# A one-machine cluster to try the chart on (docs/helm.md): a control plane, the KubeRay operator and a real node
# running the images of `make images`; GPU_NODES=N adds kwok nodes with fake GPUs. Root.
GPU_NODES ?= 0
cluster-up: k8s-tools node-deps
	FP8RL_TOOLS_DIR=$(K8S_TOOLS_DIR) $(BIN)/python scripts/local_cluster.py up --gpu-nodes $(GPU_NODES)

cluster-down:
	FP8RL_TOOLS_DIR=$(K8S_TOOLS_DIR) $(BIN)/python scripts/local_cluster.py down

# The users' whole path on a real KFP backend (scripts/kfp_backend/README.md): first what it can do itself
# (scripts/kfp_backend/prepare.py: the Debian packages, the MLMD server's venv, KFP's backend and UI builds from
# KFP_SRC=<kubeflow/pipelines at 2.17.0>), or one message of what only the user can provide (`make e2e-check` says it
# and changes nothing); then a fresh cluster with the component image and KFP's driver, launcher and argoexec images,
# the backend as host processes, the chart, the three pipelines submitted with `pipelines.submit --wait` on CPU
# settings, then the KFP UI driven in headless Chromium (tests/cluster/test_kfp_ui.py); first, the MLflow UI of a
# recipe comparison on a real MLflow server in the same Chromium (tests/integration/test_mlflow_registry.py, which CI
# runs without the browser part). Prints
# `E2E OK kfp-run=<id> mlflow-parent=<id>` last; leaves the cluster up (`make cluster-down`). Root.
KFP_IMAGES := localhost/fp8rl-kfp-driver:2.17.0 localhost/fp8rl-kfp-launcher:2.17.0 localhost/fp8rl-argoexec:v4.0.5
e2e-check: install
	FP8RL_TOOLS_DIR=$(K8S_TOOLS_DIR) $(BIN)/python scripts/kfp_backend/prepare.py --check

e2e-prepare: install
	FP8RL_TOOLS_DIR=$(K8S_TOOLS_DIR) $(BIN)/python scripts/kfp_backend/prepare.py

e2e: e2e-prepare k8s-tools node-deps images
	$(UV_INSTALL) -q -c constraints.txt playwright
	$(BIN)/pytest -p no:cacheprovider tests/integration/test_mlflow_registry.py
	FP8RL_TOOLS_DIR=$(K8S_TOOLS_DIR) scripts/kfp_backend/images.sh
	FP8RL_TOOLS_DIR=$(K8S_TOOLS_DIR) $(BIN)/python scripts/kfp_backend/e2e.py --down
	FP8RL_TOOLS_DIR=$(K8S_TOOLS_DIR) $(BIN)/python scripts/local_cluster.py down
	FP8RL_TOOLS_DIR=$(K8S_TOOLS_DIR) $(BIN)/python scripts/local_cluster.py up \
	  --image localhost/$$($(BIN)/python -c 'from components.images import COMPONENT_IMAGE as i; print(i)') \
	  $(addprefix --image ,$(KFP_IMAGES))
	FP8RL_TOOLS_DIR=$(K8S_TOOLS_DIR) $(BIN)/python scripts/kfp_backend/e2e.py

# The last `make demo` comparison in the real MLflow UI, in headless Chromium (Debian's; root to install it): the
# compare view of its recipe runs and the champion's registered model, as docs/images/mlflow-*.png (docs/tracking.md).
mlflow-ui-shots: install
	scripts/container_tools.sh --ui-only
	$(UV_INSTALL) -q -c constraints.txt playwright
	$(BIN)/python scripts/mlflow_ui_shots.py --work-dir $(WORK) --out docs/images

# --durations: the slowest tests, printed by every run (what CI's time goes to). The cluster and image tiers run in a
# second pytest process beside the rest (scripts/pytest_tiers.sh); `$(BIN)/python -m pytest` runs everything in one.
PYTEST_ARGS ?= --durations=25
test: lint typecheck k8s-tools
	FP8RL_TOOLS_DIR=$(K8S_TOOLS_DIR) PYTHON=$(BIN)/python scripts/pytest_tiers.sh $(PYTEST_ARGS)

# The chart's copies of the built-in recipes (Helm reads only files inside the chart): fp8rl/recipes/*.yaml copied
# to charts/fp8rl/files/recipes/, copies of removed recipes removed; tests/unit/kube keeps the two byte-identical.
chart-recipes:
	rm -f charts/fp8rl/files/recipes/*.yaml
	cp fp8rl/recipes/*.yaml charts/fp8rl/files/recipes/

clean:
	rm -rf $(VENV) $(WORK) dist .pytest_cache .mypy_cache .ruff_cache .hypothesis
