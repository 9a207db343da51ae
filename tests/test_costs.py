"""Tests of fl_megatron.costs against closed forms written out independently."""

import pytest
import torch

from fl_megatron.costs import (QUANT_BITS, QUANT_BLOCK, average_per_step, estimate_memory_per_rank, format_bytes,
                               step_comm, sync_comm, sync_state_shards, wire_bytes_per_element, wire_shards_per_sync,
                               wire_volume)
from fl_megatron.topology import make_layout

PSI = 8_030_261_248  # Llama 3 8B parameter count; divisible by 512


def test_fsdp_step_closed_form():
    layout = make_layout(512, ranks_per_node=4)
    step = step_comm(layout, PSI, param_bytes=2, grad_bytes=4)
    assert step.total_elements == pytest.approx(3 * PSI * 511 / 512, rel=1e-12)
    # 2 all-gathers at bf16, one fp32 reduce-scatter: 8 bytes per element of Psi*(G-1)/G.
    assert step.total_bytes == pytest.approx(8 * (PSI // 512) * 511, rel=1e-12)
    assert {c.name for c in step.entries} == {
        "all_gather_forward", "all_gather_backward", "reduce_scatter_grads"}
    assert step.by_name("reduce_scatter_grads").bytes_per_element == 4
    assert step.bytes_by_tier == {"intra-node": 0, "inter-node": step.total_bytes}
    assert sync_comm(layout, PSI).entries == ()


def test_megatron_distributed_optimizer_gathers_once_per_step():
    """megatron-core keeps the whole model on every rank: one bf16 all-gather per step whatever
    the micro-batches, no backward gather, and a whole fp32 gradient buffer in memory."""
    layout = make_layout(512, ranks_per_node=8, group_size=8)
    step = step_comm(layout, PSI, param_bytes=2, grad_bytes=4, micro_batches=4, gathered_once=True)
    assert {c.name for c in step.entries} == {"all_gather_forward", "reduce_scatter_grads"}
    assert step.total_bytes == pytest.approx(PSI * 7 / 8 * (2 + 4))
    fsdp = step_comm(layout, PSI, param_bytes=2, grad_bytes=4, micro_batches=4)
    assert fsdp.total_bytes == pytest.approx(PSI * 7 / 8 * (4 * 2 + 4 * 2 + 4))
    args = (layout, PSI, 32, 4096, 2048, 1, 128256, 32)
    sharded, whole = estimate_memory_per_rank(*args), estimate_memory_per_rank(*args, replicated_params=True)
    assert whole["gradients"] == 4 * PSI and whole["working_params"] == 2 * PSI
    assert whole["master_params"] == sharded["master_params"] == 4 * PSI / 8
    assert whole["optimizer_states"] == sharded["optimizer_states"]
    assert estimate_memory_per_rank(*args, bf16=False, replicated_params=True)["master_params"] == 0


def test_hsdp_step_closed_form():
    layout = make_layout(512, ranks_per_node=4, shard_size=4)  # P = 128
    step = step_comm(layout, PSI)
    shard_part = PSI * 3 / 4 * (2 + 2 + 4)
    replica_part = 2 * (PSI / 4) * 127 / 128 * 4
    assert step.total_bytes == pytest.approx(shard_part + replica_part)
    assert step.bytes_by_tier["intra-node"] == pytest.approx(shard_part)
    assert step.bytes_by_tier["inter-node"] == pytest.approx(replica_part)
    assert step.bytes_by_scope == {"intra-group": step.total_bytes, "inter-group": 0}


@pytest.mark.parametrize("group_size", [4, 32, 128])
def test_fl_fsdp_sync_is_shard_times_allreduce_factor(group_size):
    layout = make_layout(512, ranks_per_node=4, group_size=group_size)
    f = 512 // group_size
    shard_bytes = PSI / group_size * 4
    sync = sync_comm(layout, PSI, master_bytes=4)
    assert sync.total_bytes == pytest.approx(shard_bytes * 2 * (f - 1) / f)
    assert sync.bytes_by_scope["inter-group"] == pytest.approx(sync.total_bytes)
    assert [c.group_size for c in sync.entries] == [f]


def test_replica_split_divides_inter_group_bytes_by_p():
    layout = make_layout(512, ranks_per_node=4, group_size=32, shard_size=4)  # F=16 P=8
    naive = sync_comm(layout, PSI, replica_split=False)
    split = sync_comm(layout, PSI, replica_split=True)
    assert naive.bytes_by_scope["inter-group"] == pytest.approx(
        2 * (PSI / 4) * 15 / 16 * 4)
    assert split.bytes_by_scope["inter-group"] == pytest.approx(
        naive.bytes_by_scope["inter-group"] / 8)
    assert split.bytes_by_scope["intra-group"] == pytest.approx((PSI / 4) * 7 / 8 * 4)
    assert naive.bytes_by_scope["intra-group"] == 0
    # a compressed or sparse sync crosses groups at its own width, and the replicas still gather
    # the averaged slices in fp32 (the buffer, averaging.gather_slices)
    for width, gathered in ((wire_bytes_per_element("int4"), False), (wire_bytes_per_element("int2", 0.0156), True)):
        coded = sync_comm(layout, PSI, master_bytes=width, replica_split=True, gathered=gathered)
        assert coded.bytes_by_scope["intra-group"] == pytest.approx((PSI / 4) * 7 / 8 * 4)
        assert coded.bytes_by_scope["inter-group"] < split.bytes_by_scope["inter-group"] / 4


def test_tiers_groups_of_one_node():
    layout = make_layout(512, ranks_per_node=4, group_size=4)
    step, sync = step_comm(layout, PSI), sync_comm(layout, PSI)
    assert step.bytes_by_tier["inter-node"] == 0 and step.bytes_by_tier["intra-node"] > 0
    assert sync.bytes_by_tier["intra-node"] == 0 and sync.bytes_by_tier["inter-node"] > 0


def test_tiers_groups_tiling_one_node():
    layout = make_layout(4, ranks_per_node=4, group_size=2)
    step, sync = step_comm(layout, PSI), sync_comm(layout, PSI)
    assert step.bytes_by_tier["intra-node"] > 0 and sync.bytes_by_tier["intra-node"] > 0
    assert step.bytes_by_tier["inter-node"] == 0 and sync.bytes_by_tier["inter-node"] == 0


def test_single_rank_moves_nothing():
    layout = make_layout(1)
    assert step_comm(layout, PSI).total_bytes == 0
    assert average_per_step(layout, PSI, 10)["total"] == 0


def test_average_per_step_amortises_sync():
    layout = make_layout(512, ranks_per_node=4, group_size=4)
    step_inter = step_comm(layout, PSI).bytes_by_tier["inter-node"]
    sync_inter = sync_comm(layout, PSI).bytes_by_tier["inter-node"]
    avg = average_per_step(layout, PSI, sync_interval=50)
    assert avg["inter-node"] == pytest.approx(step_inter + sync_inter / 50)
    assert avg["total"] == pytest.approx(avg["intra-node"] + avg["inter-node"])
    assert avg["total"] == pytest.approx(avg["intra-group"] + avg["inter-group"])
    assert average_per_step(layout, PSI, sync_interval=0)["inter-node"] == step_inter
    with pytest.raises(ValueError, match="sync_interval=-1"):
        average_per_step(layout, PSI, sync_interval=-1)


MODEL = dict(num_layers=32, hidden_size=4096, seq_length=8192, micro_batch_size=1,
             vocab_size=128256, num_attention_heads=32)


def test_memory_sharded_states_scale_with_shard_size():
    small = estimate_memory_per_rank(make_layout(512, ranks_per_node=4, shard_size=4),
                                     PSI, **MODEL)
    large = estimate_memory_per_rank(make_layout(512, ranks_per_node=4, shard_size=8),
                                     PSI, **MODEL)
    for key in ("master_params", "gradients", "optimizer_states"):
        assert large[key] == pytest.approx(small[key] / 2)
    assert small["master_params"] == pytest.approx(4 * PSI / 4)
    assert small["optimizer_states"] == pytest.approx(8 * PSI / 4)
    for key in ("working_params", "activations", "logits"):
        assert large[key] == small[key]
    parts = sum(v for k, v in small.items() if k != "total")
    assert small["total"] == pytest.approx(parts)


def test_memory_activation_formula_and_options():
    layout = make_layout(8)
    mem = estimate_memory_per_rank(layout, PSI, **MODEL, largest_layer_params=1000)
    s, b, h, a, L = 8192, 1, 4096, 32, 32
    assert mem["activations"] == pytest.approx(L * s * b * h * 34)
    scores = estimate_memory_per_rank(layout, PSI, **MODEL, largest_layer_params=1000,
                                      flash_attention=False)
    assert scores["activations"] == pytest.approx(L * s * b * h * (34 + 5 * a * s / h))
    assert mem["logits"] == s * b * 128256 * 8
    assert mem["working_params"] == 2 * 1000 * 2
    fp32 = estimate_memory_per_rank(layout, PSI, **MODEL, bf16=False, optimizer="sgd",
                                    largest_layer_params=1000)
    assert fp32["activations"] == pytest.approx(2 * mem["activations"])
    assert fp32["working_params"] == 2 * 1000 * 4
    assert fp32["optimizer_states"] == 0
    with pytest.raises(ValueError, match="optimizer='lion'"):
        estimate_memory_per_rank(layout, PSI, **MODEL, optimizer="lion")


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (512, "512 B"), (1536, "1.5 KiB"), (15.3 * 2**30, "15.3 GiB"),
    (3 * 2**40, "3.0 TiB"), (-2048, "-2.0 KiB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_recompute_keeps_block_inputs_plus_one_block():
    layout = make_layout(8)
    s, b, h, L = 8192, 1, 4096, 32
    full = estimate_memory_per_rank(layout, PSI, **MODEL, largest_layer_params=1000)
    rec = estimate_memory_per_rank(layout, PSI, **MODEL, largest_layer_params=1000, recompute=True)
    assert rec["activations"] == pytest.approx(2 * s * b * h * L + s * b * h * 34)
    assert rec["activations"] < full["activations"] / 10


def test_sync_buffers_and_unfused_attention_are_counted():
    """A sync's transient buckets (more fp32 copies when compressed, fewer when sparse) and
    megatron's unfused attention (the s x s scores) are in the per-rank estimate."""
    from fl_megatron.costs import PACKED_BUCKETS_IN_FLIGHT, SYNC_BUCKET_COPIES, sync_buffer_bytes, sync_codec

    bucket = 32 * 2**20
    assert [sync_codec("fp32"), sync_codec("int4"), sync_codec("int2", 0.0156)] == ["fp32", "dense", "sparse"]
    assert sync_buffer_bytes(bucket, "fp32") == PACKED_BUCKETS_IN_FLIGHT * bucket
    for codec in ("dense", "sparse"):
        assert sync_buffer_bytes(bucket, codec) == (PACKED_BUCKETS_IN_FLIGHT + SYNC_BUCKET_COPIES[codec]) * bucket
    assert SYNC_BUCKET_COPIES["sparse"] < SYNC_BUCKET_COPIES["dense"]
    layout = make_layout(8, ranks_per_node=4, group_size=4)
    args = dict(num_layers=2, hidden_size=64, seq_length=4096, micro_batch_size=1, vocab_size=512,
                num_attention_heads=4)
    fused = estimate_memory_per_rank(layout, 10**6, **args)
    unfused = estimate_memory_per_rank(layout, 10**6, **args, flash_attention=False, sync_buffer_bytes=bucket)
    # per layer: s * b * h * 5 * heads * s / h more bytes (bf16: x1) for the scores
    assert unfused["activations"] - fused["activations"] == 2 * 4096 * 64 * 5 * 4 * 4096 / 64
    assert unfused["sync_buffers"] == bucket and unfused["total"] - fused["total"] == pytest.approx(
        unfused["activations"] - fused["activations"] + bucket)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8", "int4"])
def test_the_wire_count_is_what_the_codec_sends(dtype):
    """The cost model's bytes per element against the encoding the sync really sends."""
    from fl_megatron.federation.compression import quantize

    x = torch.randn(64 * QUANT_BLOCK)
    if dtype in QUANT_BITS:
        sent = quantize(x, QUANT_BITS[dtype])
    else:
        sent = [x.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])]
    assert sum(p.numel() * p.element_size() for p in sent) == x.numel() * wire_bytes_per_element(dtype)
    with pytest.raises(ValueError, match="sync_dtype='fp8' is not one of fp32, bf16, int8, int4"):
        wire_bytes_per_element("fp8")


def test_sync_state_and_wire_volume_counts():
    """Sync state by hand: nesterov keeps anchor + momentum, + a residual with error feedback, + two
    buffers of the fragment in flight; a plain fp32 average keeps none. A ring all-reduce over 4
    groups moves 2 x 3/4 of its payload; a gossip round's payload is already per neighbour."""
    assert sync_state_shards("nesterov", False, True, True, 4) == 2 + 1 + 2 / 4
    assert sync_state_shards("adam", False, False, False, 1) == 3
    assert sync_state_shards("fedavg", True, False, False, 1) == 0
    assert wire_volume("complete", 4, 1000.0) == 1500.0 and wire_volume("ring", 4, 1000.0) == 1000.0
    assert wire_shards_per_sync("complete", 4) == 1.5 and wire_shards_per_sync("exponential", 8) == 3
