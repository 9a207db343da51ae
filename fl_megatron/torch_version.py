"""The oldest torch fl-megatron runs on: the oldest its tests run on. `make test` runs on 2.13 and
`make test-torch-floor` runs the tests that reach into torch's APIs (FSDP2, DeviceMesh backend
overrides, group_src/group_peer arguments, DCP, gloo's collectives as used here) and the demo on
2.11, the lent GPU machine's torch; nothing older is checked. setup.py and the README state the
same floor."""

import re

TORCH_FLOOR = (2, 11)


def torch_version_problem(version: str) -> str | None:
    """What is wrong with torch `version` ("2.6.0+cu124"), or None when it is new enough."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return f"cannot read the torch version {version!r}"
    if (int(match.group(1)), int(match.group(2))) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        return (f"fl-megatron needs torch >= {floor} (the oldest its tests run on), found {version}: "
                f"pip install 'torch>={floor}' (a CUDA build on GPU nodes, the CPU wheel elsewhere; see the README)")
    return None


def all_gather_flat(output, input, group=None, async_op=False):
    """torch.distributed's all-gather into one tensor under this torch's name for it: 2.13 calls it
    all_gather_single and warns on every call of the older all_gather_into_tensor (which 2.11 has alone)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)
