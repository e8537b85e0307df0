# The two commands of the README: `make demo` (set up, then run the main job) and `make test`.
.PHONY: setup demo test lint bench

.venv/.installed: pyproject.toml scripts/install.sh
	bash scripts/install.sh
	touch $@

setup: .venv/.installed

demo: .venv/.installed
	.venv/bin/proctor demo

test: .venv/.installed
	.venv/bin/python -m pytest -q

lint: .venv/.installed
	.venv/bin/ruff check .
