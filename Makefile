# The two quick-start targets: `make demo` and `make test` (both set up .venv first).
PY := .venv/bin/python

.PHONY: setup demo test test-all test-gpu lint bench-speed

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m anatomist estimate

test: setup
	@bash scripts/install_browser.sh
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q -m "not gpu"

test-gpu: setup
	$(PY) -m pytest -q -m gpu

lint: setup
	$(PY) -m ruff check src tests
	$(PY) -m mypy src

bench-speed: setup
	$(PY) benchmarks/estimate_speed.py
