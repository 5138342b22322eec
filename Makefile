# The two quick-start targets: `make demo` and `make test` (both set up .venv first).
PY := .venv/bin/python

.PHONY: setup demo test test-slow test-all test-gpu test-floor lint bench-speed validate-gpu validate-gpu-dry-run

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m anatomist estimate

# Tests run in pytest-xdist workers, one per core up to 4, a test file per worker at a time
# (--dist loadfile: a module's fixtures are built once). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

test: setup
	@bash scripts/install_browser.sh
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The tests marked slow (real training runs in subprocesses, full-size identity cases, real CPU
# timing): CI runs them after the default run.
test-slow: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m slow

test-all: setup
	$(PY) -m pytest -q -m "not gpu"

test-gpu: setup
	$(PY) -m pytest -q -m gpu

# The dependency floors of pyproject.toml, in a venv of their own (.venv-floor, rebuilt each
# time; needs PyPI, ~4 min): docs/floors.md.
test-floor:
	@bash scripts/test_floor.sh

lint: setup
	$(PY) -m ruff check src tests
	$(PY) -m mypy src

bench-speed: setup
	$(PY) benchmarks/estimate_speed.py

# Every GPU check in one resumable command, on a machine with a CUDA GPU (its python3, or
# PYTHON=...): results in benchmarks/gpu/<device>/. ARGS="--part a" etc.; see benchmarks/gpu/README.md.
validate-gpu:
	bash benchmarks/gpu/validate.sh $(ARGS)

validate-gpu-dry-run: setup
	PYTHON=$(PY) bash benchmarks/gpu/validate.sh --dry-run $(ARGS)
