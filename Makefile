# Two entry points that work on a fresh machine: `make bench` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
MPIRUN := $(VENV)/bin/mpiexec
NP     ?= 2

.PHONY: setup bench test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch==2.13.0 is the CPU build on disk here; the package itself only asks for torch>=2.3.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[mpich,test,plot]'
	touch $@

setup: $(VENV)/.installed

bench: setup
	$(MPIRUN) -n $(NP) $(PY) bench/all_reduce.py -b 8 -e 64M -f 2 --compare

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
