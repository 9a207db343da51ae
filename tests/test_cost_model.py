"""The cost model against hand-computed cases (no processes)."""

import json
import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fl_megatron.config.model import ModelConfig
from fl_megatron.cost_model import Cluster, Variant, Workload, collective_time, predict, ring_edges
from fl_megatron.cost_model.flops import compute_seconds, train_flops_per_token
from fl_megatron.cost_model.solve import solve_monotone
from fl_megatron.costs import Collective, step_comm, sync_comm
from fl_megatron.topology import make_layout

MIB16 = 16 * 2**20
SLOW = Cluster(inter_node_gbps=0.1, intra_node_gbps=8.0, library="gloo")  # 100 Mbit/s, 1 GB/s


def test_ring_edges_count_every_group_leaving_a_node():
    fsdp = make_layout(4, 2)                      # one ring 0-1-2-3: one edge leaves each node
    assert ring_edges(fsdp, "shard") == ({0: 1, 1: 1}, True)
    fl = make_layout(4, 2, group_size=2)          # peers {0,2} and {1,3}: two rings, both cross
    assert ring_edges(fl, "peer") == ({0: 2, 1: 2}, False)
    assert ring_edges(fl, "shard") == ({}, True)  # groups inside a node
    hsdp = make_layout(8, 2, shard_size=2)        # replica groups {0,2,4,6} and {1,3,5,7}
    leaving, local = ring_edges(hsdp, "replica")
    assert dict(leaving) == {0: 2, 1: 2, 2: 2, 3: 2} and not local


def test_all_reduce_over_two_nodes_at_100_mbit():
    """16 MiB fp32 all-reduce, 4 ranks, 2 per node: each rank sends 2 * 16 MiB * 3/4 = 24 MiB;
    one ring edge leaves each node: 24 MiB * 8 / 1e8 s. (The notes measured 2.14 s with headers.)"""
    layout = make_layout(4, 2)
    c = Collective("x", "all_reduce", "shard", 4, "intra-group", "inter-node", MIB16 / 4 * 2 * 3 / 4, 4)
    t = collective_time(c, layout, SLOW)
    assert t.seconds == pytest.approx(24 * 2**20 * 8 / 1e8, rel=1e-12)
    assert t.inter_node_wire_bytes == pytest.approx(2 * 24 * 2**20)
    framed = collective_time(c, layout, replace(SLOW, wire_overhead=1514 / 1448))
    assert framed.seconds == pytest.approx(t.seconds * 1514 / 1448)


def test_gloo_reduce_scatter_moves_an_all_reduce():
    layout = make_layout(4, 2)
    rs = step_comm(layout, 1_000_000, param_bytes=4, grad_bytes=4).by_name("reduce_scatter_grads")
    nccl = collective_time(rs, layout, replace(SLOW, library="nccl"))
    gloo = collective_time(rs, layout, SLOW)
    assert nccl.inter_node_wire_bytes == pytest.approx(2 * 4e6 * 3 / 4)
    assert gloo.inter_node_wire_bytes == pytest.approx(2 * nccl.inter_node_wire_bytes)


def test_latency_paid_per_ring_step_and_call():
    layout = make_layout(8, 8)  # one node
    ag = Collective("g", "all_gather", "shard", 8, "intra-group", "intra-node", 0.0, 2, calls=5)
    cluster = Cluster(inter_node_gbps=1.0, intra_node_gbps=1.0, intra_node_latency_us=3.0)
    assert collective_time(ag, layout, cluster).seconds == pytest.approx(5 * 7 * 3e-6)


def _work(psi=4_000_000, compute=0.5, regathered=None):
    return Workload(num_params=psi, regathered_params=psi if regathered is None else regathered, units=1,
                    param_bytes=4, grad_bytes=4, micro_batches=1, tokens_per_step=2048, compute_seconds=compute)


def test_fl_fsdp_step_and_sync_by_hand():
    """2 nodes x 2 ranks at 100 Mbit/s, groups of 2 (one per node): steps stay on the node, a sync
    all-reduces each half-shard over 2 peers, two peer rings leave each node: 2 * (psi/2 * 4 B)."""
    psi = 4_000_000
    work = _work(psi)
    p = predict(Variant("FL+FSDP", make_layout(4, 2, group_size=2), sync_interval=8), work, SLOW)
    assert p.step_inter_node_bytes == 0
    intra = 3 * (psi * 4 / 2) * 8 / 8e9 + (psi * 4 / 2) * 8 / 8e9  # AG, AG, RS as all-reduce (2x) on loopback
    assert p.step_seconds == pytest.approx(0.5 + intra)
    assert p.sync_seconds == pytest.approx(2 * (psi / 2 * 4) * 8 / 1e8)
    assert p.mean_step_seconds == pytest.approx(p.step_seconds + p.sync_seconds / 8)
    assert p.syncs(20) == 3 and p.run_seconds(20) == pytest.approx(20 * p.step_seconds + 3 * p.sync_seconds)


