"""Each backend (and the Megatron-LM integration's shard owner) against fl_megatron/federation/contract.py:
the signatures and the declarations (`CALLS`, `STEP_COUNTS`), then the behaviour on a tiny model in 2
processes, as 2 federation groups of 1 rank (the ranks are each other's peers) and as 1 group of 2
ranks with a model none of whose parameter sizes divides by 2 (uneven shards): devices and dtypes of
what comes back, in-place views, the collectives of every call and their groups, the "any thread"
calls made from a second thread, the inner state's reset and transfer (step counts included), the
refresh after the shards change, and save/load round trips, the asynchronous save into a fresh backend.
"""

import inspect
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fl_megatron.federation.contract import (CALLS, JOB, NO_COLLECTIVE, SCOPES, STEP_COUNTS, ShardOwner,
                                             TrainingBackend)
from fl_megatron.federation.ledger import CollectiveCounter
from fl_megatron.local_ranks import run_ranks

pytestmark = pytest.mark.timeout(900)
BACKENDS = ["fsdp2", "deepspeed", "megatron"]
LAYOUTS = {"2-groups-of-1": 1, "1-group-of-2-uneven": 2}  # 2 ranks; the federation group's size
# a GPT (no RoPE: odd widths allowed) every parameter of which has an odd number of elements
ODD_MODEL = dict(arch="gpt", num_layers=1, hidden_size=15, ffn_hidden_size=21, num_attention_heads=3,
                 vocab_size=257, max_position_embeddings=33, tie_embeddings=False)
ON_ANOTHER_THREAD = " (another thread)"  # how a call made off the training thread is recorded


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


def test_every_method_declares_its_collectives_and_threads_and_its_docstring_says_so():
    methods = _methods(TrainingBackend)
    assert set(CALLS) == set(methods), f"CALLS and the protocol differ: {sorted(set(CALLS) ^ set(methods))}"
    for method, rule in CALLS.items():
        assert rule.collective in SCOPES, (method, rule)
        last = inspect.getdoc(getattr(TrainingBackend, method)).splitlines()[-1].strip()
        assert last == rule.line(), f"{method}'s docstring ends {last!r}, the declaration says {rule.line()!r}"
        if rule.any_thread:  # called as torchft's quorum thread calls them: without arguments
            assert list(methods[method].parameters) == ["self"], method
            assert rule.collective == NO_COLLECTIVE, method
    assert set(STEP_COUNTS) == set(BACKENDS)


# --- step counts wherever an optimizer keeps them -----------------------------------------------
class _ToyAdam(torch.optim.Optimizer):
    """A one-moment Adam keeping its step counts where `holder` says, as the optimizers named in
    `STEP_COUNTS` do: "state tensor" (torch's Adam), "state int" (DeepSpeed's FusedAdam), "group
    int" (Transformer Engine's and Apex's FusedAdam)."""

    HOLDERS = ("state tensor", "state int", "group int")

    def __init__(self, params, holder: str, lr: float = 0.1) -> None:
        if holder not in self.HOLDERS:
            raise ValueError(f"no stand-in optimizer keeps step counts as {holder!r}; known: {self.HOLDERS}")
        super().__init__(params, {"lr": lr})
        self.holder = holder

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if self.holder == "group int":
                group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    if self.holder != "group int":
                        state["step"] = torch.tensor(0.0) if self.holder == "state tensor" else 0
                if self.holder != "group int":
                    state["step"] += 1
                step = group["step"] if self.holder == "group int" else float(state["step"])
                state["exp_avg"].mul_(0.9).add_(p.grad, alpha=0.1)
                p.add_(state["exp_avg"] / (1 - 0.9 ** step), alpha=-group["lr"])


def _step_counts(optimizers) -> tuple[list, list]:
    """(where the optimizers keep step counts, their distinct values), both sorted."""
    holders, values = set(), set()
    for opt in optimizers:
        for state in opt.state.values():
            if "step" in state:
                holders.add("state tensor" if torch.is_tensor(state["step"]) else "state int")
                values.add(float(state["step"]))
        for group in opt.param_groups:
            if "step" in group:
                holders.add("group tensor" if torch.is_tensor(group["step"]) else "group int")
                values.add(float(group["step"]))
    return sorted(holders), sorted(values)


