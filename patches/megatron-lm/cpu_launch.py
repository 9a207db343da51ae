"""Run a (patched) Megatron-LM script on CPU ranks with gloo: tests and demos only, not part of
the patch series.

    torchrun --nproc-per-node 4 patches/megatron-lm/cpu_launch.py MEGATRON_LM_DIR/pretrain_gpt.py \\
        --distributed-backend gloo ... (Megatron-LM's flags)

With CUDA available it only runs the script. Without, it enters fl-megatron's `cpu_compat()` for
the whole process (CUDA placements -> CPU, megatron's RNG tracker on the CPU generator), makes
Megatron-LM's "Megatron requires CUDA" checks pass (torch.cuda.is_available/device_count/
set_device/synchronize and memory statistics), and, if triton is not installed, replaces the one
triton module Megatron-LM imports at module level (batch-invariant kernels) by a stand-in. Then
it runs the script with runpy, as `python script.py ...` would.
"""

import importlib.util
import os
import runpy
import sys
import types


def _stub_batch_invariant_kernels() -> None:
    """Megatron-LM's initialize.py imports this triton-only module at module level; without
    triton, a stand-in whose switches refuse to turn batch-invariant mode on."""
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    module = types.ModuleType(name, "CPU stand-in (no triton): batch-invariant mode is unavailable")

    def enable_batch_invariant_mode(*args, **kwargs):
        raise RuntimeError("batch-invariant mode needs triton (CUDA)")

    module.enable_batch_invariant_mode = module.set_batch_invariant_mode = enable_batch_invariant_mode
    module.disable_batch_invariant_mode = lambda *a, **kw: None
    module.is_batch_invariant_mode_enabled = lambda: False
    sys.modules[name] = module


def _pretend_cuda() -> None:
    """What Megatron-LM asks of torch.cuda before and around training, answered on CPU."""
    import torch

    from fl_megatron.backends.megatron_cpu import install_cpu_rng_tracker

    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **kw: None
    cuda.synchronize = lambda *a, **kw: None
    cuda.empty_cache = lambda: None
    cuda.manual_seed = cuda.manual_seed_all = lambda *a, **kw: None
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda *a, **kw: 0)
    cuda.memory_stats = lambda *a, **kw: {}
    cuda.reset_peak_memory_stats = lambda *a, **kw: None
    cuda.current_stream = cuda.default_stream = lambda *a, **kw: cuda.Stream()  # inert under cpu_compat()
    cuda.get_rng_state = lambda *a, **kw: torch.get_rng_state()
    # validate_args asks for the GPU generation with TP or CP > 1 (get_device_arch_version): answer
    # an Ampere-like sm_80, whose rules (CUDA_DEVICE_MAX_CONNECTIONS=1 with TP) are the strictest
    cuda.get_device_properties = lambda *a, **kw: types.SimpleNamespace(
        name="CPU (cpu_launch.py)", major=8, minor=0, total_memory=0, multi_processor_count=1)
    cuda.get_device_capability = lambda *a, **kw: (8, 0)
    cuda.set_rng_state = lambda *a, **kw: None

    import megatron.core.tensor_parallel as tp
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.legacy import fused_kernels
    from megatron.training import initialize

    fused_kernels.load = lambda args: None  # nvcc-built CUDA kernels
    initialize._warmup_jit_function = lambda: None  # fusions are off on CPU (TORCH_COMPILE_DISABLE)
    original = megatron_random.model_parallel_cuda_manual_seed

    def seed_on_cpu(seed, *args, **kwargs):
        torch.manual_seed(seed)
        install_cpu_rng_tracker(seed)

    megatron_random.model_parallel_cuda_manual_seed = seed_on_cpu
    if getattr(tp, "model_parallel_cuda_manual_seed", None) is original:
        tp.model_parallel_cuda_manual_seed = seed_on_cpu


def _optimizer_state_before_the_first_step() -> None:
    """Two fixes of megatron's checkpoint load on torch's Adam (no Apex, no Transformer Engine:
    the CPU case). First, loading a checkpoint builds the distributed optimizer's state dict before any step. Without
    Apex or Transformer Engine (CPU) megatron reads Adam's 'step' from the inner state there,
    which torch's Adam creates only at its first step, and fails (`assert len(steps) == 1`). Give
    it the zero state megatron's own init_state_fn makes, with step 0; the load overwrites it."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.state_dict

    def state_dict(self):
        inner = self.optimizer
        if not inner.state and getattr(self, "init_state_fn", None) is not None:
            self.init_state_fn(inner, self.config)
            for group in inner.param_groups:
                for param in group["params"]:
                    inner.state[param]["step"] = torch.tensor(0.0)
        return original(self)

    DistributedOptimizer.state_dict = state_dict
    original_load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        """Without Apex or TE, megatron keeps Adam's step count in the param groups of its
        checkpoint; its distributed load leaves torch's per-parameter 'step' at what the state
        held before (one tensor shared by all): set each to the loaded count, a tensor of its own."""
        original_load(self, state_dict)
        for group in self.optimizer.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = self.optimizer.state.get(param)
                if state:
                    state["step"] = torch.tensor(float(group["step"]))

    DistributedOptimizer.load_state_dict = load_state_dict


def _spawn_children_from_here(script: str) -> None:
    """Processes spawned by the script (megatron's checkpoint writer) start from this file, not
    the script: re-running the script's imports there would need the stand-ins again."""
    import multiprocessing.spawn as spawn

    original = spawn.get_preparation_data

    def preparation_data(name):
        data = original(name)
        if data.get("init_main_from_path") == script:
            data["init_main_from_path"] = os.path.abspath(__file__)
        return data

    spawn.get_preparation_data = preparation_data


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: cpu_launch.py SCRIPT.py [ARGS...]")
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path.insert(0, os.path.dirname(script))
    import torch

    if torch.cuda.is_available():
        runpy.run_path(script, run_name="__main__")
        return
    _spawn_children_from_here(script)
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # megatron's jit_fuser is torch.compile
    if importlib.util.find_spec("triton") is None:
        _stub_batch_invariant_kernels()
    from fl_megatron.backends.megatron_cpu import cpu_compat

    with cpu_compat():
        _pretend_cuda()
        _optimizer_state_before_the_first_step()
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