def test_fsdp_over_two_nodes_by_hand_and_overlap():
    psi = 4_000_000
    p = predict(Variant("FSDP", make_layout(4, 2)), _work(psi, regathered=psi // 2), SLOW)
    per_rank = (psi + psi / 2 + 2 * psi) * 4 * 3 / 4  # AG fwd, AG bwd (half regathered), RS as all-reduce
    comm = per_rank * 8 / 1e8
    assert p.step_seconds == pytest.approx(0.5 + comm)
    assert p.step_inter_node_bytes == pytest.approx(2 * per_rank)
    hidden = predict(Variant("FSDP", make_layout(4, 2)), _work(psi, regathered=psi // 2), SLOW, overlap=1.0)
    assert hidden.step_seconds == pytest.approx(max(0.5, comm))


def test_replica_split_sync_bytes_across_nodes():
    """4 nodes x 2 ranks, groups of 4 (2 replicas x 2 shards): naive all-reduces the 1/2 shard over
    2 peers on every replica; split all-reduces 1/4 and all-gathers the slices over replicas."""
    psi = 8_000_000
    layout = make_layout(8, 2, group_size=4, shard_size=2)
    naive = predict(Variant("n", layout, 8, replica_split=False), _work(psi), SLOW)
    split = predict(Variant("s", layout, 8, replica_split=True), _work(psi), SLOW)
    shard = psi / 2 * 4
    assert naive.sync_inter_node_bytes == pytest.approx(8 * 2 * shard / 2)          # 8 ranks, all cross
    assert split.sync_inter_node_bytes == pytest.approx(8 * (2 * shard / 2 / 2 + shard / 2))
    assert sync_comm(layout, psi, replica_split=True).bytes_by_scope["inter-group"] == pytest.approx(
        sync_comm(layout, psi, replica_split=False).bytes_by_scope["inter-group"] / 2)


def test_flops_and_compute_seconds():
    m = ModelConfig(num_layers=2, hidden_size=64)
    assert train_flops_per_token(1000, m, 32) == 6 * 1000 + 12 * 2 * 64 * 32
    assert train_flops_per_token(1000, m, 32, recompute=True) == pytest.approx(8 * 1000 + 16 * 2 * 64 * 32)
    assert compute_seconds(1000, m, 32, 10, peak_tflops=1.0, mfu=0.5) == pytest.approx(
        10 * (6000 + 49152) / 0.5e12)


def test_solve_monotone():
    assert solve_monotone(lambda x: x * x, 4.0, 0.1, 100.0) == pytest.approx(2.0, rel=1e-9)
    assert solve_monotone(lambda x: 1 / x, 0.5, 0.1, 100.0) == pytest.approx(2.0, rel=1e-9)
    assert solve_monotone(lambda x: x, 1000.0, 0.1, 100.0) is None


def test_published_preset_table_and_implied_values(tmp_path):
    tool = Path(__file__).resolve().parents[1] / "tools" / "cost_model.py"
    out = tmp_path / "published.json"
    proc = subprocess.run([sys.executable, str(tool), "--preset", "published", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for text in ("FL+FSDP        128 x (4)", "FL+HSDP split  16 x (8x4)", "published: up to 8.04x",
                 "ASSUMED", "leaves out"):
        assert text in proc.stdout
    data = json.loads(out.read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"FSDP", "HSDP", "FL+FSDP", "FL+HSDP naive", "FL+HSDP split"}
    # FL+FSDP keeps steps inside a node: no inter-node bytes between syncs
    assert rows["FL+FSDP"]["inter_node_bytes_per_step"] == 0 and rows["FSDP"]["inter_node_bytes_per_step"] > 0
    # an implied value, where one exists, reproduces the target when put back into the model
    bw = data["implied_fp32_gathers"]["inter_node_gbps"]["value"]
    assert bw is not None and bw > 0
    from fl_megatron.cost_model.published import best_speedup, published_workload
    _, work, cluster = published_workload()
    assert best_speedup(replace(work, param_bytes=4), replace(cluster, inter_node_gbps=bw))[1] == \
        pytest.approx(8.04, rel=1e-6)
    assert math.isclose(data["best_speedup"], best_speedup(work, cluster)[1])


def test_configured_cluster_errors_and_dry_run_block():
    tool = Path(__file__).resolve().parents[1] / "tools" / "cost_model.py"
    bad = subprocess.run([sys.executable, str(tool), "--model", "llama-tiny", "--world-size", "8",
                          "--inter-node-gbps", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "inter_node_gbps=0.0 must be positive" in bad.stderr
    ok = subprocess.run([sys.executable, str(tool), "--model", "llama-tiny", "--world-size", "8",
                         "--ranks-per-node", "2", "--fl-group-size", "4", "--fl-hsdp-shard-size", "2",
                         "--collective-library", "gloo", "--inter-node-gbps", "0.1", "--compute-seconds", "0.5"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    for label in ("FSDP ", "HSDP ", "FL+HSDP naive", "FL+HSDP split"):
        assert label in ok.stdout


def test_workload_of_each_backend_and_gradient_dtype():
    """Gradient bytes and gathers per step follow what each backend does: FSDP2 and megatron
    reduce fp32 gradients unless --grad-reduce-dtype bf16, DeepSpeed its model dtype; megatron
    gathers the whole model once per step and never for evaluation."""
    from fl_megatron.config import RunConfig, resolve
    from fl_megatron.cost_model.workload import workload_for
    from fl_megatron.models import get_preset

    def workload(backend, grad=None):
        cfg = RunConfig()
        cfg.model, cfg.preset = get_preset("llama-tiny"), "llama-tiny"
        cfg.parallel.backend, cfg.training.bf16, cfg.training.grad_reduce_dtype = backend, True, grad
        cfg.training.micro_batch_size, cfg.training.gradient_accumulation_steps = 1, 4
        if backend == "deepspeed":
            cfg.deepspeed = {}
        return workload_for(resolve(cfg, 8, 4), compute_seconds=1.0)

    fsdp2, megatron, deepspeed = workload("fsdp2"), workload("megatron"), workload("deepspeed")
    assert (fsdp2.grad_bytes, megatron.grad_bytes, deepspeed.grad_bytes) == (4, 4, 2)
    assert workload("fsdp2", "bf16").grad_bytes == workload("megatron", "bf16").grad_bytes == 2
    assert megatron.gathered_once and not fsdp2.gathered_once
    layout = make_layout(8, ranks_per_node=4)
    variant = Variant("FSDP", layout, 0)
    with_eval = predict(variant, replace(megatron, eval_forwards=4), SLOW)
    assert with_eval.eval_comm_seconds == 0  # the whole model is on every rank: evaluation moves nothing
    assert predict(variant, replace(fsdp2, eval_forwards=4), SLOW).eval_comm_seconds > 0
    gathers = [t for t in predict(variant, megatron, SLOW).step_comm if t.collective.op == "all_gather"]
    assert sum(t.collective.bytes for t in gathers) == pytest.approx(megatron.num_params * 7 / 8 * 2)


def test_overlapped_and_compressed_syncs():
    """int8 with per-256 scales moves (1 + 4/256)/4 of the fp32 sync bytes; with K overlapped
    steps a sync adds only what K steps' time does not cover, and the last sync stays blocking."""
    layout = make_layout(4, ranks_per_node=2, group_size=2)
    fp32 = Workload(num_params=1_000_000, regathered_params=1_000_000, units=1, param_bytes=4, grad_bytes=4,
                    micro_batches=1, tokens_per_step=2048, compute_seconds=0.5)
    int8 = replace(fp32, master_bytes=1 + 4 / 256)
    blocking, packed = predict(Variant("FL", layout, 8), fp32, SLOW), predict(Variant("FL", layout, 8), int8, SLOW)
    assert packed.sync_inter_node_bytes == pytest.approx(blocking.sync_inter_node_bytes * (1 + 4 / 256) / 4)
    overlapped = predict(Variant("FL", layout, 8, overlap_steps=1), int8, SLOW)
    hidden = max(0.0, packed.sync_seconds - packed.step_seconds)
    assert overlapped.exposed_sync_seconds == pytest.approx(hidden)
    assert overlapped.mean_step_seconds == pytest.approx(packed.step_seconds + hidden / 8)
    assert overlapped.run_seconds(16) == pytest.approx(16 * packed.step_seconds + hidden + packed.sync_seconds)


def test_coupling_costs_against_closed_forms():
    """The slowest of F exponential stalls has mean m x H_F (the F-th harmonic number); a single
    group's stalls cost their mean whatever the interval; a world all-reduce pays 2 (N - 1)
    ring steps of latency, inter-node when the job spans nodes."""
    from fl_megatron.cost_model.coupling import jitter_wait_per_step, world_all_reduce_seconds
    from fl_megatron.cost_model.network import Cluster
    from fl_megatron.topology import make_layout

    m = 0.05
    for groups in (1, 2, 8):
        harmonic = sum(1 / k for k in range(1, groups + 1))
        assert jitter_wait_per_step(groups, 8, m, coupled=True) == pytest.approx(m * harmonic, rel=0.03)
    assert jitter_wait_per_step(1, 8, m, coupled=False) == pytest.approx(m, rel=0.03)
    # meeting only at syncs waits less per step, and less so the more the stalls average out
    decoupled = [jitter_wait_per_step(8, h, m, coupled=False) for h in (1, 8, 64)]
    assert decoupled[0] == pytest.approx(jitter_wait_per_step(8, 1, m, coupled=True), rel=0.03)
    assert decoupled[0] > decoupled[1] > decoupled[2] > m
    assert jitter_wait_per_step(8, 8, 0.0, coupled=True) == 0.0
    cluster = Cluster(inter_node_gbps=200, intra_node_gbps=1600, inter_node_latency_us=5, intra_node_latency_us=2)
    assert world_all_reduce_seconds(make_layout(512, 4, group_size=4), cluster) == pytest.approx(2 * 511 * 5e-6)
    assert world_all_reduce_seconds(make_layout(4, 4, group_size=2), cluster) == pytest.approx(2 * 3 * 2e-6)


def _predicted_block(text: str) -> str:
    """The cost model's block: from 'predicted time' to the end of its table."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "predicted time (cost model" in line)
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return "\n".join(lines[start:end])


def test_the_tool_and_the_dry_run_agree_on_the_same_flags():
    """docs/cost-model.md's example: `--seq-length` once matched `--seq-length-published` by
    argparse's prefix matching, so the tool ran at sequence 128 without a word. Both forms of
    the flag must reach the model, and the tool must print what the dry run prints."""
    root = Path(__file__).resolve().parents[1]
    flags = ["--model", "llama3.1-8b", "--world-size", "256", "--ranks-per-node", "8", "--fl-group-size", "8",
             "--bf16", "--micro-batch-size", "1", "--inter-node-gbps", "100", "--mfu", "0.35"]
    dry = subprocess.run([sys.executable, "-m", "fl_megatron.pretrain", *flags, "--seq-length", "8192", "--dry-run"],
                         capture_output=True, text=True, timeout=120, cwd=root)
    assert dry.returncode == 0, dry.stderr
    expected = _predicted_block(dry.stdout)
    assert "sequence length 8192" in expected and "2,097,152 tokens per step over 256 ranks" in expected
    for seq in (["--seq-length", "8192"], ["--seq-length=8192"]):
        tool = subprocess.run([sys.executable, str(root / "tools" / "cost_model.py"), *flags, *seq],
                              capture_output=True, text=True, timeout=120)
        assert tool.returncode == 0, tool.stderr
        assert _predicted_block(tool.stdout) == expected, (seq, tool.stdout)
    # a prefix of a flag is refused, not matched
    short = subprocess.run([sys.executable, str(root / "tools" / "cost_model.py"), *flags, "--seq-len", "8192"],
                           capture_output=True, text=True, timeout=120)
    assert short.returncode == 2 and "--seq-len" in short.stderr, short.stderr


def test_no_parser_of_ours_matches_abbreviated_flags():
    """Every argparse parser in the package and the tools is built with allow_abbrev=False."""
    root = Path(__file__).resolve().parents[1]
    offenders = []
    for path in [*(root / "fl_megatron").rglob("*.py"), *(root / "tools").rglob("*.py")]:
        text = path.read_text()
        for index in [m.start() for m in re.finditer(r"(ArgumentParser|_Parser)\(", text)]:
            call = text[index:index + 200]  # the keyword arguments follow the name
            if "class " not in text[max(0, index - 6):index] and "allow_abbrev=False" not in call:
                offenders.append(f"{path.relative_to(root)}: {call[:60]}")
    assert not offenders, offenders
