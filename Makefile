# Entry points for newcomers (README): `make demo` and `make test`; `make test-fast` while developing.
# Every target but clean sets up .venv first. Suite sizes and durations: docs/development.md.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DEMO   := runs/demo

.PHONY: setup ops demo test test-fast test-image suite-cost examples lint clean image

# torch first, pinned: 2.13.0 is a CPU build on the development/CI machines; an unpinned torch
# pulled in by deepspeed would be a multi-GB CUDA download. pip compiles every module it installs on one
# core (82 of its 118 s on 2 cores); compileall on all cores writes the same bytecode in 43 s. A few files
# are for other Pythons (torch's py312_intrinsics.py): pip skips them as silently, hence `|| true`.
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-compile --upgrade pip
	$(BIN)/python -m pip install -q --no-compile "torch==2.13.0"
	$(BIN)/python -m pip install -q --no-compile -e ".[train,ray,test,data,track,fp8]"
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	touch $@

setup: $(BIN)/.installed

# DeepSpeed's compiled ops, built into torch's extension cache before anything trains, as the CPU image's
# install.sh prebuilds them: a first build inside a run's start (minutes on 2 cores) runs into the
# launcher's and the tests' deadlines, and one killed midway hangs every later start. Built, it is a
# check of a few seconds; not a stamp, since the cache lives outside the venv (dskit/host/jit_ops.py).
ops: setup
	$(BIN)/python -m dskit.host.jit_ops

# The main job on the embedded default: tiny DeepSeek-V2 (MLA + MoE), 2 CPU ranks, EP=2, ZeRO-3,
# rendered exactly like a cluster job, trained on real text, then exported to Hugging Face format.
demo: ops
	$(BIN)/dskit render slurm --force -o $(DEMO) --job-name demo --gpu cpu --gpus-per-node 2 \
	  --model tiny-v2 --runtime none --set runtime.python=$(abspath $(BIN))/python \
	  --set storage.root=$(abspath runs/storage) --set training.seq_len=256 --set training.global_batch=16 \
	  --set training.steps=150 --set training.lr=3e-3 --set training.log_every=10 --set checkpoint.every=50
	rm -rf runs/storage/demo
	$(BIN)/dskit train --local $(DEMO)
	$(BIN)/dskit status $(DEMO)
	$(BIN)/dskit export $(DEMO) -o runs/demo-hf --force

# Everything (what CI's .ci/run runs after `make lint`): one pytest over the whole suite on two workers.
# tests/support/scheduling.py groups the tests that share a cluster or a reference run, starts the costly
# groups first, gives every test a timeout, and writes each test's seconds (runs/test/suite-cost.json; the
# slowest are printed too). The image tests run where an image input changed since they last passed
# (tests/support/image_gate.py; DSKIT_IMAGE_TESTS=always|never to decide). Duration: docs/development.md.
XDIST      := -n 2 --dist loadscope --no-loadscope-reorder
REPORTS    := runs/test
IMAGE_RUN   = $(shell $(PYTHON) tests/support/image_gate.py)
test: ops
	$(BIN)/python -m pytest $(XDIST) $(if $(filter verified,$(IMAGE_RUN)),-m "not image") -rfE --durations=25 \
	  --junitxml=$(REPORTS)/junit.xml --suite-cost=$(REPORTS)/suite-cost.json

# The image tests alone (the CPU image built with podman: .ci/image-setup.sh first), then the record that
# lets `make test` leave them out until an image input changes again.
test-image: ops
	DSKIT_IMAGE_TESTS=always $(BIN)/python -m pytest -m image -rfE --durations=10 --junitxml=$(REPORTS)/junit-image.xml
	$(PYTHON) tests/support/image_gate.py record

# tests/suite-cost.json (the order of the next runs; docs/development.md's figures) from the last full `make test`
suite-cost:
	$(BIN)/python -m tests.support.scheduling $(REPORTS)/suite-cost.json

# Unit + render + golden tests: no trainer, cluster, pod run, image build or network (duration: docs/development.md).
FAST := not train and not slurm and not ray and not network and not slow and not image
test-fast: setup
	DSKIT_PROPERTY_EXAMPLES=50 $(BIN)/python -m pytest $(XDIST) -m "$(FAST)"

# Regenerate the rendered examples in slurm/ and examples/ (they double as the golden files of the tests),
# images/, helm/dskit/values.schema.json and helm/dskit/files/launch.sh; then review the diff.
examples: setup
	$(BIN)/python -m tests.support.regen_examples

# Build a GPU profile's image with the container engine here (podman, buildah or docker): make image GPU=h100-80gb
GPU ?= cpu
image: setup
	$(BIN)/dskit build image --gpu $(GPU)

lint: setup
	$(BIN)/ruff check dskit tests bench && $(BIN)/ruff format --check dskit tests bench

clean:
	rm -rf $(VENV) runs
