"""--dry-run: validate a configuration for any world size and print what the run would cost.

Runs in one process with no GPU and no process group: parameter count on the meta device,
per-rank memory estimate and communication per step and per sync from the formulas in
`fl_megatron.costs`.
"""

from typing import Optional

from ..checkpoint import find_checkpoint, resume_source, source_groups
from ..config import ResolvedRun, RunConfig
from ..cost_model.compare import compare_text
from ..cost_model.network import Cluster
from ..cost_model.tune import Measured, SyncMode, TuneBounds, tune
from ..cost_model.workload import gradient_bytes, workload_for
from ..costs import (PACKED_BUCKETS_IN_FLIGHT, SYNC_BUCKET_COPIES, average_per_step, checkpoint_bytes,
                     estimate_memory_per_rank, format_bytes, saved_outer_copies, step_comm, sync_buffer_bytes,
                     sync_codec, sync_comm, sync_state_bytes, sync_state_parts, sync_state_shards, working_bytes)
from ..models import build_model
from ..group_layout import GroupLayout, group_sizes_of
from ..topology import Layout
from .console import batch_line, federation_line
from .dry_run_unequal import unequal_dry_run_lines
from .meetings import meeting_lines


def _breakdown_lines(title: str, breakdown) -> list[str]:
    lines = [f"  {title}:"]
    if not breakdown.entries:
        return lines + ["    nothing moves"]
    for c in breakdown.entries:
        lines.append(f"    {c.name:<28} {c.op:<14} over {c.group_size:>4} ranks ({c.group:<7}) "
                     f"{c.scope:<11} {c.tier:<10} {format_bytes(c.bytes):>10}")
    tiers = breakdown.bytes_by_tier
    lines.append(f"    total per rank: {format_bytes(breakdown.total_bytes)} "
                 f"(intra-node {format_bytes(tiers['intra-node'])}, inter-node {format_bytes(tiers['inter-node'])})")
    return lines


def _model_line(cfg: RunConfig, num_params: int) -> str:
    m = cfg.model
    return (f"  model: {cfg.preset or m.arch}, {num_params:,} parameters ({m.num_layers} layers, hidden "
            f"{m.hidden_size}, ffn {m.ffn_hidden_size}, heads {m.num_attention_heads}/{m.kv_heads} kv, vocab "
            f"{m.vocab_size})")


def _backend_line(cfg: RunConfig, layout: Layout) -> str:
    """Which framework shards a group, and over which ranks."""
    if cfg.parallel.backend == "deepspeed":
        zero = (cfg.deepspeed or {}).get("zero_optimization") or {}
        hpz = zero.get("zero_hpz_partition_size", 1)
        text = f"  backend: DeepSpeed ZeRO-3 over {layout.shard_size} ranks"
        if layout.is_hsdp:
            text += f", gradient partitions averaged over {layout.replicas} replicas each step"
        if hpz > 1:
            text += f", ZeRO++ hpZ secondary partitions over {hpz} ranks"
        return text
    if cfg.parallel.backend == "megatron":
        text = f"  backend: megatron-core DistributedOptimizer over {layout.shard_size} ranks"
        if layout.is_hsdp:
            text += f", gradient shards all-reduced over {layout.replicas} replicas each step"
        return text
    mesh = f"{layout.replicas} x {layout.shard_size} (replicate x shard)" if layout.is_hsdp else f"{layout.shard_size}"
    return f"  backend: PyTorch FSDP2 over {mesh} ranks"


