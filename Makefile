# The two commands of the README: `make demo` (set up, then run the main job) and `make test`.
.PHONY: setup demo test lint bench

.venv/.installed: pyproject.toml scripts/install.sh
	bash scripts/install.sh
	touch $@

# vLLM-Omni's own environment: the vllm_omni engine's suites serve from it (tests/support/omni.py).
.venv-omni/.installed: scripts/install_omni.sh tests/omni_cpu_platform/pyproject.toml
	bash scripts/install_omni.sh

setup: .venv/.installed

demo: .venv/.installed
	.venv/bin/proctor demo

test: .venv/.installed .venv-omni/.installed
	.venv/bin/python -m pytest -q

lint: .venv/.installed
	.venv/bin/ruff check .
