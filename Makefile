# fl-megatron: `make demo` pre-trains a tiny Llama on 4 CPU ranks (FL+FSDP, 2 groups of 2);
# `make test` runs the test suite. Both create the virtual environment they need first.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
DEMO_RANKS ?= 4
BIN := $(VENV)/bin

.PHONY: demo demo-deepspeed test bench bench-data bench-checkpoint dry-run clean

# torch first, and pinned: a bare requirement would pull a multi-GB CUDA build on CPU machines.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	touch $@

$(VENV)/.package: setup.py $(VENV)/.torch
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.test-extras: setup.py $(VENV)/.package
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.package
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node $(DEMO_RANKS) \
		-m fl_megatron.pretrain --config examples/demo.json $(ARGS)

$(VENV)/.deepspeed: setup.py $(VENV)/.package
	$(BIN)/python -m pip install -q -e ".[deepspeed]"
	touch $@

# The same demo on the DeepSpeed ZeRO-3 backend, under the deepspeed launcher (on CPU:
# --num_gpus sets the process count; --no_local_rank keeps the command line as typed).
demo-deepspeed: $(VENV)/.deepspeed
	PATH="$(abspath $(BIN)):$$PATH" OMP_NUM_THREADS=1 $(BIN)/deepspeed --num_gpus $(DEMO_RANKS) --no_local_rank \
		--master_addr 127.0.0.1 --module fl_megatron.pretrain --config examples/demo.json --backend deepspeed \
		--run-dir runs/demo-deepspeed $(ARGS)

test: $(VENV)/.test-extras
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(ARGS)

bench: $(VENV)/.package
	OMP_NUM_THREADS=1 $(BIN)/python tools/bench_sync.py $(ARGS)

bench-checkpoint: $(VENV)/.package
	OMP_NUM_THREADS=1 $(BIN)/python tools/bench_checkpoint.py $(ARGS)

bench-data: $(VENV)/.package
	OMP_NUM_THREADS=1 $(BIN)/python tools/bench_data.py $(ARGS)

dry-run: $(VENV)/.package
	$(BIN)/python -m fl_megatron.pretrain --model llama3.1-8b --world-size 512 --ranks-per-node 4 \
		--fl-group-size 32 --fl-hsdp-shard-size 4 --bf16 --micro-batch-size 2 --seq-length 8192 --dry-run

clean:
	rm -rf $(VENV) runs *.egg-info
