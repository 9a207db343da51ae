"""The cost model's byte counts for FL+FSDP / FL+HSDP layouts (pure Python): what each collective
moves, what a sync's wire format costs per element, and what the sync state and the checkpoint hold.
Config, the dry run, the engine's ledger, the compression codec and the benchmarks all count
bytes here; `fl_megatron.cost_model` turns the counts into time.

Volumes are per rank, for ring algorithms over a group of k ranks holding Psi elements:
all-gather and reduce-scatter move Psi*(k-1)/k, all-reduce 2*Psi*(k-1)/k.

Each collective has a SCOPE -- "inter-group" for the federation all-reduce over peer groups,
"intra-group" otherwise -- and a TIER -- "intra-node" when every process group of that kind
lies on one node, "inter-node" when any of them spans nodes.
Collectives over single-rank groups move nothing and are left out.
"""

from dataclasses import dataclass
from types import MappingProxyType
from typing import Dict, List, Optional, Tuple

from fl_megatron.graph_fit import out_degree
from fl_megatron.topology import (Layout, peer_groups, replica_groups, shard_groups,
                                  spans_nodes)

INTRA_GROUP, INTER_GROUP = "intra-group", "inter-group"
INTRA_NODE, INTER_NODE = "intra-node", "inter-node"
SCOPES = (INTRA_GROUP, INTER_GROUP)
TIERS = (INTRA_NODE, INTER_NODE)

_GROUPS = MappingProxyType({"shard": shard_groups, "replica": replica_groups,
                             "peer": peer_groups})


# The inter-group wire formats of a sync. int8/int4 pack each element into `bits` and every block
# of QUANT_BLOCK elements carries one fp32 scale; bf16 and fp32 send the values as they are.
QUANT_BLOCK = 256
QUANT_BITS = MappingProxyType({"int8": 8, "int4": 4})
_PLAIN_WIRE_BYTES = MappingProxyType({"fp32": 4.0, "bf16": 2.0})
_OUTER_STATE_SHARDS = MappingProxyType({"fedavg": 1, "nesterov": 2, "adam": 3})


# The sparse sync (--fl-topk-density): in every chunk of SPARSE_CHUNK elements the k largest
# magnitudes travel, each as a chunk-local index of SPARSE_INDEX_BITS (two to three bytes) and a
# value code; integer codes carry one fp32 scale per chunk (federation/sparse.py)
SPARSE_CHUNK = 4096
SPARSE_INDEX_BITS = 12
SPARSE_VALUE_BITS = MappingProxyType({"int2": 2, "int4": 4, "int8": 8, "bf16": 16})


def sparse_picks(density: float) -> int:
    """Values sent per chunk at `density` (at least one)."""
    if not 0 < density <= 1:
        raise ValueError(f"--fl-topk-density must lie in (0, 1], not {density}")
    return max(1, round(density * SPARSE_CHUNK))


