# The two set-up commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-task test-real fuzz mutation bench clean

# One install for both targets: the project, its test extras and the cluster extra (Ray Serve, for
# `serve --replicas` and its tests), and torch pinned first so that nothing can pull a CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test,cluster]"
	@touch $@

# The latency lab on a real instruct model: fetch the built-in `smollm2` on first use (SmolLM2-135M-Instruct,
# ~100 MB, once), serve it with chunked prefill on, then off; replay a short `tasks` workload against each as
# chat requests; print the comparison and each run's diagnosis.
demo: $(STAMP)
	$(VENV)/bin/twospeed lab-demo

# The suite, hypothesis under its derandomized `ci` profile (tests/conftest.py): the same examples every run.
test: $(STAMP)
	$(PY) -m pytest

# The tests that need the trained demo-task (built once into TWOSPEED_CACHE, about ten minutes on two cores).
test-task: $(STAMP)
	$(PY) -m pytest -m task_model

# The tests on the built-in real model, smollm2 (fetched once into TWOSPEED_CACHE, ~100 MB).
test-real: $(STAMP)
	$(PY) -m pytest -m real_model -s

# The wide randomized search: the hypothesis tests once per seed, 1..FUZZ_SEEDS, under the `fuzz` profile.
# A failure names its seed; `pytest -m hypothesis --hypothesis-profile=fuzz --hypothesis-seed=N` replays it.
FUZZ_SEEDS ?= 20
fuzz: $(STAMP)
	@for seed in $$(seq 1 $(FUZZ_SEEDS)); do \
		echo "hypothesis seed $$seed"; \
		OMP_NUM_THREADS=1 $(PY) -m pytest -m hypothesis -q -p no:cacheprovider --hypothesis-profile=fuzz \
			--hypothesis-seed=$$seed || exit 1; \
	done

# Mutation testing (mutmut) of the torch-free bookkeeping against its fast tests ([tool.mutmut] in
# pyproject.toml); 45 minutes or so on two busy cores. Survivors: `.venv/bin/mutmut results`, `mutmut show NAME`.
MUTATION_JOBS ?= 2
mutation: $(STAMP)
	$(PY) -m pip install --quiet -e ".[mutation]"
	rm -rf mutants
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/mutmut run --max-children $(MUTATION_JOBS)
	$(VENV)/bin/mutmut results

bench: $(STAMP)
	$(PY) benchmarks/bench_engine.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis mutants