def _checkpoint_line(cfg: RunConfig, layout: Layout | GroupLayout, num_params: int) -> str:
    """Checkpoint size in both modes (the chosen one marked)."""
    replicas = [g // s for g, s in zip(*group_sizes_of(layout))]
    outer = saved_outer_copies(cfg.federation, layout.num_groups, 1) * sum(replicas) // len(replicas)
    sizes = checkpoint_bytes(num_params, layout.num_groups, cfg.training.optimizer, cfg.training.sgd_momentum,
                             outer_copies=outer)
    chosen = cfg.checkpoint.ckpt_mode
    parts = [f"{mode} {format_bytes(n)}{' (chosen)' if mode == chosen else ''}" for mode, n in sizes.items()]
    where = f" in {cfg.checkpoint.save}" if cfg.checkpoint.save else " (not saving: no --save)"
    extra = f"; both with {format_bytes(sync_state_bytes(num_params, outer))} of sync state" if outer else ""
    return (f"  checkpoint size{where}: {', '.join(parts)} "
            f"(exact: {layout.num_groups} groups' parameters and optimizer states; compact: one{extra})")


def _start_lines(run: ResolvedRun) -> list[str]:
    """Where the weights come from: the checkpoint --load resumes (directory, step, backend,
    layout, what changes), Hugging Face weights, or the seeded initialisation."""
    options = run.cfg.checkpoint
    source = resume_source(options)
    if source is None:
        if options.init_from_hf:
            return [f"  start: step 0 from the Hugging Face weights in {options.init_from_hf}"]
        empty = f" ({options.load} holds no checkpoint yet)" if options.load else ""
        return [f"  start: step 0 from the seeded initialisation{empty}"]
    path, meta = find_checkpoint(*source)
    _, notes = source_groups(meta, run)
    lay = meta["layout"]
    saved = (f"{lay['num_groups']} groups x {lay['group_size']} ranks (shard {lay['hsdp_shard_size']}) on "
             f"{lay['world_size']} ranks")
    fed = meta["federation"]
    lines = [f"  resume: {path} at step {meta['iteration']} ({meta['backend']}, {meta['mode']} checkpoint, saved as "
             f"{saved}; {fed['steps_since_sync']} steps past the last sync"
             + ("" if options.load_optim else "; optimizer state not loaded") + ")"]
    return lines + [f"    note: {n}" for n in notes]


def _memory_warning(cfg: RunConfig, total: float) -> list[str]:
    """A warning, with what would help, when the estimate does not fit --device-memory-gib."""
    limit = cfg.cluster.device_memory_gib * 2**30
    if total <= limit:
        return []
    helps = [] if cfg.training.recompute_activations else ["--recompute-activations"]
    helps += ["a smaller --micro-batch-size (more --global-batch-size accumulation)",
              "more ranks per shard group (--fl-group-size, --fl-hsdp-shard-size)"]
    return [f"  WARNING: the estimate, {format_bytes(total)} per rank, exceeds the {cfg.cluster.device_memory_gib:g} GiB "
            f"of one device (--device-memory-gib): the run would run out of memory. Try " + ", ".join(helps) + "."]


def _ada_lines(layout: Layout, num_params: int, fed) -> list[str]:
    """What one sync sends on each graph of the Ada ladder (bytes per rank, by tier)."""
    lines = ["  ada: per sync on each graph of its ladder (per rank):"]
    for graph in fed.ada_ladder:
        tiers = sync_comm(layout, num_params, master_bytes=fed.sync_bytes_per_element,
                          replica_split=fed.replica_split, graph=graph, gathered=bool(fed.topk_density)).bytes_by_tier
        lines.append(f"    {graph:<22} intra-node {format_bytes(tiers['intra-node'])}, "
                     f"inter-node {format_bytes(tiers['inter-node'])}")
    return lines


def model_sizes(model_cfg) -> tuple[tuple[int, int, int], int]:
    """((parameters, those outside the blocks, blocks), parameters of the largest separately
    gathered unit: a block or the root module), on the meta device."""
    model = build_model(model_cfg, "meta")
    num_params = sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.layers]
    root = num_params - sum(blocks)
    return (num_params, root, len(blocks)), max(max(blocks), root)


