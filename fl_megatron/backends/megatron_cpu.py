"""Running megatron-core on CPU with gloo: a scoped compatibility layer (tests and demos only).

megatron-core 0.16.1 assumes CUDA in about twenty places that matter for a GPT model with its
distributed optimizer: buffers and scalars created with `device='cuda'` or
`torch.cuda.current_device()`, `.cuda()` calls, `param.type() == 'torch.cuda.FloatTensor'`
checks, a CUDA stream for partial distributed optimizers, and an RNG tracker that forks CUDA
generator states. Nothing in the installed package is edited. Instead, while `cpu_compat()` is
active on a machine without CUDA:

- a `TorchFunctionMode` maps a CUDA `device=` (a string, a `torch.device` or an index) to the
  CPU, makes `Tensor.cuda()` return the tensor itself, and makes a bare `Tensor.type()` report
  the CUDA type name of a CPU tensor (so the type checks pass for the right dtype);
- `torch.cuda.current_device` returns 0 and `torch.cuda.Stream`/`torch.cuda.stream` are inert;
- megatron's RNG tracker is a `CpuRngTracker`: the same named, forkable states, on the CPU
  generator (dropout draws from it as it would from the CUDA one);
- `ensure_memory_buffer()` creates megatron's global memory buffer (used by its attention)
  when nothing else did (`parallel_state.initialize_model_parallel` does, and refuses to run
  after it).

On a machine with CUDA, `cpu_compat()` does nothing. The layer is entered around every call
into megatron-core by `backends.megatron_core` and by `integrations.megatron_lm`; nothing else
in the process sees it. On CPU megatron-core is for tests and demos: it is slower than FSDP2.
"""

import contextlib
import functools
import threading
import warnings

import torch
from torch.overrides import TorchFunctionMode

_LOCK = threading.RLock()
_DEPTH = [0]  # nesting depth of cpu_compat() (the patches are applied once, at depth 0 -> 1)


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Redirects CUDA placements to the CPU inside megatron-core (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]) and not isinstance(args[1], int):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _InertStream:
    """Stands in for `torch.cuda.Stream` on CPU: every operation is already synchronous."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _cpu_rng_tracker_class():
    from megatron.core.tensor_parallel import random as megatron_random

    class CpuRngTracker(megatron_random.CudaRNGStatesTracker):
        """megatron's named RNG states, kept as CPU generator states."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRngTracker


def install_cpu_rng_tracker(seed: int) -> None:
    """Make megatron's RNG tracker a CPU one holding its model-parallel state at `seed` (megatron
    itself adds 2718 to the seed for that state; tensor-parallel rank 0 is assumed)."""
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = _cpu_rng_tracker_class()()
    tracker.add(megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    tracker.add(megatron_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def ensure_memory_buffer() -> None:
    """Create megatron's global memory buffer (its attention needs one) unless it exists; call it
    after `parallel_state.initialize_model_parallel`, if that runs at all (it creates its own)."""
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


@contextlib.contextmanager
def cpu_compat():
    """Run megatron-core code on CPU (no-op when CUDA is available); re-entrant."""
    if torch.cuda.is_available():
        yield
        return
    with _LOCK:
        _DEPTH[0] += 1
        saved = None
        if _DEPTH[0] == 1:
            saved = (torch.cuda.current_device, torch.cuda.Stream, torch.cuda.stream)
            torch.cuda.current_device = lambda: 0
            torch.cuda.Stream = _InertStream
            torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    try:
        with _CudaToCpu():
            yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if saved is not None:
                torch.cuda.current_device, torch.cuda.Stream, torch.cuda.stream = saved


@contextlib.contextmanager
def quiet_collectives():
    """Hide torch's per-call notices that megatron-core uses deprecated collective names."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=r".*is deprecated. Please use `torch\.distributed\.")
        yield


def compat_method(method):
    """Decorator: run a method inside `cpu_compat()` and `quiet_collectives()`."""
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with cpu_compat(), quiet_collectives():
            return method(*args, **kwargs)
    return wrapped
