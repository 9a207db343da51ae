"""The megatron-core backend (GPTModel, DDP, DistributedOptimizer) with several CPU ranks (gloo).

References: with plain SGD and H = 1, FL over 2 groups must equal megatron-core over all 4 ranks;
from the same initial weights the megatron and FSDP2 backends take the same AdamW steps in fp32
(Llama with GQA, Llama 3.1 RoPE scaling and untied output; GPT with learned positions and tied
embeddings; FL+FSDP and FL+HSDP); a sync leaves the fp32 main shards and the bf16 model
parameters bit-identical across groups. A checkpoint exported to Hugging Face gives, in
`transformers`, the logits megatron-core itself computed.
"""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from cli_utils import SGD, run_pretrain  # noqa: E402
from fl_megatron.checkpoint.reader import CheckpointReader  # noqa: E402
from fl_megatron.local_ranks import run_ranks  # noqa: E402
from fl_test_utils import make_trainer, max_diff, peers_identical, tiny_config, train_and_gather  # noqa: E402

pytestmark = pytest.mark.timeout(900)
TOOL = Path(__file__).resolve().parents[1] / "tools" / "convert_checkpoint_to_hf.py"


def _records(run_dir: str) -> list[dict]:
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r]


def _losses(run_dir: str) -> list[float]:
    return [r["loss"] for r in _records(run_dir)]


def _adamw(cfg, steps=10, arch="llama"):
    t = cfg.training
    t.optimizer, t.lr, t.train_iters, t.weight_decay, t.clip_grad = "adamw", 3e-3, steps, 0.1, 0.5
    t.lr_decay_style, t.lr_warmup_iters = "cosine", 2
    if arch == "gpt":
        m = cfg.model
        m.arch, m.num_query_groups, m.tie_embeddings, m.max_position_embeddings = "gpt", None, True, 64
    else:
        cfg.model.rope_scaling_factor = 8.0  # Llama 3.1 scaling (low/high/original as megatron fixes them)
    return cfg


def _relative_loss_gap(a: str, b: str) -> float:
    la, lb = _losses(a), _losses(b)
    assert len(la) == len(lb) > 0
    return max(abs(x - y) / abs(y) for x, y in zip(la, lb))


def _exactness_job(rank, world, tmp, cache):
    out = {}
    mg = lambda name, **kw: tiny_config(f"{tmp}/{name}", cache, backend="megatron", **kw)  # noqa: E731
    fs = lambda name, **kw: tiny_config(f"{tmp}/{name}", cache, **kw)  # noqa: E731
    # H = 1 plain SGD: FL over 2 groups of 2 against megatron-core over all 4 ranks, and FSDP2
    _, all4 = train_and_gather(mg("all4", group_size=4))
    _, fl = train_and_gather(mg("fl", group_size=2, sync_interval=1))
    _, fsdp2 = train_and_gather(fs("fsdp2", group_size=4))
    out["fl_vs_all4"], out["all4_vs_fsdp2"] = max_diff(fl, all4), max_diff(all4, fsdp2)
    # without clipping megatron-core reports no norm: ours measures it, as FSDP2 does
    out["grad_norms"] = [[r["grad_norm"] for r in _records(f"{tmp}/{name}")] for name in ("all4", "fsdp2")]
    # 10 AdamW steps, clipping, cosine schedule, FL+FSDP with H = 4: megatron against FSDP2
    for arch in ("llama", "gpt"):
        for layout, kw in (("fsdp", dict(group_size=2)), ("hsdp", dict(group_size=2, shard_size=1))):
            name = f"{arch}-{layout}"
            if arch == "gpt" and layout == "hsdp":
                continue
            _, a = train_and_gather(_adamw(mg(f"mg-{name}", sync_interval=4, **kw), arch=arch))
            _, b = train_and_gather(_adamw(fs(f"fs-{name}", sync_interval=4, **kw), arch=arch))
            out[f"loss_gap_{name}"] = _relative_loss_gap(f"{tmp}/mg-{name}", f"{tmp}/fs-{name}")
            out[f"param_gap_{name}"] = max_diff(a, b)
    # bf16 AdamW with bf16 gradients, H = 2: main shards and bf16 model parameters identical
    # across groups after step 2 only; the model parameters are the main shards rounded to bf16
    cfg = _adamw(mg("bf16", group_size=2, sync_interval=2, bf16=True), steps=4)
    cfg.training.grad_reduce_dtype = "bf16"  # Megatron-LM's default: a bf16 gradient buffer
    trainer = make_trainer(cfg)
    out["grad_buffer_dtypes"] = sorted({str(b.grad_dtype) for b in trainer.backend.ddp.buffers})
    params = [p.data.reshape(-1) for p in trainer.backend.gpt.parameters()]
    identical = []
    for step in range(3):
        trainer.step(step)
        identical.append((peers_identical(trainer), peers_identical(trainer, params)))
    out["identical_after_steps_1_2_3"] = identical
    out["param_dtypes"] = sorted({str(p.dtype) for p in params})
    trainer.engine.sync(step=3)
    rounded = True
    for param, main, start, stop in trainer.backend._main_pairs():
        rounded &= torch.equal(param.data.reshape(-1)[start:stop], main.to(param.dtype))
    out["model_is_rounded_main"] = rounded
    # the norm is made on the backend's device (it is stacked with the loss there): a fake device shows it
    real, trainer.backend.device = trainer.backend.device, torch.device("meta")
    out["norm_device"] = str(trainer.backend.optimizer_step(1e-3)[0].device)
    trainer.backend.device = real
    trainer.close()
    return out


