# hvd_terngrad: the two commands of the README, and a few helpers.
#   make train   install what is missing, then the 2-worker digits training (FP32, then TernGrad), on an
#                emulated 1 Gbit/s link where the machine allows it
#   make test    install what is missing, then lint and the full test suite
#   make docker  build the CPU image and run a 2-container job in it (docker/build.sh --cluster)
#   make train-ddp  the digits training on PyTorch DDP (torchrun), FP32 and then TernGrad's hook
#   make docs    the API reference from the docstrings (pdoc) into build/api/
SHELL := /bin/bash
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
# an MPI rank that waits yields its core: with more ranks than cores (bench-fidelity's 4 on a 2-core machine),
# ranks that busy-poll take the cores their peers need (a 4-rank job on 2 cores: 10x slower steps, measured)
export OMPI_MCA_mpi_yield_when_idle := 1
NP ?= 2
# pytest workers of make test (the container job takes one, mostly waiting on podman)
TEST_WORKERS ?= 2

.PHONY: install train train-ddp test lint docs docker bench-codec bench-fidelity clean

install:
	@bash scripts/install.sh

# rank 0's report without horovodrun's tags; every rank's output in build/train-logs/. Where this machine can
# emulate a cluster (root, network namespaces: benchmarks/cluster.py), each worker is a node on a LINK link
# (default 1 Gbit/s Ethernet), so the times show what the link costs; LINK=local, or a machine without
# namespaces, runs the workers on localhost, where the link is free.
LINK ?= ethernet-1g
train: install
	@set -o pipefail; if [ "$(LINK)" != local ] && $(PY) -m benchmarks.cluster check 2>/dev/null; then \
		timeout 900 $(PY) -m benchmarks.cluster run --stream --tag-output --timeout 840 --nodes $(NP) \
			--profile $(LINK) -- $(PY) -m examples.train_digits 2>&1 | $(PY) scripts/rank0_report.py build/train-logs; \
	else \
		echo "$(NP) workers on localhost, where the link is free (no emulated link: it needs root and network namespaces)"; \
		timeout 600 $(VENV)/bin/horovodrun -np $(NP) $(PY) -m examples.train_digits --free-link 2>&1 \
			| $(PY) scripts/rank0_report.py build/train-logs; \
	fi

# the same job on PyTorch DDP with TernGrad's communication hook: torchrun, no Horovod
train-ddp: install
	@set -o pipefail; timeout 600 $(VENV)/bin/torchrun --standalone --nproc_per_node $(NP) -m examples.train_digits_ddp 2>&1 \
		| grep -v '^W[0-9]* .*torch/distributed/run.py\|OMP_NUM_THREADS\|\*\*\*\*\*'

lint: install
	@$(VENV)/bin/ruff check .

# two pytest workers: the container job (mostly waiting on podman and pip) runs beside the rest of the suite
test: install
	@$(VENV)/bin/ruff check .
	@$(PY) -m pytest tests -q -ra --timeout 600 -n $(TEST_WORKERS) --dist loadgroup --durations=15

docs: install
	@$(PY) scripts/api_reference.py build/api

docker: install
	@bash docker/build.sh --cluster

bench-codec: install
	@$(PY) -m benchmarks.codec_bench

bench-fidelity: install
	@timeout 1800 $(VENV)/bin/horovodrun -np 4 $(PY) -m benchmarks.fidelity

clean:
	rm -rf build hvd_terngrad/*.so *.egg-info
