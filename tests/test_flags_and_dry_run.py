"""Flag/JSON precedence, config round trip, generated --help, and --dry-run at 512 ranks."""

import json

import pytest

from fl_megatron.config.flags import build_parser, config_to_json, dump_flags, load_json, parse_args
from fl_megatron.costs import sync_comm
from fl_megatron.models import count_parameters, get_preset
from fl_megatron.pretrain import main
from fl_megatron.topology import make_layout


def test_precedence_defaults_preset_json_flags(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": {"preset": "llama3.1-8b", "num_layers": 2},
                                "training": {"lr": 1e-3, "train_iters": 7},
                                "federation": {"group_size": 4, "sync_interval": 16}}))
    cfg, _ = parse_args(["--config", str(path), "--lr", "2e-3", "--fl-sync-interval", "8"])
    assert cfg.preset == "llama3.1-8b"
    assert cfg.model.hidden_size == 4096          # from the preset
    assert cfg.model.num_layers == 2              # JSON overrides the preset
    assert cfg.training.lr == 2e-3                # flag overrides JSON
    assert cfg.training.train_iters == 7          # JSON overrides the default
    assert cfg.federation.sync_interval == 8 and cfg.federation.group_size == 4
    assert cfg.training.micro_batch_size == 4     # default


def test_resolved_config_round_trips(tmp_path):
    cfg, _ = parse_args(["--model", "gpt2-small", "--fl-num-groups", "4", "--bf16", "--no-fl-replica-split"])
    path = tmp_path / "config.json"
    path.write_text(config_to_json(cfg))
    again, _ = parse_args(["--config", str(path)])
    assert again == cfg
    flags_again, _ = parse_args(dump_flags(cfg))
    assert flags_again == cfg
    assert load_json(str(path))["model"]["preset"] == "gpt2-small"


def test_help_documents_every_flag():
    text = build_parser().format_help()
    for flag in ["--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                 "--num-query-groups", "--seq-length", "--micro-batch-size", "--global-batch-size",
                 "--gradient-accumulation-steps", "--lr", "--min-lr", "--lr-warmup-iters",
                 "--lr-decay-style", "--train-iters", "--weight-decay", "--clip-grad", "--optimizer",
                 "--bf16", "--seed", "--eval-interval", "--eval-iters", "--log-interval", "--run-dir",
                 "--backend", "--ranks-per-node", "--fl-group-size", "--fl-num-groups",
                 "--fl-sync-interval", "--fl-hsdp-shard-size", "--config", "--dry-run", "--world-size"]:
        assert flag in text, flag


