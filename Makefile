# Two commands on a fresh clone (README, first section):
#   make demo   creates .venv if missing, installs kconvert with its test tools, converts the
#               bundled tiny Kimi-K2-Thinking INT4 checkpoint to NVFP4 and audits it
#   make test   the same venv; ruff, then the test suite (what CI runs: .ci/run)

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
DEMO_SRC := tests/fixtures/tiny-k2-thinking-int4
DEMO_DST ?= /tmp/tiny-nvfp4
BIN := $(VENV)/bin

.PHONY: demo test install

demo: install
	$(BIN)/kconvert int4-to-nvfp4 $(DEMO_SRC) $(DEMO_DST) --overwrite
	$(BIN)/kconvert audit $(DEMO_DST) --source $(DEMO_SRC)

test: install
	$(BIN)/ruff check kconvert scripts tests benchmarks
	$(BIN)/python -m pytest -q

install: $(VENV)/.installed

# Reinstalled when pyproject.toml changes (its dependencies may have).
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)" -e ".[test]"
	touch $@
