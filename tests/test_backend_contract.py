"""Each backend (and the Megatron-LM integration's shard owner) against fl_megatron/federation/contract.py:
the signatures, then the behaviour on a tiny model in 2 processes (2 federation groups of 1 rank,
so the ranks are each other's peers): devices and dtypes of what comes back, in-place views, the
inner state's reset and transfer, the refresh after the shards change, and a save/load round trip.
"""

import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fl_megatron.federation.contract import ShardOwner, TrainingBackend
from fl_megatron.local_ranks import run_ranks

pytestmark = pytest.mark.timeout(900)
BACKENDS = ["fsdp2", "deepspeed", "megatron"]


def _methods(protocol) -> dict:
    return {name: inspect.signature(fn) for name, fn in inspect.getmembers(protocol, inspect.isfunction)
            if not name.startswith("_")}


def _backend_class(name: str):
    if name == "fsdp2":
        from fl_megatron.backends.fsdp2 import FSDP2Backend as cls
    elif name == "deepspeed":
        pytest.importorskip("deepspeed")
        from fl_megatron.backends.deepspeed_zero3 import DeepSpeedBackend as cls
    else:
        pytest.importorskip("megatron.core")
        from fl_megatron.backends.megatron_core import MegatronBackend as cls
    return cls


@pytest.mark.parametrize("name", BACKENDS)
def test_every_contract_method_exists_with_its_signature(name):
    cls = _backend_class(name)
    for method, expected in _methods(TrainingBackend).items():
        assert callable(getattr(cls, method, None)), f"{cls.__name__} lacks {method}"
        got = inspect.signature(getattr(cls, method))
        assert list(got.parameters) == list(expected.parameters), (cls.__name__, method, got, expected)


def test_the_megatron_lm_shard_owner_has_the_engine_contract():
    pytest.importorskip("megatron.core")
    from fl_megatron.backends.megatron_shards import MegatronMainShards

    for method, expected in _methods(ShardOwner).items():
        got = inspect.signature(getattr(MegatronMainShards, method))
        assert list(got.parameters) == list(expected.parameters), (method, got, expected)
    assert set(_methods(ShardOwner)) < set(_methods(TrainingBackend))


def _same_on_peers(values) -> bool:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, values)
    return all(v == everyone[0] for v in everyone)


def _storages(tensors) -> set:
    return {t.untyped_storage().data_ptr() for t in tensors}


@torch.no_grad()
def _perturb(shards, by: float) -> None:
    for s in shards:
        s.add_(by)