def _trained_toy(holder: str, steps: int):
    params = [torch.nn.Parameter(torch.linspace(-1.0, 1.0, n)) for n in (5, 3)]
    opt = _ToyAdam(params, holder)
    for _ in range(steps):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    return params, opt


def _same_tensors(a, b) -> bool:
    return b is not None and len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


@pytest.mark.parametrize("holder", sorted({h for pair in STEP_COUNTS.values() for h in pair}))
def test_step_counts_travel_and_reset_wherever_the_optimizer_keeps_them(holder):
    """The transfer helpers every backend uses, on each declared way of keeping step counts."""
    from fl_megatron.backends.optimizer import forget_state, load_transfer_state_tensors, transfer_state_tensors

    params, sender = _trained_toy(holder, 3)
    sent = transfer_state_tensors(sender, params)
    assert _step_counts([sender]) == ([holder], [3.0])
    counts = [t for t in sent if t.dim() == 0]
    assert len(counts) == (1 if holder == "group int" else len(params)), sent
    assert {t.dtype for t in counts} == {torch.float32 if holder == "state tensor" else torch.int64}
    fresh, receiver = _trained_toy(holder, 0)
    before = [p.detach().clone() for p in fresh]
    load_transfer_state_tensors(receiver, fresh, sent)
    assert _step_counts([receiver]) == ([holder], [3.0])  # (the state was made by a step: count 1, then set)
    assert _same_tensors(sent, transfer_state_tensors(receiver, fresh))
    assert _same_tensors(before, fresh)
    forget_state(receiver)
    assert _step_counts([receiver]) == ([], []) and transfer_state_tensors(receiver, fresh) == []
    for p in fresh:
        p.grad = torch.ones_like(p)
    receiver.step()
    assert _step_counts([receiver]) == ([holder], [1.0])  # the next step is a first step again


class _WholeShardsDistOpt:
    """What `MegatronShardFiles` reads of a megatron DistributedOptimizer, on one rank: fp32
    parameters that are their own main shards, stepped by a `_ToyAdam`."""

    def __init__(self, holder: str, steps: int) -> None:
        params, self.optimizer = _trained_toy(holder, steps)
        self.model_float16_groups, self.shard_fp32_from_float16_groups = [], []
        self.model_fp32_groups, self.shard_fp32_groups = [params], [params]
        self.names = {id(p): f"p{i}" for i, p in enumerate(params)}

    def _get_model_param_range_map(self, param):
        return {"param": SimpleNamespace(start=0, end=param.numel())}


@pytest.mark.parametrize("holder", sorted(set(STEP_COUNTS["megatron"])))
def test_megatron_checkpoint_files_keep_the_step_counts(world, tmp_path, holder):
    from fl_megatron.backends.megatron_state import MegatronShardFiles
    from fl_megatron.backends.optimizer import transfer_state_tensors

    saved = _WholeShardsDistOpt(holder, 3)
    MegatronShardFiles([saved], saved.names).save(tmp_path, world)
    loaded = _WholeShardsDistOpt(holder, 1)
    MegatronShardFiles([loaded], loaded.names).load(tmp_path, world, load_optimizer=True)
    assert _step_counts([loaded.optimizer]) == ([holder], [3.0])
    assert _same_tensors(transfer_state_tensors(saved.optimizer, saved.shard_fp32_groups[0]),
                         transfer_state_tensors(loaded.optimizer, loaded.shard_fp32_groups[0]))


# --- the behaviour test, in 2 processes ---------------------------------------------------------
class _Recorded:
    """A backend whose contract calls record the collectives they issue (on the calling thread):
    `seen[method]` lists (operator, global ranks of its group). Not seen: those DTensor issues
    inside an operator it runs (FSDP2's gradient-norm reduction), bound to the tensor's own mesh."""

    def __init__(self, backend, seen: dict) -> None:
        self.backend, self.seen = backend, seen

    def __getattr__(self, name):
        attr = getattr(self.backend, name)
        if name not in CALLS:
            return attr
        key = name if threading.current_thread() is threading.main_thread() else name + ON_ANOTHER_THREAD
        events = self.seen.setdefault(key, [])

        def call(*args, **kwargs):
            with CollectiveCounter(lambda op, ranks, nbytes: events.append((op, ranks))):
                return attr(*args, **kwargs)
        return call


def _same_on_peers(values, group) -> bool:
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, values, group=group)
    return all(v == everyone[0] for v in everyone)


