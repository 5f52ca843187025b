# Two commands on a fresh machine: `make demo` and `make test`. Each builds the
# virtual environment it needs first (torch pinned to the CPU build of 2.13.0 here;
# a GPU host installs the CUDA build of the same version).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-gpu test-fleet test-bench lint ruff typecheck chaos prove bench bench-full bench-gpu bench-texts

# Everything through uv, torch included, which installs in 13 s what pip took 30 s of
# CI's time for. uv reads no pip.conf: the machine's own build of torch is found where
# pip would find it, in PIP_FIND_LINKS (a folder of wheels here; unset on a GPU host,
# which gets the CUDA build of the same version from the index). Compiled to bytecode
# as pip does: where PYTHONDONTWRITEBYTECODE is set (CI's machines), every process
# would otherwise compile botocore and the rest from source at each start.
$(VENV)/installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv
	$(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) \
		$(addprefix --find-links ,$(PIP_FIND_LINKS)) -e '.[dev]'
	touch $@

demo: $(VENV)/installed
	$(PY) -m worker demo

# checkov pins boto3, botocore, packaging and networkx below the project's releases: it
# gets a virtual environment of its own (tests/test_deploy.py runs it from there).
$(VENV)/checkov/installed: $(VENV)/installed
	$(VENV)/bin/uv venv --quiet --python $(PYTHON) $(VENV)/checkov
	$(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(VENV)/checkov/bin/python checkov==3.3.30
	touch $@

lint: ruff typecheck

ruff: $(VENV)/installed
	$(PY) -m ruff check worker stages bench tests
	$(PY) -m ruff format --check worker stages bench tests

typecheck: $(VENV)/installed
	$(PY) -m mypy

# Four tests at a time on 2 cores: the unit tests spend two thirds of their time waiting
# on timers and children, the end-to-end ones near half on moto and child processes. Each
# worker starts with its share of the long tests (tests/durations.json). The slowest are
# listed at the end. mypy, half a minute of one core on a fresh clone, runs beside them:
# its report comes after theirs, and either failing fails `make test`. The project's own
# modules are compiled to bytecode first, as the environment's are: where
# PYTHONDONTWRITEBYTECODE is set, every process compiled those it imports from source,
# 0.22 CPU-s of each daemon's start (0.17 in its main process), a hundred starts a run.
test: ruff $(VENV)/checkov/installed
	$(PY) -m compileall -q worker stages tests bench
	@$(MAKE) --no-print-directory typecheck > $(VENV)/typecheck.log 2>&1 & typecheck=$$!; \
	$(PY) -m pytest -n 4 --dist worksteal --durations=15; tests=$$?; \
	wait $$typecheck; typed=$$?; cat $(VENV)/typecheck.log; \
	if [ $$tests -ne 0 ]; then exit $$tests; fi; exit $$typed

# On a GPU host (the CUDA build of torch and its torchvision): the tests marked `gpu`
# (nvJPEG, bf16 and channels-last, two inference processes on one GPU, a real CUDA
# out-of-memory, the warm-up), one at a time since one of them fills the GPU on purpose.
# `make test` skips them where there is no GPU.
test-gpu: $(VENV)/installed
	$(PY) -m pytest -m gpu -p no:xdist

# Not part of `make test`: one job of 20,000 inputs (FLEET_ITEMS) over four daemons
# killed at random, for many minutes of moto's time.
test-fleet: $(VENV)/installed
	$(PY) -m pytest -m fleet -p no:xdist

# Not part of `make test`: each benchmark step run end to end on a small size (the tests
# marked `bench`), that `make bench` still measures what it says; about 5 minutes.
test-bench: $(VENV)/installed
	$(PY) -m pytest -m bench -n 3 --dist worksteal

# Not part of `make test`: the randomized fault test with more seeds, each for longer
# (about 2 minutes a seed on 2 cores). `make test` plays one seed for 20 s.
chaos: $(VENV)/installed
	CHAOS_SEEDS=$${CHAOS_SEEDS:-1,2,4,5,6} CHAOS_SECONDS=$${CHAOS_SECONDS:-90} \
		$(PY) -m pytest tests/e2e/test_random_fault_schedules.py

# Not part of `make test`: the fleet's protocol played in many more orders, at random
# (PROTOCOL_EXAMPLES games of up to 60 steps; `make test` plays the same 60 short ones
# each time). Tens of minutes on 2 cores.
prove: $(VENV)/installed
	PROTOCOL_PROOF=long PROTOCOL_EXAMPLES=$${PROTOCOL_EXAMPLES:-2000} \
		$(PY) -m pytest tests/test_protocol_properties.py --timeout 0

# Not part of `make test`: minutes of CPU on purpose. Writes bench-out/report.json,
# timeline.json (Chrome trace) and timeline.png.
bench: $(VENV)/installed
	$(PY) -m worker bench --quick --out bench-out

bench-full: $(VENV)/installed
	$(PY) -m worker bench --out bench-out

# Not part of `make test`: issue 40's run, a table of TEXTS_ROWS texts (a million) over
# TEXTS_DAEMONS daemons against a moto server, every embedding checked against the
# model's own; 7 to 12 minutes on 2 cores. Writes bench-out/texts_fleet.json.
bench-texts: $(VENV)/installed
	mkdir -p bench-out
	$(PY) -m bench.texts_fleet --rows $${TEXTS_ROWS:-1000000} --daemons $${TEXTS_DAEMONS:-3} \
		--out bench-out/texts_fleet.json

# On a GPU host: the figures only a GPU gives (bench/gpu.py), into bench-out-gpu/.
bench-gpu: $(VENV)/installed
	$(PY) -m bench.gpu --out bench-out-gpu
