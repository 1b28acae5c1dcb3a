# The two set-up commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

# One install for both targets: the project, its test extras and the cluster extra (Ray Serve, for
# `serve --replicas` and its tests), and torch pinned first so that nothing can pull a CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test,cluster]"
	@touch $@

# The latency lab on the demo model: serve it with chunked prefill on, then off; replay a short `mixed`
# workload against each; print the comparison and each run's diagnosis (about two minutes on two cores).
demo: $(STAMP)
	$(VENV)/bin/twospeed lab-demo

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/bench_engine.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