def _storages(tensors) -> set:
    return {t.untyped_storage().data_ptr() for t in tensors}


@torch.no_grad()
def _perturb(shards, by: float) -> None:
    for s in shards:
        s.add_(by)


def _config(run_dir: str, cache: str, name: str, group_size: int):
    from fl_megatron.config.model import ModelConfig
    from fl_test_utils import tiny_config

    cfg = tiny_config(run_dir, cache, group_size=group_size, optimizer="adamw", lr=1e-3, backend=name)
    if group_size == 2:
        cfg.model, cfg.preset = ModelConfig(**ODD_MODEL), None
        cfg.data.tokenizer_vocab_size = ODD_MODEL["vocab_size"]
    return cfg


def _inner_optimizers(name: str, backend) -> list:
    if name == "fsdp2":
        return [backend.optimizer]
    if name == "deepspeed":
        return [backend.optimizer.optimizer]
    return [opt.optimizer for opt in backend.shards.dist_opts]


def _train_step(backend, ids):
    logits = backend.forward(ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             ids[:, 1:].reshape(-1))
    backend.backward(loss, 1, True)
    norm, lr = backend.optimizer_step(1e-3)
    return logits, norm, lr


@torch.no_grad()
def _distance_from_its_shards(model_cfg, backend, ids) -> float:
    """Largest logit difference, relative to the largest logit, between the backend's forward and
    a plain model holding its shards' values (`full_state_dict`): whether the model computes with
    what the shards hold (megatron-core's own layers differ from ours by rounding only)."""
    from fl_megatron.models import build_model

    reference = build_model(model_cfg, device="cpu")
    reference.load_state_dict(backend.full_state_dict())
    logits = backend.forward(ids).float()
    return ((logits - reference(ids)).abs().max() / logits.abs().max()).item()


def _layout(backend) -> tuple:
    return ([(tuple(s.shape), s.dtype) for s in backend.local_shards()],
            [(n, t.numel(), t.dtype) for n, t in backend.named_shards()])


def _from_another_thread(backend) -> dict:
    """Each "any thread" call made again on a second thread while this one waits: whether it
    returns what this thread got."""
    same = {}
    for method in [m for m, rule in CALLS.items() if rule.any_thread]:
        here, there = getattr(backend, method)(), {}
        worker = threading.Thread(target=lambda m=method, into=there: into.update(value=getattr(backend, m)()))
        worker.start()
        worker.join()
        same[method] = _same_tensors(here, there.get("value"))
    return same


