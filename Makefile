# flywheel: `make demo` and `make test` do everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# GPU users: make setup TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev
# The stamp is per torch spec and lists the extras installed in $(VENV), one per line. A set of
# extras counts as installed when it is a subset of that list (`make demo` after `make bench`
# installs nothing); otherwise setup installs the union, so no extra installed earlier is lost.
comma := ,
empty :=
space := $(empty) $(empty)
STAMP := $(VENV)/.installed-$(shell echo '$(TORCH_SPEC)' | cksum | cut -d' ' -f1)
NEEDED_EXTRAS := $(sort $(subst $(comma),$(space),$(EXTRAS)))
INSTALLED_EXTRAS := $(sort $(shell cat $(STAMP) 2>/dev/null))
MISSING_EXTRAS := $(filter-out $(INSTALLED_EXTRAS),$(NEEDED_EXTRAS))
INSTALL_EXTRAS := $(subst $(space),$(comma),$(sort $(INSTALLED_EXTRAS) $(NEEDED_EXTRAS)))
THREADS ?= 2
SYSTEM_PACKAGES ?= bubblewrap

.PHONY: setup demo test test-all bench clean system-deps missing-extras

setup: $(STAMP)

# Re-runs only when pyproject.toml or the torch spec changes, or an extra asked for is missing;
# otherwise `make setup` is a no-op.
$(STAMP): pyproject.toml $(if $(MISSING_EXTRAS),missing-extras)
	@$(MAKE) --no-print-directory system-deps
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e '.[$(INSTALL_EXTRAS)]'
	@rm -f $(VENV)/.installed-*
	@printf '%s\n' $(subst $(comma),$(space),$(INSTALL_EXTRAS)) > $@

missing-extras:
	@echo "extras to install: $(MISSING_EXTRAS) (installed: $(or $(INSTALLED_EXTRAS),none))"

# Debian packages the project needs (bubblewrap for the sandbox; make test-all adds postgresql),
# installed when missing.
system-deps:
	@missing=""; for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if command -v apt-get >/dev/null; then \
	    SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	    echo "installing Debian packages:$$missing"; \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	  else echo "warning: please install$$missing (no apt-get here)"; fi; \
	fi

demo: setup
	OMP_NUM_THREADS=$(THREADS) $(PY) -m flywheel.demo --threads $(THREADS)

# Two pytest workers, a test file each at a time (a module's fixtures are built once). Bytecode
# is cached for the run even where the shell sets PYTHONDONTWRITEBYTECODE: otherwise each worker,
# and each server and worker process a test starts, compiles flywheel and the tests anew.
# One OpenMP thread per worker and per process it starts: two workers with two threads each
# oversubscribe the two cores, and the spinning threads cost 14 s of the run.
TEST_WORKERS ?= 2
test: setup
	OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Everything, the learning tests and the browser tests (Debian's chromium) included, and the database tests against a PostgreSQL server
# the test session starts (tests/conftest.py) as well as against SQLite; extra ray: the Ray backend.
test-all:
	@$(MAKE) --no-print-directory setup EXTRAS=dev,postgres,ray,browser SYSTEM_PACKAGES="bubblewrap postgresql chromium"
	PYTHONDONTWRITEBYTECODE= FLYWHEEL_TEST_POSTGRES=1 $(PY) -m pytest -q -m ''

# Every benchmark, each printing its last line `name: key=value ...` and appending its table to
# docs/benchmarks.md. They also need the peers (extra `bench`: trl, datasets, accelerate, pinned).
BENCHES := generate sft envs sandbox code_repair swe serve traces weights async rl_update_parity rl_vs_trl rl_ablation demo api lora_serve openmp_teams backends learner scale_sim busy_machine learning_matrix real_model judge_agreement
bench:
	@$(MAKE) --no-print-directory setup EXTRAS=dev,bench,ray
	@$(MAKE) --no-print-directory system-deps SYSTEM_PACKAGES="bubblewrap wrk"  # wrk: bench/api.py's load generator
	@mkdir -p bench-work
	@for b in $(BENCHES); do \
	  echo "== bench/$$b.py"; \
	  args=$$(grep -q '"--threads"' bench/$$b.py && echo --threads $(THREADS)); \
	  OMP_NUM_THREADS=$(THREADS) $(PY) bench/$$b.py $$args > bench-work/$$b.log 2>&1 \
	    || { tail -20 bench-work/$$b.log; echo "bench/$$b.py failed (bench-work/$$b.log)"; exit 1; }; \
	  tail -1 bench-work/$$b.log; \
	done

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info src/*.egg-info