def sparse_payload_bytes(elements: int, density: float, value_dtype: str) -> int:
    """One rank's sparse payload for a region of `elements` (padded to whole chunks): the scales,
    the value codes, the indices, and up to 3 bytes that keep every payload 4-byte aligned."""
    chunks = -(-elements // SPARSE_CHUNK)
    picks, bits = chunks * sparse_picks(density), SPARSE_VALUE_BITS[value_dtype]
    scales = chunks * 4 if bits < 16 else 0
    return -(-(scales + -(-picks * bits // 8) + -(-picks // 2) * 3) // 4) * 4


def working_bytes(bf16: bool) -> int:
    """Bytes per element of the model's working copy (parameters gathered for compute)."""
    return 2 if bf16 else 4


def wire_bytes_per_element(sync_dtype: str, topk_density: float = 0.0) -> float:
    """Bytes one shard element occupies on the inter-group wire (int8/int4: plus its block's scale;
    the sparse sync: its payload's share, which an all-gather hands to every other group)."""
    if topk_density:
        bits, picks = SPARSE_VALUE_BITS[sync_dtype], sparse_picks(topk_density)
        scale = 4 if bits < 16 else 0
        return (scale + picks * (bits + SPARSE_INDEX_BITS) / 8) / SPARSE_CHUNK
    if sync_dtype in QUANT_BITS:
        return QUANT_BITS[sync_dtype] / 8 + 4.0 / QUANT_BLOCK
    if sync_dtype not in _PLAIN_WIRE_BYTES:
        raise ValueError(f"sync_dtype={sync_dtype!r} is not one of {', '.join([*_PLAIN_WIRE_BYTES, *QUANT_BITS])}")
    return _PLAIN_WIRE_BYTES[sync_dtype]


def in_flight_shards(overlapped: bool, fragments: int) -> float:
    """fp32 shard-sized buffers of an overlapped sync in flight: two of the fragment it moves."""
    return 2 / fragments if overlapped else 0.0


def sync_state_parts(outer_optimizer: str, plain_average: bool, error_feedback: bool, overlapped: bool,
                     fragments: int) -> Dict[str, float]:
    """sync_state_shards by what holds them (those a rank keeps): the anchor with the outer
    optimizer's state, the error-feedback residual, an overlapped sync's in-flight buffers."""
    if plain_average:
        return {}
    held = {"fedavg": "anchor", "nesterov": "anchor + nesterov momentum", "adam": "anchor + adam moments"}
    parts = {held[outer_optimizer]: _OUTER_STATE_SHARDS[outer_optimizer],
             "error-feedback residual": float(error_feedback),
             "overlapped sync in flight": in_flight_shards(overlapped, fragments)}
    return {name: shards for name, shards in parts.items() if shards}


def sync_state_shards(outer_optimizer: str, plain_average: bool, error_feedback: bool, overlapped: bool,
                      fragments: int) -> float:
    """fp32 shard-sized buffers a rank keeps for the sync: anchor and outer optimizer state
    (fedavg with lr != 1 or compressed: 1, nesterov: 2, adam: 3), one for error feedback, and
    the in-flight buffers of an overlapped sync. A plain fp32 FedAvg keeps none."""
    return float(sum(sync_state_parts(outer_optimizer, plain_average, error_feedback, overlapped, fragments).values()))


def wire_shards_per_sync(graph: str, groups: int) -> float:
    """Shard-sized payloads one rank sends to other groups at one sync: the ring all-reduce's
    2(G-1)/G for complete, the out-degree for a gossip graph, 0 for none."""
    if graph == "complete":
        return ring_volume("all_reduce", 1.0, groups) if groups > 1 else 0.0
    return float(out_degree(graph, groups))


def wire_volume(graph: str, groups: int, payload: float) -> float:
    """What `payload` (bytes this rank handed to the sync's collectives, as the ledger counts
    them) moves on the wire: a ring all-reduce over the groups for complete, as sent for a
    gossip graph (its payload already counts one copy per out-neighbour)."""
    return ring_volume("all_reduce" if graph == "complete" else "send", payload, groups)


@dataclass(frozen=True)
class Collective:
    """One collective as seen by one rank.

    name: what it does; op: all_gather / reduce_scatter / all_reduce; group: the process
    group kind (shard, replica, peer) and group_size its rank count; elements and bytes
    are sent per rank; bytes_per_element is the dtype size used.
    """

    name: str
    op: str
    group: str
    group_size: int
    scope: str
    tier: str
    elements: float
    bytes_per_element: int
    calls: int = 1

    @property
    def bytes(self) -> float:
        return self.elements * self.bytes_per_element


@dataclass(frozen=True)
class CommBreakdown:
    """Collectives of one optimizer step or one federation sync, per rank."""

    entries: Tuple[Collective, ...] = ()

    @property
    def total_elements(self) -> float:
        return sum(c.elements for c in self.entries)

    @property
    def total_bytes(self) -> float:
        return sum(c.bytes for c in self.entries)

    @property
    def bytes_by_scope(self) -> Dict[str, float]:
        """{"intra-group": ..., "inter-group": ...} bytes per rank."""
        return {scope: sum(c.bytes for c in self.entries if c.scope == scope)
                for scope in SCOPES}

    @property
    def bytes_by_tier(self) -> Dict[str, float]:
        """{"intra-node": ..., "inter-node": ...} bytes per rank."""
        return {tier: sum(c.bytes for c in self.entries if c.tier == tier) for tier in TIERS}

    def by_name(self, name: str) -> Collective:
        """The entry called `name` (KeyError if absent)."""
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise KeyError(f"no collective {name!r}; have {[c.name for c in self.entries]}")


def group_tier(layout: Layout, group: str) -> str:
    """inter-node if any process group of this kind spans nodes, else intra-node."""
    groups = _GROUPS[group](layout)
    return INTER_NODE if any(spans_nodes(layout, ranks) for ranks in groups) else INTRA_NODE


def ring_volume(op: str, elements: float, ranks: int) -> float:
    """Elements sent per rank by a ring collective over `ranks` ranks on `elements` data (a gossip
    round's point-to-point "send" moves its elements as they are)."""
    if op == "send":
        return elements
    factor = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}[op]
    return factor * elements * (ranks - 1) / ranks


def _collective(layout: Layout, name: str, op: str, group: str, ranks: int,
                elements: float, bytes_per_element: int, calls: int = 1) -> List[Collective]:
    """A one-entry list, or [] for a single-rank group or no data (nothing moves)."""
    if ranks <= 1 or elements <= 0:
        return []
    scope = INTER_GROUP if group == "peer" else INTRA_GROUP
    return [Collective(name, op, group, ranks, scope, group_tier(layout, group),
                       ring_volume(op, elements, ranks), bytes_per_element, calls)]


def _check_params(num_params: int) -> None:
    if num_params < 0:
        raise ValueError(f"num_params={num_params} must be >= 0")


def step_comm(layout: Layout, num_params: int, param_bytes: int = 2,
              grad_bytes: int = 4, micro_batches: int = 1, regathered_params: Optional[int] = None,
              units: int = 1, gathered_once: bool = False) -> CommBreakdown:
    """Per-rank traffic of one optimizer step of `micro_batches` forward/backward passes.

    The parameter all-gathers repeat for every micro-batch; gradients are reduced once.

    Shard group (S): all-gather params for forward and backward (param_bytes) and
    reduce-scatter gradients (grad_bytes): 3*Psi*(S-1)/S elements. HSDP adds an
    all-reduce of the Psi/S gradient shard over the P replicas: 2*(Psi/S)*(P-1)/P.
    `regathered_params` is how many parameters the backward pass gathers again (default all;
    FSDP2 keeps the root module's gathered from forward to backward, DeepSpeed keeps up to
    stage3_max_live_parameters); `units` is the number of separately gathered modules.
    `gathered_once`: every rank keeps the whole model and all-gathers the updated parameters once
    per step (megatron-core's distributed optimizer), whatever the micro-batches.
    """
    _check_params(num_params)
    s, p = layout.shard_size, layout.replicas
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be at least 1")
    backward = num_params if regathered_params is None else regathered_params
    if not 0 <= backward <= num_params:
        raise ValueError(f"regathered_params={regathered_params} must be between 0 and num_params={num_params}")
    gathers = micro_batches
    if gathered_once:
        gathers, backward = 1, 0
    entries = (_collective(layout, "all_gather_forward", "all_gather", "shard", s,
                           gathers * num_params, param_bytes, units)
               + _collective(layout, "all_gather_backward", "all_gather", "shard", s,
                             micro_batches * backward, param_bytes, units)
               + _collective(layout, "reduce_scatter_grads", "reduce_scatter", "shard", s,
                             num_params, grad_bytes, units)
               + _collective(layout, "all_reduce_grads_replicas", "all_reduce", "replica", p,
                             num_params / s, grad_bytes, units))
    return CommBreakdown(tuple(entries))


def sync_comm(layout: Layout, num_params: int, master_bytes: float = 4,
              replica_split: bool = True, graph: str = "complete", gathered: bool = False) -> CommBreakdown:
    """Per-rank traffic of one federation sync over the F groups (fp32 master shards).

    FSDP: all-reduce of the Psi/G shard over the peer group: 2*(Psi/G)*(F-1)/F.
    HSDP naive: every replica all-reduces its Psi/S shard: 2*(Psi/S)*(F-1)/F.
    HSDP with replica_split: each replica averages a 1/P slice, 2*(Psi/(S*P))*(F-1)/F,
    then the replica group all-gathers the slices: (Psi/S)*(P-1)/P.
    A gossip `graph` sends the same piece to each of its out-neighbours instead (none: nothing).
    `gathered` (the sparse sync): every group's payload all-gathered, (F-1) payloads of the piece
    at `master_bytes` per element. Whatever the codec, the replicas then gather the averaged slices
    in fp32 (averaging.gather_slices).
    """
    _check_params(num_params)
    f, p, s = layout.num_groups, layout.replicas, layout.shard_size
    if f <= 1 or graph == "none":
        return CommBreakdown()
    split = replica_split and p > 1
    shard = num_params / s
    piece = shard / p if split else shard
    if graph == "complete" and gathered:
        entries = _collective(layout, "all_gather_peers", "all_gather", "peer", f, piece * f, master_bytes)
    elif graph == "complete":
        entries = _collective(layout, "all_reduce_peers", "all_reduce", "peer", f, piece, master_bytes)
    else:
        entries = [Collective(f"gossip_{graph}", "send", "peer", f, INTER_GROUP, group_tier(layout, "peer"),
                              piece * out_degree(graph, f), master_bytes)]
    if split:
        entries += _collective(layout, "all_gather_replica_slices", "all_gather", "replica",
                               p, shard, 4)
    return CommBreakdown(tuple(entries))


def average_per_step(layout: Layout, num_params: int, sync_interval: int,
                     param_bytes: int = 2, grad_bytes: int = 4, master_bytes: float = 4,
                     replica_split: bool = True, micro_batches: int = 1,
                     gathered_once: bool = False, graph: str = "complete",
                     gathered: bool = False) -> Dict[str, float]:
    """Per-rank bytes per optimizer step, the sync amortised over sync_interval (H) steps
    (`gathered`: the sparse sync's all-gather, sync_comm).

    H = 0 means no federation sync. Keys: "total", the tiers ("intra-node",
    "inter-node"), the scopes ("intra-group", "inter-group"), "step" and "sync".
    """
    if sync_interval < 0:
        raise ValueError(f"sync_interval={sync_interval} must be >= 0 (0: no sync)")
    step = step_comm(layout, num_params, param_bytes, grad_bytes, micro_batches, gathered_once=gathered_once)
    sync = (sync_comm(layout, num_params, master_bytes, replica_split, graph, gathered) if sync_interval
            else CommBreakdown())
    weight = 1 / sync_interval if sync_interval else 0.0
    out = {key: step.bytes_by_tier[key] + weight * sync.bytes_by_tier[key] for key in TIERS}
    out.update({key: step.bytes_by_scope[key] + weight * sync.bytes_by_scope[key]
                for key in SCOPES})
    out.update(step=step.total_bytes, sync=weight * sync.total_bytes,
               total=step.total_bytes + weight * sync.total_bytes)
    return out


_OPTIMIZER_STATE_BYTES = MappingProxyType({"adamw": 8, "adam": 8, "sgd": 0})


# A sync's transient buffers, in buckets of --fl-bucket-mb: two packed buckets in flight, and fp32
# copies of the bucket being encoded, by codec (sync_codec). A dense compressed sync holds the padded
# input, its encoding decoded for the residual, the received pieces decoded, their stack, the mean
# re-encoded and gathered back; a sparse one the padded input and its magnitudes (the picks are
# k / 4,096 of it; the gathered payloads add F x 0.7 % at int2 over F groups). Measured as the peak
# resident memory of one average of a 32-256 MiB bucket on one rank, which varies with the allocator's
# reuse: int4, int8 and bf16 5.3-7.0, sparse 1.5-2.2 (tests/test_sync_buffer_memory.py checks these
# bound it).
PACKED_BUCKETS_IN_FLIGHT = 2
SYNC_BUCKET_COPIES = MappingProxyType({"fp32": 0, "dense": 7.5, "sparse": 2.5})


def sync_codec(sync_dtype: str, topk_density: float = 0.0) -> str:
    """Which of SYNC_BUCKET_COPIES' codecs a sync in `sync_dtype` at `topk_density` runs."""
    return "sparse" if topk_density else ("fp32" if sync_dtype == "fp32" else "dense")


def sync_buffer_bytes(bucket_bytes: float, codec: str) -> float:
    """Peak transient memory of one sync beyond the shards, per rank (`codec`: sync_codec's)."""
    return bucket_bytes * (PACKED_BUCKETS_IN_FLIGHT + SYNC_BUCKET_COPIES[codec])


def estimate_memory_per_rank(layout: Layout, num_params: int, num_layers: int,
                             hidden_size: int, seq_length: int, micro_batch_size: int,
                             vocab_size: int, num_attention_heads: int, bf16: bool = True,
                             optimizer: str = "adamw",
                             largest_layer_params: Optional[int] = None,
                             flash_attention: bool = True,
                             recompute: bool = False, replicated_params: bool = False,
                             grad_bytes: int = 4, outer_state_shards: float = 0,
                             sync_buffer_bytes: float = 0) -> Dict[str, float]:
    """Rough per-rank memory in bytes -- an ESTIMATE, ignoring buffers and fragmentation.

    Sharded over S: fp32 master params (4 B/param), fp32 gradients (4 B/param), optimizer
    state (AdamW 8 B/param, SGD 0). Unsharded: two working copies of the largest layer
    (default: max of a transformer block, 12h^2 + 13h, and the vocab x h embedding) and
    activations without recomputation (Korthikanti et al. 2022):
    seq*micro*h*(34 + 5*heads*seq/h) bytes per layer in bf16 (the 5*heads*seq/h score term
    is dropped with flash_attention, as the models use fused attention), doubled for fp32; with
    `recompute` (full activation recomputation per block) only each block's input is kept,
    2*seq*micro*h bytes per layer, plus one block's full activations during its backward; plus
    fp32 logits and their gradient (seq*micro*vocab*4*2).
    `replicated_params` (megatron-core's distributed optimizer): every rank holds the whole model
    in its dtype and a whole gradient buffer of `grad_bytes` per element; fp32 main shards exist
    only beside bf16 params.
    `outer_state_shards`: fp32 shard-sized buffers of the sync (anchor, outer optimizer state,
    error feedback), reported as outer_state.
    Keys: master_params, gradients, optimizer_states, working_params, activations,
    logits, outer_state (when there is one), total.
    """
    _check_params(num_params)
    opt = optimizer.lower()
    if opt not in _OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer={optimizer!r} unknown; use one of "
                         f"{', '.join(sorted(_OPTIMIZER_STATE_BYTES))}")
    s, h = layout.shard_size, hidden_size
    param_bytes = working_bytes(bf16)
    if largest_layer_params is None:
        largest_layer_params = max(12 * h * h + 13 * h, vocab_size * h)
    # Fused attention (SDPA flash / memory-efficient kernels) never stores the s x s scores.
    scores = 0 if flash_attention else 5 * num_attention_heads * seq_length / h
    per_layer = seq_length * micro_batch_size * h * (34 + scores)
    parts = {
        "master_params": 4 * num_params / s,
        "gradients": 4 * num_params / s,
        "optimizer_states": _OPTIMIZER_STATE_BYTES[opt] * num_params / s,
        "working_params": 2 * largest_layer_params * param_bytes,
        "activations": (1 if bf16 else 2) * (
            2 * seq_length * micro_batch_size * h * num_layers + per_layer if recompute
            else per_layer * num_layers),
        "logits": seq_length * micro_batch_size * vocab_size * 4 * 2,
    }
    if replicated_params:
        parts.update(master_params=4 * num_params / s if bf16 else 0.0, gradients=float(grad_bytes * num_params),
                     working_params=float(num_params * param_bytes))
    if outer_state_shards:
        parts["outer_state"] = 4.0 * outer_state_shards * num_params / s
    if sync_buffer_bytes:
        parts["sync_buffers"] = float(sync_buffer_bytes)
    parts["total"] = sum(parts.values())
    return parts


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. "15.3 GiB" ("512 B" below 1 KiB)."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    value, unit = abs(float(n)), 0
    while value >= 1024 and unit < len(units) - 1:
        value, unit = value / 1024, unit + 1
    sign = "-" if n < 0 else ""
    return f"{sign}{value:.0f} B" if unit == 0 else f"{sign}{value:.1f} {units[unit]}"


def checkpoint_bytes(num_params: int, num_groups: int, optimizer: str, sgd_momentum: float = 0.0,
                     outer_copies: int = 0) -> dict:
    """Checkpoint size on disk: fp32 parameters plus the optimizer's fp32 state per parameter
    (AdamW: two moments; SGD: a momentum buffer when momentum > 0), for every group ("exact")
    or once ("compact"), plus in both modes `outer_copies` fp32 copies of the model that every
    rank's saved sync state adds up to (anchors, outer state, error-feedback residuals)."""
    states = 2 if optimizer == "adamw" else (1 if sgd_momentum > 0 else 0)
    one_group = num_params * 4 * (1 + states)
    outer = sync_state_bytes(num_params, outer_copies)
    return {"exact": one_group * num_groups + outer, "compact": one_group + outer}


def sync_state_bytes(num_params: int, outer_copies: int) -> int:
    """Bytes of `outer_copies` fp32 copies of the model in the ranks' saved sync state."""
    return num_params * 4 * outer_copies


def saved_outer_copies(fed, num_groups: int, replicas: int) -> int:
    """fp32 model copies the ranks' saved sync state holds: each rank saves its persistent
    shards (not the two in-flight buffers of an overlapped sync: a save lands it first), and
    the shards of all ranks of the F x P replicas cover the model F x P times."""
    if num_groups < 2 or not fed.syncing:
        return 0
    persistent = round(fed.outer_state_shards - fed.in_flight_shards)
    return persistent * num_groups * replicas
