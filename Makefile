# Two entry points that work on a fresh machine: `make bench` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
MPIRUN := $(VENV)/bin/mpiexec
NP     ?= 2

.PHONY: setup calibrate bench test clean

# setup.py builds the C extensions (commlib.transports._shm, commlib.compress._codecs) from csrc/,
# csrc/shm/ and csrc/compress/: a change there reinstalls too.
$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*.c csrc/*.h csrc/shm/*.c csrc/shm/*.h csrc/compress/*.c csrc/compress/*.h)
	$(PYTHON) -m venv $(VENV)
	# torch==2.13.0 is the CPU build on disk here; the package itself only asks for torch>=2.3.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[mpich,test,plot]'
	touch $@

setup: $(VENV)/.installed

# Measure this host once per rank count (the cost model's tuning file, in ~/.cache/commlib).
calibrate: setup
	$(MPIRUN) -n $(NP) $(PY) bench/calibrate.py --if-missing

# The main job: this host's topology, the calibrated model's pick for a 1 MiB all-reduce, and the
# all-reduce comparison (commlib vs raw mpi4py vs gloo) from 8 B to 64 MiB.
bench: calibrate
	$(PY) -m commlib.topology --picture none
	$(MPIRUN) -n $(NP) $(PY) -c "import commlib; commlib.init(); commlib.get_rank() or print(commlib.tuning.explain('all_reduce', 1 << 20))"
	$(MPIRUN) -n $(NP) $(PY) bench/all_reduce.py -b 8 -e 64M -f 2 --compare

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