def test_megatron_backend_matches_megatron_core_over_all_ranks_and_fsdp2(tmp_path):
    results = run_ranks(4, _exactness_job, str(tmp_path), str(tmp_path / "cache"), timeout=850)
    for rank, r in enumerate(results):
        assert r["fl_vs_all4"] <= 1e-5, (rank, r)
        assert r["all4_vs_fsdp2"] <= 1e-5, (rank, r)
        megatron, fsdp2 = r["grad_norms"]
        assert len(megatron) == len(fsdp2) > 0 and min(megatron) > 0, r["grad_norms"]
        assert max(abs(a - b) / b for a, b in zip(megatron, fsdp2)) <= 1e-4, r["grad_norms"]
        for name in ("llama-fsdp", "llama-hsdp", "gpt-fsdp"):
            assert r[f"loss_gap_{name}"] <= 1e-4, (rank, name, r)
            assert r[f"param_gap_{name}"] <= 1e-4, (rank, name, r)
        assert r["identical_after_steps_1_2_3"] == [(False, False), (True, True), (False, False)], r
        assert r["param_dtypes"] == ["torch.bfloat16"] and r["model_is_rounded_main"]
        assert r["grad_buffer_dtypes"] == ["torch.bfloat16"]
        assert r["norm_device"] == "meta", r["norm_device"]


def _export_job(rank, world, tmp, cache):
    """Train 2 groups of 2 with AdamW (H = 4, saved after step 3: the groups differ); return each
    group's logits as megatron-core computes them on fixed tokens, and whether --init-from-hf of
    the export restores the group's weights exactly."""
    out = {}
    for arch in ("llama", "gpt"):
        cfg = _adamw(tiny_config(f"{tmp}/{arch}", cache, backend="megatron", group_size=2, sync_interval=4),
                     steps=6, arch=arch)
        cfg.checkpoint.save, cfg.checkpoint.exit_interval = f"{tmp}/{arch}-ckpt", 3
        trainer = make_trainer(cfg)
        trainer.train()
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            out[arch] = trainer.backend.forward(tokens).float().tolist()  # by value through the queue
        trainer.close()
    return out


def test_hf_export_of_a_megatron_checkpoint_gives_megatrons_logits_in_transformers(tmp_path):
    """The fused q/k/v (grouped per key/value head) and gate/up tensors are split correctly: the
    exported group's logits in `transformers` are megatron-core's own (Llama with GQA, GPT tied);
    and the export, read back with --init-from-hf, fills megatron's fused tensors exactly."""
    import subprocess
    import sys

    transformers = pytest.importorskip("transformers")
    results = run_ranks(4, _export_job, str(tmp_path), str(tmp_path / "cache"), timeout=600)
    for arch in ("llama", "gpt"):
        assert results[0][arch] != results[2][arch]  # the groups differ at step 3
        for group, rank in ((0, 0), (1, 2)):
            hf = tmp_path / f"{arch}-hf{group}"
            proc = subprocess.run([sys.executable, str(TOOL), "--checkpoint", str(tmp_path / f"{arch}-ckpt"),
                                   "--output", str(hf), "--dtype", "fp32", "--group", str(group)],
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr
            model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
            tokens = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                logits = model(tokens).logits
            assert (logits - torch.tensor(results[rank][arch])).abs().max().item() <= 1e-4, (arch, group)
    # --init-from-hf on the megatron backend: a run started from group 1's export (SGD at lr 0 keeps
    # the weights, on 1 group of 4 instead of 2 of 2) holds exactly that group's weights
    run_pretrain(4, tmp_path / "init", tmp_path / "cache", "--backend", "megatron", "--init-from-hf",
                 str(tmp_path / "llama-hf1"), "--rope-scaling-factor", "8", *SGD, "--lr", "0", "--train-iters", "1",
                 "--eval-iters", "0", "--save", str(tmp_path / "init-ckpt"))
    started, source = CheckpointReader(tmp_path / "init-ckpt"), CheckpointReader(tmp_path / "llama-ckpt")
    assert all(torch.equal(started.tensor(n, 0), source.tensor(n, 1)) for n in source.names)


def test_missing_megatron_and_an_impostor_apex_are_named_before_anything_starts(tmp_path, monkeypatch):
    """PyPI's 'apex' is an unrelated package that megatron-core would take for NVIDIA Apex."""
    from fl_megatron.backends import check_backend_package

    check_backend_package("megatron")  # installed here, and no apex at all: fine
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("# the web framework of the same name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="not NVIDIA Apex .* pip uninstall apex"):
        check_backend_package("megatron")
    check_backend_package("fsdp2")  # only megatron-core looks for apex
    import fl_megatron.backends as backends

    monkeypatch.setitem(backends._PACKAGES, "megatron", ("megatron_absent.core", "megatron"))
    with pytest.raises(ValueError, match=r"needs megatron_absent.core, which is not installed: "
                                         r"pip install -e \"\.\[megatron\]\""):
        check_backend_package("megatron")


def test_softmax_fusion_only_where_megatron_lms_kernels_are_installed(monkeypatch):
    """On CUDA, megatron-core's bf16 attention imports Megatron-LM's compiled softmax kernels at its
    first forward when masked_softmax_fusion is on; the megatron-core wheel lacks them, so the
    fusion is asked for only when they can be imported (and never on CPU)."""
    import importlib.util

    import torch

    from fl_megatron.backends import megatron_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert importlib.util.find_spec("scaled_masked_softmax_cuda") is None  # the wheel, as installed here
    assert megatron_model.softmax_fusion() is False
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name.endswith("softmax_cuda") else real(name, *a))
    assert megatron_model.softmax_fusion() is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert megatron_model.softmax_fusion() is False
