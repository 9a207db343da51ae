"""--fl-fragments (Streaming DiLoCo): one fragment of the shards per sync, in turn.

References: the cut against the flat concatenation of the shards; the groups' mean of each
fragment computed from gathered shards; plain-torch DiLoCo (SGD with Nesterov momentum) run
separately on each fragment; the cost model's bytes against the unfragmented sync.
"""

import os

import pytest
import torch
import torch.distributed as dist

from fl_megatron.config.parallel import FederationConfig
from fl_megatron.cost_model.network import Cluster
from fl_megatron.cost_model.timing import Variant, Workload, predict
from fl_megatron.federation.fragments import due_fragment, fragment_bounds, fragment_views
from fl_megatron.local_ranks import run_ranks
from fl_megatron.topology import make_layout
from fl_test_utils import make_trainer, peers_identical, tiny_config

pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize("fragments", [1, 2, 3, 7])
def test_fragments_cut_the_flat_shards_into_contiguous_views(fragments):
    shards = [torch.randn(n) for n in (5, 0, 13, 1, 9)]
    views = fragment_views(shards, fragments)
    flat = torch.cat(shards)
    assert len(views) == fragments
    pieces = [torch.cat(v) for v in views]
    assert torch.equal(torch.cat(pieces), flat)  # every element once, in order
    sizes = [p.numel() for p in pieces]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == [end - start for start, end in fragment_bounds(flat.numel(), fragments)]
    for fragment in views:  # views, not copies: writing through them changes the shards
        for view in fragment:
            view.add_(1000.0)
    assert torch.equal(torch.cat(shards), flat + 1000.0)
    if fragments == 1:
        assert views[0][0] is shards[0]
    with pytest.raises(ValueError, match="cannot cut 3 shard elements into 4 fragments"):
        fragment_views([torch.zeros(3)], 4)


def test_each_fragment_syncs_once_per_interval_in_turn():
    schedule = [due_fragment(step, 8, 4) for step in range(1, 25)]
    assert schedule == [None, 0, None, 1, None, 2, None, 3] * 3
    assert [due_fragment(step, 8, 1) for step in range(1, 17)] == [None] * 7 + [0] + [None] * 7 + [0]


@pytest.mark.parametrize("settings,problem", [
    (dict(fragments=3), "fragments=3 must divide sync_interval=8"),
    (dict(fragments=2, overlap_steps=4), "overlap_steps=4 must be smaller than sync_interval / fragments = 4"),
    (dict(fragments=2, topology="ring"), "works with topology complete only"),
    (dict(fragments=2, inner_state="reset"), "inner_state reset restarts every moment"),
    (dict(fragments=0), r"fragments=0 must lie in \[1, 1024\]"),
    (dict(fragments=2048, sync_interval=2048), r"fragments=2048 must lie in \[1, 1024\]"),
])
def test_fragment_settings_that_cannot_work_are_refused(settings, problem):
    with pytest.raises(ValueError, match=problem):
        FederationConfig(**settings).validate()
    FederationConfig(fragments=2, overlap_steps=3).validate()


def test_cost_model_spreads_the_sync_over_fragments():
    """A fragment sync moves 1/N of the bytes every H/N steps; the last sync moves every fragment."""
    layout = make_layout(4, ranks_per_node=2, group_size=2)
    work = Workload(num_params=1_000_000, regathered_params=1_000_000, units=1, param_bytes=4, grad_bytes=4,
                    micro_batches=1, tokens_per_step=2048, compute_seconds=0.5)
    slow = Cluster(inter_node_gbps=0.1, intra_node_gbps=100.0)
    whole, halves = predict(Variant("FL", layout, 8), work, slow), predict(Variant("FL", layout, 8, fragments=2), work, slow)
    assert halves.sync_inter_node_bytes == pytest.approx(whole.sync_inter_node_bytes / 2)
    assert halves.syncs(16) == 16 // 4 - 1 + 2 and whole.syncs(16) == 2
    # per H the same bytes; the last sync moves both halves (fragment 0 synced at 12 and again at 16)
    assert halves.run_inter_node_bytes(16) == pytest.approx(whole.run_inter_node_bytes(16) * 5 / 4)
    assert halves.mean_step_seconds == pytest.approx(halves.step_seconds + halves.sync_seconds / 4)
    overlapped = predict(Variant("FL", layout, 8, overlap_steps=1, fragments=2), work, slow)
    hidden = max(0.0, halves.sync_seconds - halves.step_seconds)
    assert overlapped.run_seconds(16) == pytest.approx(16 * halves.step_seconds + 3 * hidden + 2 * halves.sync_seconds)
    assert FederationConfig(fragments=4, overlap_steps=1, outer_optimizer="nesterov").outer_state_shards == 2.5