def memory_estimate(run: ResolvedRun, num_params: int, largest_layer_params: int, outer_state_shards: float,
                    codec: Optional[str]) -> dict:
    """The per-rank memory estimate of the dry run for a sync keeping `outer_state_shards` fp32
    shards and encoding with `codec` (costs.sync_codec; None: no sync buffers, nothing syncs)."""
    cfg, layout = run.cfg, run.layout
    m, t, fed = cfg.model, cfg.training, cfg.federation
    buffers = 0 if codec is None else sync_buffer_bytes(min(fed.bucket_mb * 2**20, 4 * num_params / layout.shard_size),
                                                        codec)
    return estimate_memory_per_rank(layout, num_params, m.num_layers, m.hidden_size, t.seq_length,
                                    t.micro_batch_size, m.vocab_size, m.num_attention_heads, bf16=t.bf16,
                                    optimizer=t.optimizer, largest_layer_params=largest_layer_params,
                                    recompute=t.recompute_activations,
                                    replicated_params=cfg.parallel.backend == "megatron",
                                    grad_bytes=gradient_bytes(cfg), outer_state_shards=outer_state_shards,
                                    # megatron-core's local layer spec attends unfused: it stores the s x s scores
                                    flash_attention=cfg.parallel.backend != "megatron",
                                    sync_buffer_bytes=buffers)


def run_memory_estimate(run: ResolvedRun, counts: Optional[tuple] = None, largest: Optional[int] = None) -> dict:
    """The per-rank memory estimate --dry-run prints for `run` as configured (its sync's state and
    buffers where it syncs); `counts`, `largest`: model_sizes(...) when already known."""
    if counts is None or largest is None:
        counts, largest = model_sizes(run.cfg.model)
    fed = run.cfg.federation
    syncing = fed.syncing and run.layout.is_federated
    return memory_estimate(run, counts[0], largest, fed.outer_state_shards if syncing else 0,
                           sync_codec(fed.sync_dtype, fed.topk_density) if syncing else None)


def _memory_notes(run: ResolvedRun) -> dict[str, str]:
    """What the sync's lines of the memory estimate hold: fp32 shards by use, bucket copies by codec."""
    fed = run.cfg.federation
    if not (fed.syncing and run.layout.is_federated):
        return {}
    codec = sync_codec(fed.sync_dtype, fed.topk_density)
    buffers = f"{PACKED_BUCKETS_IN_FLIGHT} packed buckets of <= {fed.bucket_mb:g} MiB"
    if SYNC_BUCKET_COPIES[codec]:
        what = "the top-k selection" if codec == "sparse" else "encoding"
        buffers += f" + {SYNC_BUCKET_COPIES[codec]:g} fp32 copies of one for {what}"
    parts = sync_state_parts(fed.outer_optimizer, fed.plain_average, fed.error_feedback, bool(fed.overlap_steps),
                             fed.fragments)
    notes = {"sync_buffers": buffers}
    if parts:
        notes["outer_state"] = "fp32 shards: " + ", ".join(f"{name} {n:g}" for name, n in parts.items())
    return notes


def mode_memory(run: ResolvedRun, counts: tuple, largest: int, mode: SyncMode) -> float:
    """The per-rank memory estimate of the run synced in `mode` (--fl-tune's memory bound)."""
    fed = run.cfg.federation
    plain = (fed.outer_optimizer == "fedavg" and fed.resolved_outer_lr == 1.0 and mode.sync_dtype == "fp32"
             and not mode.overlap_steps)
    shards = sync_state_shards(fed.outer_optimizer, plain, mode.error_feedback, bool(mode.overlap_steps),
                               mode.fragments)
    return memory_estimate(run, counts[0], largest, shards, sync_codec(mode.sync_dtype, mode.topk_density))["total"]