def _contract_job(rank, world, tmp, cache, name):
    from fl_megatron.backends import make_backend
    from fl_megatron.config.resolved import resolve
    from fl_megatron.federation.groups import build_process_groups
    from fl_test_utils import tiny_config

    cfg = tiny_config(f"{tmp}/{name}", cache, group_size=1, optimizer="adamw", lr=1e-3, backend=name)
    run = resolve(cfg, world, world)
    groups = build_process_groups(run.layout, "cpu", async_checkpoint=True)
    backend = make_backend(run, groups, torch.device("cpu"))
    out = {}
    shards = backend.local_shards()
    out["shards_fp32_contiguous_cpu"] = all(s.dtype == torch.float32 and s.is_contiguous() and s.device.type == "cpu"
                                            for s in shards)
    out["shards_same_on_peers"] = _same_on_peers([tuple(s.shape) for s in shards])
    named = backend.named_shards()
    out["named_cover_the_shards"] = (sum(t.numel() for _, t in named) == sum(s.numel() for s in shards)
                                     and _storages(t for _, t in named if t.numel()) <= _storages(shards)
                                     and all(t.dim() == 1 and t.dtype == torch.float32 for _, t in named))
    out["named_same_on_peers"] = _same_on_peers([(n, t.numel()) for n, t in named])
    out["inner_empty_before_a_step"] = backend.inner_state_shards() == []
    # one step
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(rank))
    logits = backend.forward(ids)
    out["logits"] = (tuple(logits.shape), logits.device.type)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             ids[:, 1:].reshape(-1))
    backend.backward(loss, 1, True)
    norm, lr = backend.optimizer_step(1e-3)
    out["step"] = (norm.dim(), norm.device.type, bool(torch.isfinite(norm)), lr)
    inner = backend.inner_state_shards()
    out["inner_fp32_cpu_same_on_peers"] = (bool(inner) and all(t.dtype == torch.float32 and t.device.type == "cpu"
                                                                for t in inner)
                                           and _same_on_peers([tuple(t.shape) for t in inner]))
    inner[0].add_(1.0)  # views: the engine averages them in place
    out["inner_are_views"] = torch.equal(backend.inner_state_shards()[0], inner[0])
    # reset, then the transfer state brings everything back without moving the shards
    sent = [t.clone() for t in backend.optimizer_transfer_state()]
    before = [s.clone() for s in backend.local_shards()]
    backend.reset_optimizer_state()
    out["reset_empties"] = backend.inner_state_shards() == []
    backend.load_optimizer_transfer_state(sent)
    back = backend.optimizer_transfer_state()
    out["transfer_round_trip"] = len(back) == len(sent) and all(torch.equal(a, b) for a, b in zip(back, sent))
    out["transfer_leaves_shards"] = all(torch.equal(a, b) for a, b in zip(before, backend.local_shards()))
    # the refresh: shards changed in place reach the model
    full = {k: v.clone() for k, v in backend.full_state_dict().items()}  # (on one CPU rank: the parameters themselves)
    out["full_fp32_cpu"] = all(v.dtype == torch.float32 and v.device.type == "cpu" for v in full.values())
    _perturb(backend.local_shards(), 0.5)
    backend.refresh_after_sync()
    moved = backend.full_state_dict()
    out["refresh_reaches_model"] = max((moved[k] - full[k] - 0.5).abs().max().item() for k in full)
    count = len(backend.inner_state_shards())
    out["forward_changed"] = not torch.equal(backend.forward(ids), logits)  # (a forward without a backward)
    out["state_survives_a_forward"] = len(backend.inner_state_shards()) == count
    # save, change, load
    saved = [s.clone() for s in backend.local_shards()]
    saved_inner = [t.clone() for t in backend.inner_state_shards()]
    backend.save_state(tmp_dir := Path(f"{tmp}/{name}/ckpt-{rank}"), write=True)
    future = backend.save_state_async(Path(f"{tmp}/{name}/ckpt-async-{rank}"), write=True)
    if future is not None:
        future.result()
    _perturb(backend.local_shards(), 1.0)
    backend.reset_optimizer_state()
    backend.load_state(tmp_dir, load_optimizer=True)
    out["load_restores_shards"] = all(torch.equal(a, b) for a, b in zip(saved, backend.local_shards()))
    loaded_inner = backend.inner_state_shards()
    out["load_restores_inner"] = len(loaded_inner) == len(saved_inner) and all(
        torch.equal(a, b) for a, b in zip(saved_inner, loaded_inner))
    return out


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_behaves_as_the_contract_says(tmp_path, name):
    _backend_class(name)
    for r in run_ranks(2, _contract_job, str(tmp_path), str(tmp_path / "cache"), name, timeout=600):
        for key in ("shards_fp32_contiguous_cpu", "shards_same_on_peers", "named_cover_the_shards",
                    "named_same_on_peers", "inner_empty_before_a_step", "inner_fp32_cpu_same_on_peers",
                    "inner_are_views", "reset_empties", "transfer_round_trip", "transfer_leaves_shards",
                    "full_fp32_cpu", "forward_changed", "state_survives_a_forward", "load_restores_shards",
                    "load_restores_inner"):
            assert r[key] is True, (name, key, r)
        assert r["logits"] == ((2, 32, 512), "cpu"), r
        assert r["step"] == (0, "cpu", True, 1e-3), r
        assert r["refresh_reaches_model"] < 1e-6, (name, r["refresh_reaches_model"])
