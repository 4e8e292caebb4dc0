# `make demo` and `make test` work on a fresh machine: they create .venv when absent.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all bench venv clean services

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 numpy
	$(BIN)/pip install -q -e '.[test,examples,s3,postgres,tensorboard]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/digits/demo.py

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests

test-all: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m '' tests

bench: $(STAMP)
	$(BIN)/python bench/overhead.py

# Debian packages of the services the tests start (Ceph, PostgreSQL, Slurm); a no-op when present.
# The fixtures install them too when missing; CI runs this first so no test pays for it.
services:
	-bash tests/services/install.sh

clean:
	rm -rf $(VENV) build *.egg-info