def _tune_lines(run: ResolvedRun, counts: tuple, largest: int) -> list[str]:
    """What --fl-tune would choose at these link figures and the compute time from FLOPs (a run
    probes its links and measures its steps, its codec and its votes instead)."""
    cfg, fed = run.cfg, run.cfg.federation
    bounds = TuneBounds.of(fed, cfg.cluster.device_memory_gib * 2**30)
    choice = tune(bounds, run.layout, workload_for(run, counts=counts), Cluster.from_config(cfg.cluster), Measured(),
                  fed.replica_split, lambda mode: mode_memory(run, counts, largest, mode), fed.tune_tolerance)
    return [f"  fl-tune at these link figures (a run probes its links and measures its steps): {choice.text()}", ""]


def dry_run_report(run: ResolvedRun) -> str:
    """The text --dry-run prints."""
    cfg, layout, accum = run.cfg, run.layout, run.accumulation
    m, t, fed = cfg.model, cfg.training, cfg.federation
    counts, largest = model_sizes(m)
    num_params = counts[0]
    if isinstance(layout, GroupLayout):
        return "\n".join(["fl-megatron dry run (no processes started)",
                          *("  " + line for line in layout.describe().splitlines()),
                          _model_line(cfg, num_params),
                          *unequal_dry_run_lines(run, num_params, largest, memory_estimate, _memory_warning),
                          *_start_lines(run), _checkpoint_line(cfg, layout, num_params)])
    param_bytes = working_bytes(t.bf16)
    memory, notes = run_memory_estimate(run, counts, largest), _memory_notes(run)
    h = fed.sync_interval if (fed.syncing and layout.is_federated) else 0
    once = cfg.parallel.backend == "megatron"
    per_step = step_comm(layout, num_params, param_bytes=param_bytes, grad_bytes=gradient_bytes(cfg), micro_batches=accum,
                         gathered_once=once)
    graph = fed.densest_graph
    fragment = -(-num_params // fed.fragments)  # a sync moves one fragment (the largest shown)
    sparse = bool(fed.topk_density)
    sync = sync_comm(layout, fragment, master_bytes=fed.sync_bytes_per_element, replica_split=fed.replica_split,
                     graph=graph, gathered=sparse)
    amortised = average_per_step(layout, num_params, h, param_bytes=param_bytes, grad_bytes=gradient_bytes(cfg),
                                 master_bytes=fed.sync_bytes_per_element, replica_split=fed.replica_split,
                                 micro_batches=accum, gathered_once=once, graph=graph, gathered=sparse)
    lines = [
        "fl-megatron dry run (no processes started)",
        *("  " + line for line in layout.describe().splitlines()),
        _model_line(cfg, num_params),
        _backend_line(cfg, layout),
        batch_line(t, accum, layout),
        federation_line(layout, fed),
        "",
        f"  memory per rank (estimate, {'bf16' if t.bf16 else 'fp32'} compute, {t.optimizer}"
        f"{', activations recomputed' if t.recompute_activations else ''}):",
        *(f"    {k:<18} {format_bytes(v):>10}" + (f"  ({notes[k]})" if k in notes else "") for k, v in memory.items()),
        *_memory_warning(cfg, memory["total"]),
        "",
        "  communication per rank (ring formulas, payload on the wire):",
        *_breakdown_lines(f"per optimizer step ({accum} micro-batch{'es' if accum > 1 else ''})", per_step),
        *_breakdown_lines(f"per federation sync ({graph})" if fed.gossip else
                          f"per federation sync (1 of {fed.fragments} fragments)" if fed.fragments > 1 else
                          "per federation sync",
                          sync if h else type(sync)()),
        *(_ada_lines(layout, num_params, fed) if h and fed.topology == "ada" else []),
        f"  per optimizer step, sync amortised over H={h}: intra-node {format_bytes(amortised['intra-node'])}, "
        f"inter-node {format_bytes(amortised['inter-node'])}",
        "",
        *meeting_lines(run, num_params),
        "",
        compare_text(run, workload_for(run, counts=counts)),
        "",
        *(_tune_lines(run, counts, largest) if fed.tune and h else []),
        *_start_lines(run),
        _checkpoint_line(cfg, layout, num_params),
    ]
    return "\n".join(lines)