def _contract_job(rank, world, tmp, cache, name, group_size):
    from fl_megatron.backends import make_backend
    from fl_megatron.config.resolved import resolve
    from fl_megatron.federation.contract import FEDERATION_GROUP, SHARD_GROUP
    from fl_megatron.federation.groups import build_process_groups
    from fl_megatron.topology import MESH_DIM_NAMES

    cfg = _config(f"{tmp}/{name}", cache, name, group_size)
    run = resolve(cfg, world, world)
    groups = build_process_groups(run.layout, "cpu", async_checkpoint=True)
    seen = {}

    def build():
        return _Recorded(make_backend(run, groups, torch.device("cpu")), seen)

    backend = build()
    out = {"seen": seen, "scopes": {
        NO_COLLECTIVE: [], JOB: list(range(world)),
        SHARD_GROUP: dist.get_process_group_ranks(groups.mesh.get_group(MESH_DIM_NAMES[2])),
        FEDERATION_GROUP: dist.get_process_group_ranks(groups.federation)}}
    layout = _layout(backend)
    shards = backend.local_shards()
    out["shards_fp32_contiguous_cpu"] = all(s.dtype == torch.float32 and s.is_contiguous() and s.device.type == "cpu"
                                            for s in shards)
    out["shards_same_on_peers"] = _same_on_peers([tuple(s.shape) for s in shards], groups.peer)
    named = backend.named_shards()
    out["named_cover_the_shards"] = (sum(t.numel() for _, t in named) == sum(s.numel() for s in shards)
                                     and _storages(t for _, t in named if t.numel()) <= _storages(shards)
                                     and all(t.dim() == 1 and t.dtype == torch.float32 for _, t in named))
    out["named_same_on_peers"] = _same_on_peers([(n, t.numel()) for n, t in named], groups.peer)
    out["named_sizes"] = [t.numel() for _, t in named]
    out["inner_empty_before_a_step"] = backend.inner_state_shards() == []
    # two steps (a step count of 2: a fresh optimizer's state is made by one step)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(rank))
    logits, norm, lr = _train_step(backend, ids)
    out["logits"] = (tuple(logits.shape), logits.device.type)
    out["step"] = (norm.dim(), norm.device.type, bool(torch.isfinite(norm)), lr)
    _train_step(backend, ids)
    out["step_counts"] = _step_counts(_inner_optimizers(name, backend))
    steps = [t for t in backend.optimizer_transfer_state() if t.dim() == 0]
    out["step_tensors"] = sorted({(str(t.dtype), t.device.type) for t in steps})
    out["from_another_thread"] = _from_another_thread(backend)
    inner = backend.inner_state_shards()
    out["inner_fp32_cpu_same_on_peers"] = (bool(inner) and all(t.dtype == torch.float32 and t.device.type == "cpu"
                                                                for t in inner)
                                           and _same_on_peers([tuple(t.shape) for t in inner], groups.peer))
    inner[0].add_(1.0)  # views: the engine averages them in place
    out["inner_are_views"] = torch.equal(backend.inner_state_shards()[0], inner[0])
    # reset, then the transfer state brings everything back without moving the shards
    sent = [t.clone() for t in backend.optimizer_transfer_state()]
    before = [s.clone() for s in backend.local_shards()]
    backend.reset_optimizer_state()
    out["reset_empties"] = backend.inner_state_shards() == []
    out["reset_forgets_step_counts"] = _step_counts(_inner_optimizers(name, backend)) == ([], [])
    backend.load_optimizer_transfer_state(sent)
    back = backend.optimizer_transfer_state()
    out["transfer_round_trip"] = len(back) == len(sent) and all(torch.equal(a, b) for a, b in zip(back, sent))
    out["transfer_leaves_shards"] = all(torch.equal(a, b) for a, b in zip(before, backend.local_shards()))
    # the refresh: shards changed in place reach the model
    full = {k: v.clone() for k, v in backend.full_state_dict().items()}  # (on one CPU rank: the parameters themselves)
    out["full_fp32_cpu"] = all(v.dtype == torch.float32 and v.device.type == "cpu" for v in full.values())
    out["parameter_sizes"] = [v.numel() for v in full.values()]
    backend.forward(ids)  # an evaluation's forward, without a backward, before the shards change
    _perturb(backend.local_shards(), 0.5)
    backend.refresh_after_sync()
    moved = backend.full_state_dict()
    out["refresh_reaches_model"] = max((moved[k] - full[k] - 0.5).abs().max().item() for k in full)
    out["forward_computes_with_the_shards"] = _distance_from_its_shards(cfg.model, backend, ids)
    count = len(backend.inner_state_shards())
    out["forward_changed"] = not torch.equal(backend.forward(ids), logits)  # (a forward without a backward)
    out["state_survives_a_forward"] = len(backend.inner_state_shards()) == count
    # save, change, load; the asynchronous save's state was copied before it returned
    saved = [s.clone() for s in backend.local_shards()]
    saved_inner = [t.clone() for t in backend.inner_state_shards()]
    saved_transfer = [t.clone() for t in backend.optimizer_transfer_state()]
    group_dir = Path(f"{tmp}/{name}/ckpt-{groups.coords[0]}")
    async_dir = Path(f"{tmp}/{name}/ckpt-async-{groups.coords[0]}")
    backend.save_state(group_dir, write=True)
    future = backend.save_state_async(async_dir, write=True)
    _perturb(backend.local_shards(), 1.0)
    backend.reset_optimizer_state()
    if future is not None:
        future.result()
    backend.load_state(group_dir, load_optimizer=True)
    out["load_restores_shards"] = all(torch.equal(a, b) for a, b in zip(saved, backend.local_shards()))
    loaded_inner = backend.inner_state_shards()
    out["load_restores_inner"] = len(loaded_inner) == len(saved_inner) and all(
        torch.equal(a, b) for a, b in zip(saved_inner, loaded_inner))
    out["load_restores_step_counts"] = _same_tensors(saved_transfer, backend.optimizer_transfer_state())
    # a fresh backend (a healing or resuming group): the same layout; the transfer; the asynchronous save
    fresh = build()
    out["fresh_has_the_same_layout"] = _layout(fresh) == layout
    initial = [s.clone() for s in fresh.local_shards()]
    fresh.load_optimizer_transfer_state(saved_transfer)
    out["transfer_to_fresh"] = _same_tensors(saved_transfer, fresh.optimizer_transfer_state())
    out["transfer_to_fresh_step_counts"] = _step_counts(_inner_optimizers(name, fresh)) == out["step_counts"]
    out["transfer_to_fresh_leaves_shards"] = _same_tensors(initial, fresh.local_shards())
    fresh.reset_optimizer_state()
    fresh.load_state(async_dir, load_optimizer=True)
    out["async_save_loads_shards"] = _same_tensors(saved, fresh.local_shards())
    out["async_save_loads_optimizer"] = _same_tensors(saved_transfer, fresh.optimizer_transfer_state())
    out["fresh_computes_with_the_shards"] = _distance_from_its_shards(cfg.model, fresh, ids)
    return out