def _flat(trainer) -> torch.Tensor:
    return torch.cat([s.detach().reshape(-1) for s in trainer.backend.local_shards()]).clone()


def _peers(trainer, flat: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.empty_like(flat) for _ in range(trainer.layout.num_groups)]
    dist.all_gather(gathered, flat, group=trainer.groups.peer)
    return gathered


def _fragment_job(rank, world, tmp, cache):
    out = {}
    # fp32 FedAvg and Nesterov, H = 4, N = 2: fragment 0 after steps 2 and 6, fragment 1 after 4, both after 8
    for outer in ("fedavg", "nesterov"):
        cfg = tiny_config(f"{tmp}/{outer}", cache, group_size=2, optimizer="adamw", lr=3e-3, steps=8,
                          sync_interval=4)
        cfg.federation.fragments, cfg.federation.outer_optimizer = 2, outer
        trainer = make_trainer(cfg)
        start = _flat(trainer)
        bounds = fragment_bounds(start.numel(), 2)
        anchors = [start[a:b].clone() for a, b in bounds]
        reference = [torch.optim.SGD([a], lr=0.7, momentum=0.9, nesterov=True) for a in anchors]
        moved, gaps, untouched, inter = [], [], [], {}
        for step in range(8):
            loss, _, _ = trainer._train_step(step, 3e-3)
            before = _flat(trainer)
            mean = sum(_peers(trainer, before)) / 2
            result = trainer.engine.after_step(step + 1, last=step == 7, loss=loss)
            after = _flat(trainer)
            if result is None:
                untouched.append(torch.equal(before, after))
                continue
            moved.append(list(result.fragments))
            inter[step + 1] = result.inter_group_bytes
            for f, (a, b) in enumerate(bounds):
                if f not in result.fragments:
                    untouched.append(torch.equal(before[a:b], after[a:b]))
                elif outer == "fedavg":
                    gaps.append((after[a:b] - mean[a:b]).abs().max().item())
                else:
                    anchors[f].grad = anchors[f] - mean[a:b]
                    reference[f].step()
                    gaps.append(((after[a:b] - anchors[f]).abs().max() / anchors[f].abs().max()).item())
        out[outer] = {"moved": moved, "gap": max(gaps), "untouched": all(untouched),
                      "identical": peers_identical(trainer), "bytes": inter}
        trainer.close()
    # a sick group, int8 + error feedback, overlap 1, averaged moments, on every backend
    backends = ["fsdp2"] + [b for b, m in (("deepspeed", "deepspeed"), ("megatron", "megatron"))
                            if __import__("importlib").util.find_spec(m) is not None]
    for backend in backends:
        cfg = tiny_config(f"{tmp}/sick-{backend}", cache, group_size=2, optimizer="adamw", lr=3e-3, steps=8,
                          sync_interval=4, backend=backend)
        f = cfg.federation
        f.fragments, f.outer_optimizer, f.sync_dtype, f.error_feedback = 2, "nesterov", "int8", True
        f.overlap_steps, f.inner_state = 1, "average"
        trainer = make_trainer(cfg)
        os.environ["FL_MEGATRON_FAULT"] = "nan-shard:1@2"
        results = [trainer.step(i)[3] for i in range(8)]
        del os.environ["FL_MEGATRON_FAULT"]
        out[backend] = {"syncs": [(r.step, list(r.fragments), list(r.sick_groups)) for r in results if r],
                        "identical": peers_identical(trainer),
                        "moments_identical": peers_identical(trainer, trainer.backend.inner_state_shards()),
                        "finite": all(bool(torch.isfinite(s).all()) for s in trainer.backend.local_shards())}
        trainer.close()
    return out


def test_fragments_sync_in_turn_exactly_and_reset_a_sick_group_whole(tmp_path):
    results = run_ranks(4, _fragment_job, str(tmp_path), str(tmp_path / "cache"), timeout=800)
    for r in results:
        for outer in ("fedavg", "nesterov"):
            got = r[outer]
            assert got["moved"] == [[0], [1], [0], [0, 1]], got
            assert got["untouched"] and got["identical"], got
            assert got["gap"] <= (0.0 if outer == "fedavg" else 1e-6), got
            assert got["bytes"][2] + got["bytes"][4] == got["bytes"][8], got  # two halves make the whole
        for backend in set(r) - {"fedavg", "nesterov"}:
            got = r[backend]
            # step 2: group 1 sick, every fragment averaged at once (blocking); 4 and 6 launch
            # fragments 1 and 0, landing a step later; 8: the last sync, every fragment
            assert got["syncs"] == [(2, [0, 1], [1]), (4, [1], []), (6, [0], []), (8, [0, 1], [])], (backend, got)
            assert got["identical"] and got["moments_identical"] and got["finite"], (backend, got)