PUBLISHED = {
    "FSDP": [],
    "HSDP": ["--fl-hsdp-shard-size", "4"],
    "FL+FSDP": ["--fl-group-size", "4"],
    "FL+HSDP": ["--fl-group-size", "32", "--fl-hsdp-shard-size", "4"],
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_dry_run_of_the_published_layouts(name, capsys, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    argv = ["--model", "llama3.1-8b", "--world-size", "512", "--ranks-per-node", "4", "--bf16",
            "--micro-batch-size", "2", "--seq-length", "8192", "--fl-sync-interval", "8",
            "--tokenizer-vocab-size", "4096", *PUBLISHED[name], "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "8,030,261,248 parameters" in out
    assert "512 ranks on 128 nodes x 4" in out
    flag_values = dict(zip(argv, argv[1:]))
    layout = make_layout(512, 4, group_size=int(flag_values.get("--fl-group-size", 512)),
                         shard_size=int(flag_values.get("--fl-hsdp-shard-size", 0)) or None)
    if layout.is_federated:
        # bytes one rank sends per sync, by hand: its fp32 shard (params / S elements) all-reduced
        # over the F peers as a ring (2 (F-1)/F), with FL+HSDP's replica split 1/P of it, then
        # the replicas all-gather their slices inside the group ((P-1)/P of the shard)
        f, p, s = layout.num_groups, layout.replicas, layout.shard_size
        shard = 4 * 8_030_261_248 / s
        expected = {"all_reduce_peers": 2 * (f - 1) / f * shard / p}
        if p > 1:
            expected["all_gather_replica_slices"] = (p - 1) / p * shard
        printed = {line.split()[0]: float(line.split()[-2]) for line in out.splitlines()
                   if line.strip().startswith(("all_reduce_peers", "all_gather_replica"))}
        assert printed.keys() == expected.keys(), out
        for name, value in expected.items():
            assert abs(printed[name] - value / 2**30) <= 0.05, (name, printed[name], value / 2**30)
        if layout.group_size <= 4:  # a group inside one node: the sync is the only inter-node traffic
            amortised = float(out.split("sync amortised over H=8:")[1].split("inter-node")[1].split()[0])
            assert abs(amortised - sum(expected.values()) / 8 / 2**30) <= 0.05
        assert sync_comm(layout, count_parameters(get_preset("llama3.1-8b"))).total_bytes > 0
    else:
        assert "per federation sync:\n    nothing moves" in out


def test_flags_doc_is_up_to_date():
    from pathlib import Path

    from tool_loader import tool_module

    root = Path(__file__).resolve().parent.parent
    module = tool_module("gen_flags_doc")
    assert (root / "docs" / "flags.md").read_text() == module.render(), \
        "docs/flags.md is stale: run python tools/gen_flags_doc.py"


def test_dry_run_warns_when_the_memory_estimate_exceeds_the_device(capsys, monkeypatch):
    """The README's 8B FL+HSDP layout: about 117 GiB per rank without activation recomputation
    (a warning naming the fix), within 80 GiB with it; --device-memory-gib moves the limit."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    argv = ["--model", "llama3.1-8b", "--world-size", "512", "--ranks-per-node", "4", "--fl-group-size", "32",
            "--fl-hsdp-shard-size", "4", "--bf16", "--micro-batch-size", "2", "--seq-length", "8192", "--dry-run"]

    def warning(*extra):
        assert main([*argv, *extra]) == 0
        lines = [line for line in capsys.readouterr().out.splitlines() if "WARNING: the estimate" in line]
        return lines[0] if lines else None

    assert "exceeds the 80 GiB of one device" in warning() and "Try --recompute-activations" in warning()
    assert warning("--recompute-activations") is None
    assert warning("--device-memory-gib", "141") is None
    assert "exceeds the 40 GiB" in warning("--recompute-activations", "--device-memory-gib", "40")


def test_dry_run_says_what_the_sparse_syncs_memory_holds(capsys, monkeypatch):
    """The README's 8B FL+HSDP layout with the sparse sync: the sync state is the anchor and the
    error-feedback residual, one fp32 shard each (8.03e9 x 4 bytes / 4 ranks of a shard group);
    the top-k selection adds 2.5 fp32 copies of a 32 MiB bucket to the two packed ones."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    argv = ["--model", "llama3.1-8b", "--world-size", "512", "--ranks-per-node", "4", "--fl-group-size", "32",
            "--fl-hsdp-shard-size", "4", "--bf16", "--micro-batch-size", "2", "--seq-length", "8192",
            "--recompute-activations", "--fl-sync-dtype", "int2", "--fl-topk-density", "0.0156",
            "--fl-error-feedback", "--dry-run"]
    assert main(argv) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()
             if line.strip().startswith(("outer_state", "sync_buffers"))}
    shard_gib = 4 * 8_030_261_248 / 4 / 2**30
    assert float(lines["outer_state"].split()[1]) == pytest.approx(2 * shard_gib, abs=0.05)
    assert "(fp32 shards: anchor 1, error-feedback residual 1)" in lines["outer_state"]
    assert lines["sync_buffers"].split()[1:3] == [f"{(2 + 2.5) * 32:.1f}", "MiB"]
    assert "2.5 fp32 copies of one for the top-k selection" in lines["sync_buffers"]
