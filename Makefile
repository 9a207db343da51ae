# fl-megatron: `make demo` pre-trains a tiny Llama on 4 CPU ranks (FL+FSDP, 2 groups of 2)
# (`make demo ARGS="--backend megatron"`: on megatron-core); `make test` runs the test suite.
# Both create the virtual environment they need first.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# where pip finds torch: unset, PyPI (a CUDA build on Linux x86-64); for the CPU wheel on a
# machine with internet, TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
# the demo and the tests run CPU ranks on gloo even where GPUs are (see FL_MEGATRON_DEVICE)
export FL_MEGATRON_DEVICE ?= cpu
DEMO_RANKS ?= 4
BIN := $(VENV)/bin

.PHONY: demo demo-hf demo-deepspeed demo-elastic test test-heavy test-torch-floor check-targets gpu-bundle lint bench bench-codec bench-data bench-checkpoint bench-cluster bench-quality cost-model dry-run clean

# torch first, and pinned: a bare requirement would pull a multi-GB CUDA build on CPU machines.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q \
		$(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	touch $@

$(VENV)/.package: setup.py $(VENV)/.torch
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.test-extras: setup.py $(VENV)/.package
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

# ARGS="--backend megatron": the same demo on megatron-core's distributed optimizer (installed first).
DEMO_MEGATRON := $(findstring --backend megatron,$(ARGS))

demo: $(VENV)/.package $(if $(DEMO_MEGATRON),$(VENV)/.megatron)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node $(DEMO_RANKS) \
		-m fl_megatron.pretrain --config examples/demo.json $(if $(DEMO_MEGATRON),--run-dir runs/demo-megatron) \
		--save $(if $(DEMO_MEGATRON),runs/demo-megatron,runs/demo)/ckpt --keep-last 1 $(ARGS)

# The demo's model, exported to Hugging Face format (runs/demo/ckpt-hf, replaced each time) and
# asked to continue a prompt with transformers: run `make demo` first.
demo-hf: $(VENV)/.hf
	@test -f runs/demo/ckpt/latest_checkpointed_iteration.txt || \
		{ echo "demo-hf: runs/demo/ckpt holds no checkpoint: run make demo first" >&2; exit 1; }
	rm -rf runs/demo/ckpt-hf
	$(BIN)/python tools/convert_checkpoint_to_hf.py --checkpoint runs/demo/ckpt --output runs/demo/ckpt-hf
	$(BIN)/python tools/generate_hf.py runs/demo/ckpt-hf --prompt "$(or $(PROMPT),def read(self, path):)"

$(VENV)/.hf: setup.py $(VENV)/.package
	$(BIN)/python -m pip install -q -e ".[hf]"
	touch $@

$(VENV)/.megatron: setup.py $(VENV)/.package
	$(BIN)/python -m pip install -q -e ".[megatron]"
	touch $@

$(VENV)/.deepspeed: setup.py $(VENV)/.package
	$(BIN)/python -m pip install -q -e ".[deepspeed]"
	touch $@

# The same demo on the DeepSpeed ZeRO-3 backend, under the deepspeed launcher (on CPU:
# --num_gpus sets the process count; --no_local_rank keeps the command line as typed).
demo-deepspeed: $(VENV)/.deepspeed
	PATH="$(abspath $(BIN)):$$PATH" OMP_NUM_THREADS=1 $(BIN)/deepspeed --num_gpus $(DEMO_RANKS) --no_local_rank \
		--master_addr 127.0.0.1 --module fl_megatron.pretrain --config examples/demo.json --backend deepspeed \
		--run-dir runs/demo-deepspeed --save runs/demo-deepspeed/ckpt --keep-last 1 $(ARGS)

$(VENV)/.elastic: setup.py $(VENV)/.package
	$(BIN)/python -m pip install -q -e ".[elastic]"
	touch $@

# Elastic mode: a torchft lighthouse plus 3 groups of 2 CPU ranks, each group its own torchrun job
# (tools/elastic_launch.py; each group writes runs/demo-elastic/group_GGGGG/). It shows group 0's
# progress and every group's heals, restarts and last line; Ctrl-C stops every process it started.
demo-elastic: $(VENV)/.elastic
	OMP_NUM_THREADS=1 $(BIN)/python tools/elastic_launch.py --groups 3 --ranks-per-group 2 --min-groups 2 \
		-- --config examples/demo.json --run-dir runs/demo-elastic $(ARGS)

# ruff first (ruff.toml: pyflakes, pycodestyle, bugbear): seconds, and a lint error stops the run
test: $(VENV)/.test-extras lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(ARGS)

# The oldest torch fl-megatron supports (fl_megatron/torch_version.py: 2.11, the lent GPU machine's),
# in an environment of its own: the tests that reach into torch's APIs (FSDP2, DeviceMesh, DCP,
# gloo's collectives, the three backends, torchft, the Hugging Face round trip) and the demo's
# training (runs/demo-torch-floor, nothing saved). PyPI's torch 2.11.0 is a CUDA build; it runs on CPU.
TORCH_FLOOR_SPEC ?= torch==2.11.0
FLOOR_VENV ?= .venv-torch-floor
FLOOR_TESTS ?= tests/test_fsdp2_backend.py tests/test_models.py tests/test_launch.py tests/test_config_errors.py \
	tests/test_averaging_single_process.py tests/test_backend_contract.py tests/test_torchft_peer.py \
	tests/test_elastic_quorum.py tests/test_gpu_check.py \
	tests/test_federation_exactness.py::test_fl_fsdp_equals_fsdp_and_syncs_are_exact \
	tests/test_federation_exactness.py::test_fl_hsdp_replica_split_equals_naive_and_hsdp \
	tests/test_deepspeed_backend.py::test_fl_fsdp_on_zero3_equals_zero3_and_syncs_are_exact \
	tests/test_megatron_backend.py::test_megatron_backend_matches_megatron_core_over_all_ranks_and_fsdp2 \
	tests/test_checkpoints.py::test_fsdp2_resumes_on_other_group_sizes_and_group_counts \
	tests/test_checkpoints.py::test_fsdp2_async_save_resumes_exactly_and_survives_a_kill_while_writing \
	tests/test_checkpoints.py::test_sigterm_to_torchrun_saves_but_torchrun_exits_1 \
	tests/test_outer_sync.py::test_every_sync_option_on_every_backend \
	tests/test_outer_sync.py::test_hsdp_overlap_on_its_own_communicators_matches_the_unthreaded_run \
	tests/test_hf_export.py::test_default_export_is_the_groups_mean_and_transformers_agrees \
	tests/test_hf_export.py::test_init_from_hf_reads_each_rank_its_rows \
	tests/test_unequal_training.py::test_groups_of_4_and_2_ranks_train_and_sync_to_the_mean_of_the_groups_alone
test-torch-floor:
	$(MAKE) VENV=$(FLOOR_VENV) TORCH_SPEC="$(TORCH_FLOOR_SPEC)" TORCH_INDEX= $(FLOOR_VENV)/.test-extras
	$(FLOOR_VENV)/bin/python -c "import torch; print('test-torch-floor: torch', torch.__version__)"
	OMP_NUM_THREADS=1 $(FLOOR_VENV)/bin/python -m pytest $(FLOOR_TESTS) $(ARGS)
	OMP_NUM_THREADS=1 $(FLOOR_VENV)/bin/torchrun --standalone --nproc-per-node $(DEMO_RANKS) \
		-m fl_megatron.pretrain --config examples/demo.json --run-dir runs/demo-torch-floor

# The wheels a GPU machine with no network needs beside its own torch (.gpu-carry/, for
# tools/gpu_check.sh --install): DeepSpeed, megatron-core, torchft, fl-megatron and what they pull in.
gpu-bundle:
	bash tools/gpu_bundle.sh

# Each README target (demo, demo-hf, demo-deepspeed, demo-elastic, the megatron demo) briefly, in a
# fresh copy of the tree with its own environment built from scratch: make test's environment holds
# every extra and would hide a missing install step (tools/check_targets.py; CI runs it after make test).
check-targets:
	$(PYTHON) tools/check_targets.py --python $(PYTHON) $(ARGS)

lint: $(VENV)/.test-extras
	$(BIN)/ruff check .

# The slow end-to-end variants make test leaves out (pytest -m heavy): elastic kills with int8 +
# error feedback + nesterov, with FL+HSDP and on DeepSpeed, a peer lost mid-sync (int8 + error
# feedback + nesterov, and FL+HSDP), a peer that hangs in a sync, a group leaving and another joining, the elastic resume, a heal across group sizes with HSDP, the
# exact resume of the outer and error-feedback state without fragments.
test-heavy: $(VENV)/.test-extras
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m heavy $(ARGS)

bench: $(VENV)/.package
	OMP_NUM_THREADS=1 $(BIN)/python tools/bench_sync.py $(ARGS)

bench-codec: $(VENV)/.package
	$(BIN)/python tools/bench_codec.py $(ARGS)

bench-checkpoint: $(VENV)/.package
	OMP_NUM_THREADS=1 $(BIN)/python tools/bench_checkpoint.py $(ARGS)

# The speed-up on an emulated two-tier cluster (network namespaces, needs root; unshaped without),
# beside the cost model, torchft and DeepSpeed: ARGS="--nodes 4 --rows fsdp hsdp fl-fsdp ..." for HSDP rows.
$(VENV)/.bench-extras: setup.py $(VENV)/.package
	$(BIN)/python -m pip install -q -e ".[deepspeed,peers,plots]"
	touch $@

bench-cluster: $(VENV)/.bench-extras
	OMP_NUM_THREADS=1 $(BIN)/python tools/bench_cluster.py $(ARGS)

# Evaluation perplexity of FSDP vs FL+FSDP and HSDP vs FL+HSDP at equal tokens, three seeds.
bench-quality: $(VENV)/.package
	OMP_NUM_THREADS=1 $(BIN)/python tools/bench_quality.py $(ARGS)

# Predicted time per step and speed-ups of the published setup (ARGS: pretrain and cluster flags instead).
cost-model: $(VENV)/.package
	$(BIN)/python tools/cost_model.py $(if $(ARGS),$(ARGS),--preset published)

bench-data: $(VENV)/.package
	OMP_NUM_THREADS=1 $(BIN)/python tools/bench_data.py $(ARGS)

dry-run: $(VENV)/.package
	$(BIN)/python -m fl_megatron.pretrain --model llama3.1-8b --world-size 512 --ranks-per-node 4 \
		--fl-group-size 32 --fl-hsdp-shard-size 4 --bf16 --micro-batch-size 2 --seq-length 8192 \
		--recompute-activations --dry-run

clean:
	rm -rf $(VENV) runs *.egg-info
