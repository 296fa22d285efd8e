# liubai: `make run` opens the chat (`make run PROMPT="..."` answers one prompt headless);
# `make test` runs lint, types and tests.
# Both create .venv on first use, reinstall only when pyproject.toml changes (a stamp file),
# and pull the default model and tiktoken's encodings once into ~/.cache/liubai (no Hub access needed).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.liubai-installed
PROMPT ?=
export PROMPT

.PHONY: setup pull run test lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: that exact version resolves to the local CPU wheel, while a bare
# `torch` requirement could pull a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -e '.[test]'
	touch $@

setup: $(STAMP)

pull: setup
	$(BIN)/liubai pull
	$(BIN)/liubai pull tiktoken

run: pull
	@if [ -n "$$PROMPT" ]; then $(BIN)/liubai run "$$PROMPT"; else $(BIN)/liubai chat; fi

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy runtime agent memory tui

test: pull lint
	$(BIN)/pytest -q
