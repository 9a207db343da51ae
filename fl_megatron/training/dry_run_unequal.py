"""--dry-run for groups of unequal size (--fl-group-sizes): each group's memory and step traffic as
the group alone would have them, and the sync's atom plan (atom_plan.py) per group: the elements
each rank averages across groups, and the communicators it sits in."""

import time

from ..atom_plan import plan_for_shapes
from ..config import ResolvedRun
from ..cost_model.workload import gradient_bytes
from ..costs import format_bytes, step_comm, sync_codec, wire_bytes_per_element, working_bytes
from ..federation.vote import GROUP_SLOTS
from ..group_layout import GroupLayout
from ..models import build_model
from ..topology import make_layout
from .console import batch_line, federation_line


def _alone(run: ResolvedRun, layout: GroupLayout, f: int) -> ResolvedRun:
    """`run` as group `f` alone: its ranks, nodes and sharding, every other setting the run's."""
    g = layout.groups[f]
    return ResolvedRun(run.cfg, make_layout(g.size, layout.node_size(f), g.size, shard_size=g.shard_size),
                       run.accumulation)


def unequal_dry_run_lines(run: ResolvedRun, num_params: int, largest: int, memory_estimate, warning) -> list[str]:
    """The dry run's body for a layout of unequal groups; `memory_estimate`: the dry run's estimate
    of a run of equal groups (dry_run.memory_estimate), taken per group; `warning(cfg, total)`: the
    lines that say an estimate does not fit the device."""
    cfg, layout, accum = run.cfg, run.layout, run.accumulation
    t, fed = cfg.training, cfg.federation
    syncing = fed.syncing and layout.is_federated
    lines = [batch_line(t, accum, layout), federation_line(layout, fed), "",
             "  per group (memory per rank: estimate; traffic per optimizer step: ring formulas, per rank):"]
    for f, g in enumerate(layout.groups):
        alone = _alone(run, layout, f)
        memory = memory_estimate(alone, num_params, largest, fed.outer_state_shards if syncing else 0,
                                 sync_codec(fed.sync_dtype, fed.topk_density) if syncing else None)
        step = step_comm(alone.layout, num_params, param_bytes=working_bytes(t.bf16), grad_bytes=gradient_bytes(cfg),
                         micro_batches=accum)
        tiers = step.bytes_by_tier
        inner = f"HSDP {g.replicas} x {g.shard_size}" if g.replicas > 1 else f"FSDP over {g.shard_size}"
        lines.append(f"    group {f}: {g.size} ranks, PyTorch {inner}: memory {format_bytes(memory['total'])} "
                     f"(sharded state {format_bytes(memory['master_params'] + memory['optimizer_states'])}); "
                     f"per step intra-node {format_bytes(tiers['intra-node'])}, inter-node "
                     f"{format_bytes(tiers['inter-node'])}")
        lines += [f"    group {f}:" + line[1:] for line in warning(cfg, memory["total"])]
    lines.append("")
    if not syncing:
        return lines + ["  per federation sync: none (averaging disabled or a single group)"]
    started = time.perf_counter()
    shapes = [tuple(p.shape) for p in build_model(cfg.model, "meta").parameters()]
    backend = cfg.parallel.backend
    # DeepSpeed's flat cut; megatron's padded buffers are laid out at start-up: the flat cut comes closest
    plan = plan_for_shapes(layout.groups, shapes, "fsdp2" if backend == "fsdp2" else "flat")
    seconds = time.perf_counter() - started
    costs = plan.costs()
    busiest = max(costs, key=lambda c: c.max_elements)
    least = min(costs, key=lambda c: c.max_elements)
    when = "each round" if fed.per_group_steps else f"every {fed.sync_interval} steps"
    share = f"; each sync moves one of its {fed.fragments} fragments" if fed.fragments > 1 else ""
    lines += [f"  per federation sync ({when}; {fed.sync_dtype} on the wire, atom by atom: each rank averages "
              f"the elements it holds with the ranks holding them in the other groups{share}):",
              *("    " + c.line(wire_bytes_per_element(fed.sync_dtype)) for c in costs),
              f"    {len(plan.owner_tuples()):,} communicators across groups (owner tuples), planned in "
              f"{seconds:.2f} s; a sync lasts as long as its busiest rank's exchange: group {busiest.group}'s ranks "
              f"carry {busiest.max_elements / max(1, least.max_elements):.1f}x the elements of group "
              f"{least.group}'s" + (" (megatron: its buffer map approximated by ZeRO-3's flat cut; a run "
                                     "reads the real one)" if backend == "megatron" else ""),
              *([f"    inner state (--fl-inner-state average): each moment stream of the optimizer (AdamW: 2) "
                 "is averaged the same way, in fp32: 4 bytes per element each"
                 f"{', a fragment its window in its turn' if fed.fragments > 1 else ''}"]
                if fed.inner_state == "average" else []),
              f"    vote: all-reduce (max) of {GROUP_SLOTS * layout.num_groups + 2} numbers over the {layout.num_groups} groups' "
              "first ranks, then a broadcast inside each group; metrics: 3 numbers the same way", ""]
    return lines
