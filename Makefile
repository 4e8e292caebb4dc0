# `make demo` and `make test` work on a fresh machine: they create .venv when absent.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all bench venv clean services dashboard

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 numpy
	$(BIN)/pip install -q -e '.[test,examples,s3,postgres,tensorboard,hdfs,channels,peers]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/digits/demo.py

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 tests

test-all: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m '' tests

bench: $(STAMP)
	$(BIN)/python bench/overhead.py

# Debian packages of the services the tests start (Ceph, PostgreSQL, Slurm); a no-op when present.
# The fixtures install each one too when missing (tests/services/apt.py); CI runs this first so no test pays for it.
services:
	-bash tests/services/install.sh

# The dashboard has no build step; this refreshes the vendored chart library (needs npm).
UPLOT_VERSION := 1.6.32
VENDOR := torchrelay/server/dashboard/static/vendor
dashboard:
	tmp=$$(mktemp -d) && cd $$tmp && npm pack -q uplot@$(UPLOT_VERSION) >/dev/null && tar xzf uplot-*.tgz && \
	cp package/dist/uPlot.iife.min.js package/dist/uPlot.min.css $(CURDIR)/$(VENDOR)/ && \
	cp package/LICENSE $(CURDIR)/$(VENDOR)/uPlot.LICENSE && rm -rf $$tmp

clean:
	rm -rf $(VENV) build *.egg-info