def _scope_violations(result: dict) -> list:
    """Calls whose collectives left the group their `CallRule` names, or that ran on another thread
    without being declared for it."""
    bad = []
    for key, events in result["seen"].items():
        method = key.removesuffix(ON_ANOTHER_THREAD)
        rule = CALLS[method]
        if key != method and not rule.any_thread:
            bad.append((key, "called on another thread"))
        allowed = set(result["scopes"][rule.collective])
        bad += [(key, rule.collective, op, ranks) for op, ranks in events
                if (ranks is None and rule.collective != JOB) or (ranks is not None and not set(ranks) <= allowed)]
    return bad


BOOLEANS = ("shards_fp32_contiguous_cpu", "shards_same_on_peers", "named_cover_the_shards", "named_same_on_peers",
            "inner_empty_before_a_step", "inner_fp32_cpu_same_on_peers", "inner_are_views", "reset_empties",
            "reset_forgets_step_counts", "transfer_round_trip", "transfer_leaves_shards", "full_fp32_cpu",
            "forward_changed", "state_survives_a_forward", "load_restores_shards", "load_restores_inner",
            "load_restores_step_counts", "fresh_has_the_same_layout", "transfer_to_fresh",
            "transfer_to_fresh_step_counts", "transfer_to_fresh_leaves_shards", "async_save_loads_shards",
            "async_save_loads_optimizer")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", BACKENDS)
def test_backend_behaves_as_the_contract_says(tmp_path, name, layout):
    _backend_class(name)
    group_size = LAYOUTS[layout]
    vocab = ODD_MODEL["vocab_size"] if group_size == 2 else 512
    results = run_ranks(2, _contract_job, str(tmp_path), str(tmp_path / "cache"), name, group_size, timeout=600)
    for r in results:
        shown = {k: v for k, v in r.items() if k != "seen"}
        for key in BOOLEANS:
            assert r[key] is True, (name, layout, key, shown)
        assert r["logits"] == ((2, 32, vocab), "cpu"), r
        assert r["step"] == (0, "cpu", True, 1e-3), r
        assert r["refresh_reaches_model"] < 1e-6, (name, r["refresh_reaches_model"])
        for key in ("forward_computes_with_the_shards", "fresh_computes_with_the_shards"):
            assert r[key] < 1e-3, (name, layout, key, r[key])
        # the declarations: every call's collectives inside its group, the "any" calls on another thread
        assert not _scope_violations(r), (name, layout, _scope_violations(r))
        assert {key.removesuffix(ON_ANOTHER_THREAD) for key in r["seen"]} == set(CALLS)
        assert r["from_another_thread"] == {m: True for m, rule in CALLS.items() if rule.any_thread}, r
        # step counts where STEP_COUNTS says (on CPU: torch's AdamW, a 0-d fp32 tensor on the CPU), at 2
        assert r["step_counts"] == ([STEP_COUNTS[name][0]], [2.0]), (name, r["step_counts"])
        assert r["step_tensors"] == [("torch.float32", "cpu")], (name, r["step_tensors"])
    if group_size == 2:  # the shards are uneven: no parameter divides by 2
        assert all(size % 2 for size in results[0]["parameter_sizes"]), results[0]["parameter_sizes"]
        if name != "deepspeed":  # (ZeRO-3 pads its flat partitions to equal sizes)
            assert results[0]["named_sizes"] != results[1]["named_sizes"], name
