"""torchft's reconfigurable process groups (its gloo and NCCL wrappers), made for elastic mode: the
quorum's group over the live groups, and the atom communicators of groups of unequal size. The
wrapper is what bounds each collective and aborts the communicator of a lost peer on NCCL
(peer_deadline.py); each instance remembers the store of its last quorum, where the atom
communicators of that quorum meet."""

from datetime import timedelta


def torchft_manager_class():
    """torchft's Manager, or an ImportError naming the extra that brings it."""
    return _import()[0]


def quorum_process_group(backend: str, timeout: timedelta):
    """A torchft process-group wrapper ('gloo' or 'nccl') whose `store_address` is the quorum
    store of its last `configure` (None before the first)."""
    _, gloo, nccl = _import()
    base = nccl if backend == "nccl" else gloo

    class RememberingStore(base):
        store_address = None

        def configure(self, store_addr: str, *args, **kwargs) -> None:
            # torchft's prefixed address: "<host>:<port>/torchft/<quorum id>/<group rank>"
            self.store_address = store_addr.split("/torchft/")[0]
            super().configure(store_addr, *args, **kwargs)

    return RememberingStore(timeout=timeout)


def _import():
    try:
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
    except ImportError as e:
        raise ImportError("--fl-elastic needs torchft: pip install 'fl-megatron[elastic]' (torchft==0.2.0)") from e
    return Manager, ProcessGroupGloo, ProcessGroupNCCL
