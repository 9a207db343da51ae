"""The FSDP2 backend on a 1-rank group: flat shard storage and activation recomputation."""

import pytest
import torch

from fl_megatron.backends import FSDP2Backend, SeededValues
from fl_megatron.config import RunConfig, resolve
from fl_megatron.federation import build_process_groups
from fl_megatron.models import build_model, get_preset, init_model_


def _tiny():
    cfg = get_preset("llama-tiny")
    cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size = 2, 64, 96, 128
    cfg.num_attention_heads, cfg.num_query_groups = 4, 2
    return cfg


def _backend(cfg, seed: int, recompute: bool = False) -> FSDP2Backend:
    run = RunConfig(model=cfg)
    run.training.recompute_activations = recompute
    run.data.mock_data = True
    resolved = resolve(run, 1)
    groups = build_process_groups(resolved.layout, "cpu")
    return FSDP2Backend(resolved, groups, torch.device("cpu"), SeededValues(cfg, seed))


def _attention_calls(backend, tokens) -> int:
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1))
             for name, m in backend.model.named_modules() if name.endswith("attn")]
    logits = backend.forward(tokens)
    logits.float().sum().backward()
    for h in hooks:
        h.remove()
    return len(calls)


def test_recompute_reruns_blocks_in_backward_and_keeps_weights(world):
    cfg = _tiny()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = _backend(cfg, seed=3)
    recompute = _backend(cfg, seed=3, recompute=True)
    assert _attention_calls(plain, tokens) == cfg.num_layers
    assert _attention_calls(recompute, tokens) == 2 * cfg.num_layers
    # same weights (the wrapper does not change the initialisation) and the same gradients
    for (_, a), (_, b) in zip(plain.model.named_parameters(), recompute.model.named_parameters()):
        assert torch.equal(a.to_local(), b.to_local())
        assert torch.allclose(a.grad.to_local(), b.grad.to_local(), atol=1e-6)


def test_sharded_model_matches_the_unsharded_reference_and_shards_are_flat(world):
    cfg = _tiny()
    backend = _backend(cfg, seed=5)
    reference = init_model_(build_model(cfg, "cpu"), cfg, seed=5)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(backend.forward(tokens), reference(tokens), rtol=0, atol=1e-6)
    # one rank: every parameter splits evenly, so all shards are one flat tensor
    shards = backend.local_shards()
    assert len(shards) == 1
    assert shards[0].numel() == sum(p.numel() for p in reference.parameters())


def test_clipping_scales_the_sharded_gradients_to_the_limit(world):
    """Regression: the norm was computed but the DTensor gradients were left unscaled."""
    cfg = _tiny()
    backend = _backend(cfg, seed=5)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    backend.forward(tokens).float().pow(2).mean().backward()
    before = torch.cat([p.grad.to_local().reshape(-1) for p in backend.model.parameters()])
    norm = backend.clip_grad_norm(0.01)
    after = torch.cat([p.grad.to_local().reshape(-1) for p in backend.model.parameters()])
    assert float(norm) == pytest.approx(float(before.norm()), rel=1e-5) and float(norm) > 0.01
    assert float(after.norm()) == pytest.approx(0.01, rel=1e-4)
    torch.testing.assert_close(after, before * (0.01 / (float(norm) + 1e-6)), rtol=1e-5, atol=0)
