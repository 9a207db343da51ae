"""Bad layouts, flags and config files fail before any process group exists, naming the problem."""

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from fl_megatron.pretrain import main


@pytest.fixture
def launched(monkeypatch):
    """Pretend torchrun started 8 ranks (4 per node) and this is rank 0."""
    for key, value in dict(RANK="0", WORLD_SIZE="8", LOCAL_RANK="0", LOCAL_WORLD_SIZE="4").items():
        monkeypatch.setenv(key, value)


def _fails(capsys, argv, *needles):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in: {err}"
    assert not dist.is_initialized()
    return err


BASE = ["--model", "llama-tiny"]


@pytest.mark.parametrize("flags,needles", [
    (["--fl-group-size", "3"], ["group_size=3", "world_size=8", "valid group sizes"]),
    (["--fl-group-size", "8", "--fl-hsdp-shard-size", "3"], ["shard_size=3", "group_size=8"]),
    (["--fl-group-size", "2", "--fl-num-groups", "2"], ["num_groups=2", "group_size=2"]),
    (["--fl-num-groups", "3"], ["num_groups=3"]),
    (["--fl-group-size", "8", "--fl-hsdp-shard-size", "8", "--ranks-per-node", "3"], ["ranks_per_node=3"]),
    (["--global-batch-size", "20"], ["global_batch_size=20", "micro_batch_size (4) x world size (8) = 32"]),
    (["--global-batch-size", "64", "--gradient-accumulation-steps", "3"], ["gradient_accumulation_steps=3"]),
    (["--seq-length", "4096"], ["seq_length=4096", "max_position_embeddings=1024"]),
    (["--vocab-size", "1000"], ["vocab_size=1000", "tokenizer_vocab_size=4096"]),
    (["--num-query-groups", "3"], ["num_query_groups=3", "num_attention_heads=4"]),
    (["--hidden-size", "250"], ["hidden_size=250"]),
    (["--lr", "-1"], ["lr=-1"]),
    (["--lr", "1e-4", "--min-lr", "1e-3"], ["min_lr=0.001", "lr=0.0001"]),
    (["--lr-warmup-iters", "500", "--train-iters", "100"], ["lr_warmup_iters=500"]),
    (["--optimizer", "lion"], ["optimizer='lion'"]),
    (["--lr-decay-style", "step"], ["lr_decay_style='step'"]),
    (["--fl-sync-interval", "-1"], ["sync_interval=-1"]),
    (["--clip-grad", "-1"], ["clip_grad=-1"]),
    (["--grad-reduce-dtype", "bf16"], ["grad_reduce_dtype='bf16' needs --bf16"]),
    (["--fl-outer-optimizer", "lamb"], ["outer_optimizer='lamb' is not one of fedavg, nesterov, adam"]),
    (["--fl-error-feedback"], ["error_feedback needs a compressed sync"]),
    (["--fl-sync-dtype", "fp8"], ["sync_dtype='fp8' is not one of fp32, bf16, int8, int4"]),
    (["--fl-sick-loss-ratio", "0.5"], ["sick_loss_ratio=0.5 must be above 1"]),
    (["--fl-outer-momentum", "1"], ["outer_momentum=1.0 must lie in [0, 1)"]),
    (["--grad-reduce-dtype", "fp16", "--bf16"], ["grad_reduce_dtype='fp16' is not one of fp32, bf16"]),
    (["--backend", "deepspeed", "--bf16", "--grad-reduce-dtype", "bf16"], ["communication_data_type"]),
    (["--backend", "colossal"], ["backend='colossal'", "fsdp2, deepspeed, megatron"]),
    (["--backend", "megatron", "--rope-scaling-factor", "8", "--rope-original-max-position", "4096"],
     ["--backend megatron cannot build this model", "rope_original_max_position=4096 (megatron-core fixes it at 8192)"]),
    (["--world-size", "16"], ["--world-size 16", "WORLD_SIZE=8"]),
    (["--fl-bucket-mb", "0"], ["bucket_mb=0"]),
    (["--ranks-per-node", "8"], ["--ranks-per-node 8 does not match the 4 processes per node"]),
    (["--micro-batch-size", "0"], ["micro_batch_size=0"]),
    (["--num-layers", "1000000000"], ["num_layers=1000000000 is above 4,096"]),  # found by the fuzzer: a hang
])
def test_invalid_flags_fail_before_process_groups(launched, capsys, flags, needles):
    _fails(capsys, BASE + flags, *needles)


def test_unknown_preset_lists_the_valid_ones(launched, capsys):
    _fails(capsys, ["--model", "llama-huge"], "llama-huge", "llama3.1-8b")


def test_bad_types_on_the_command_line(launched, capsys):
    _fails(capsys, BASE + ["--fl-group-size", "two"], "--fl-group-size", "two")


@pytest.mark.parametrize("content,needles", [
    ({"federation": {"group_size": 2, "sync_every": 4}}, ["sync_every", "valid keys", "sync_interval"]),
    ({"federaton": {}}, ["unknown section 'federaton' (did you mean 'federation'?)", "valid sections"]),
    ({"training": {"learning_rate": 0.1}}, ["training: unknown key 'learning_rate'", "valid keys are"]),
    ({"training": {"train_iter": 10}}, ["unknown key 'train_iter' (did you mean 'train_iters'?)"]),
    ({"training": {"lr": "fast"}}, ["training.lr", "expected float", "fast"]),
    ({"training": {"train_iters": 2.5}}, ["training.train_iters", "expected int"]),
    ({"training": {"seq_length": None}}, ["training.seq_length: expected int, got null"]),  # found by the fuzzer
    ({"model": {"preset": "nope"}}, ["nope"]),
    ([1, 2], ["top level must be an object"]),
])
def test_bad_config_files(launched, capsys, tmp_path, content, needles):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(content))
    _fails(capsys, ["--config", str(path)], str(path) if "nope" not in needles else "nope", *needles)


def test_malformed_json_names_file_and_line(launched, capsys, tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "training": {"lr": 1e-3,}\n}\n')
    _fails(capsys, ["--config", str(path)], str(path), "line 2")


def test_missing_config_file(launched, capsys, tmp_path):
    _fails(capsys, ["--config", str(tmp_path / "absent.json")], "absent.json", "does not exist")


def _ds_json(tmp_path, **overrides) -> str:
    """A valid DeepSpeed config for BASE on 8 ranks, with top-level keys replaced."""
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 16,
          "bf16": {"enabled": True}, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
          "federation": {"group_size": 4, "sync_interval": 4}}
    ds.update(overrides)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return str(path)


@pytest.mark.parametrize("overrides,flags,needles", [
    ({}, ["--micro-batch-size", "2"], ["contradicts the command line", "--micro-batch-size 2 vs 4"]),
    ({}, ["--lr", "0.5"], ["--lr 0.5 vs 0.001"]),
    ({}, ["--no-bf16"], ["--bf16 False vs True"]),
    ({"train_batch_size": 32}, [], ["train_batch_size=32", "micro-batch 4 x accumulation 1 x group size 4 = 16"]),
    ({"zero_optimization": {"stage": 2}}, [], ["zero_optimization.stage is 2", "ZeRO stage 3"]),
    ({"fp16": {"enabled": True}}, [], ["fp16 and bf16 are both enabled"]),
    ({"federation": {"group_size": 4, "sync_intervall": 4}}, [],
     ["federation block: unknown key 'sync_intervall' (did you mean 'sync_interval'?)", "valid keys are"]),
    ({"zero_optimisation": {"stage": 3}}, [],  # DeepSpeed itself would ignore it and run without ZeRO
     ["unknown top-level key 'zero_optimisation' (did you mean 'zero_optimization'?)"]),
    ({"gradient_clippin": 1.0, "wandbb": {}}, [],
     ["unknown top-level keys 'gradient_clippin' (did you mean 'gradient_clipping'?), 'wandbb' (did you mean 'wandb'?)"]),
    ({"federation": {"group_size": 3}}, [], ["group_size=3", "world_size=8", "valid group sizes"]),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 4}}, [], ["mics_shard_size", "hsdp_shard_size"]),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}, [], ["zero_hpz_partition_size=3"]),
    ({"optimizer": {"type": "Lamb", "params": {}}}, [], ["optimizer type 'Lamb' is not supported"]),
    ({"scheduler": {"type": "WarmupLR", "params": {}}}, ["--lr-warmup-iters", "3"],
     ["'scheduler' block", "--lr-warmup-iters"]),
    ({}, ["--backend", "fsdp2"], ["--backend fsdp2 contradicts the DeepSpeed config"]),
])
def test_deepspeed_config_errors_fail_before_process_groups(launched, capsys, tmp_path, overrides, flags, needles):
    _fails(capsys, BASE + ["--deepspeed_config", _ds_json(tmp_path, **overrides)] + flags, *needles)


def _without_accumulation(tmp_path, batch: int) -> str:
    path = _ds_json(tmp_path, train_batch_size=batch, federation={"group_size": 8, "sync_interval": 4})
    ds = json.loads(Path(path).read_text())
    del ds["gradient_accumulation_steps"]
    Path(path).write_text(json.dumps(ds))
    return path


def test_deepspeed_derives_a_missing_accumulation_from_the_train_batch_as_deepspeed_does(tmp_path):
    from fl_megatron.config.deepspeed_json import engine_config
    from fl_megatron.config.flags import parse_args
    from fl_megatron.config.resolved import resolve

    cfg, _ = parse_args(BASE + ["--deepspeed_config", _without_accumulation(tmp_path, 64)])
    assert cfg.training.gradient_accumulation_steps is None
    run = resolve(cfg, 16, 4)  # two federation groups of 8: DeepSpeed's world is one group
    assert run.layout.group_size == 8 and run.accumulation == 64 // (4 * 8)
    engine = engine_config(cfg.deepspeed, cfg.training, data_parallel_size=8, steps=10, accumulation=run.accumulation)
    assert (engine["train_batch_size"], engine["gradient_accumulation_steps"]) == (64, 2)
    with pytest.raises(ValueError, match=r"train_batch_size=48 is not a multiple of micro-batch 4 x group size "
                                         r"8 = 32.*valid values are 32, 64, 96"):
        resolve(parse_args(BASE + ["--deepspeed_config", _without_accumulation(tmp_path, 48)])[0], 16, 4)


def test_deepspeed_config_sets_the_run_and_fl_flags_override_its_federation_block(tmp_path):
    from fl_megatron.config.flags import parse_args

    path = _ds_json(tmp_path, gradient_accumulation_steps=2, train_batch_size=32)
    cfg, _ = parse_args(BASE + ["--deepspeed_config", path, "--fl-sync-interval", "2", "--lr", "0.001"])
    assert cfg.parallel.backend == "deepspeed"
    t = cfg.training
    assert (t.micro_batch_size, t.gradient_accumulation_steps, t.bf16, t.clip_grad) == (4, 2, True, 1.0)
    assert (t.optimizer, t.lr, t.adam_beta2, t.weight_decay) == ("adamw", 1e-3, 0.95, 0.1)
    assert (cfg.federation.group_size, cfg.federation.sync_interval) == (4, 2)
    assert "federation" not in cfg.deepspeed and cfg.deepspeed["zero_optimization"] == {"stage": 3}
    assert cfg.validate(8, 4).num_groups == 2
    # what DeepSpeed gets: its data-parallel world is the ZeRO-3 group (here the federation group)
    from fl_megatron.config.deepspeed_json import engine_config

    engine = engine_config(cfg.deepspeed, t, data_parallel_size=4, steps=10, accumulation=2)
    assert engine["train_batch_size"] == 4 * 2 * 4 and engine["optimizer"]["type"] == "AdamW"
    # the run's config.json is self-contained and loads back to the same settings
    from fl_megatron.config.flags import config_from_sources, config_to_json

    again = config_from_sources(json.loads(config_to_json(cfg)), {})
    assert again.to_dict() == cfg.to_dict()


def test_a_config_file_that_contradicts_the_deepspeed_config_is_an_error(launched, capsys, tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"training": {"micro_batch_size": 8}}))
    _fails(capsys, BASE + ["--config", str(run), "--deepspeed_config", _ds_json(tmp_path)],
           "contradicts the command line or --config", "--micro-batch-size 8 vs 4")


def _indexed(tmp_path, name="data", docs=40):
    import numpy as np

    from fl_megatron.data.indexed import IndexedDatasetWriter

    prefix = tmp_path / name
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(docs):
            w.add_document(np.arange(300) % 500)
    return str(prefix)


def test_data_errors_fail_before_process_groups(launched, capsys, tmp_path):
    good = _indexed(tmp_path)
    _fails(capsys, BASE + ["--data-path", str(tmp_path / "nothing")], "nothing.idx")
    _fails(capsys, BASE + ["--data-path", "0.3", good, "x", good], "weight 'x'")
    _fails(capsys, BASE + ["--data-path", good, "--split", "100,0,0"], "leaves the valid split", "data")
    _fails(capsys, BASE + ["--data-path", good, "--mock-data"], "data_path and mock_data are exclusive")
    _fails(capsys, BASE + ["--data-path", good, "--split", "a,b"], "split 'a,b'")
    broken = _indexed(tmp_path, "broken")
    with open(broken + ".bin", "r+b") as f:
        f.truncate(100)
    _fails(capsys, BASE + ["--data-path", broken], "broken.bin", "truncated")


def test_the_torch_floor_is_one_version_everywhere_and_refused_below(monkeypatch, capsys):
    """setup.py, the README and the start-up check name the same floor; an older torch is
    refused before anything starts, with the fix named."""
    from pathlib import Path

    import torch

    from fl_megatron.pretrain import main
    from fl_megatron.torch_version import TORCH_FLOOR, torch_version_problem

    root = Path(__file__).resolve().parents[1]
    floor = ".".join(map(str, TORCH_FLOOR))
    assert f'"torch>={floor}"' in (root / "setup.py").read_text()
    assert f"torch >= {floor}" in (root / "README.md").read_text()
    # the floor is what make test-torch-floor installs and tests (CI runs it)
    assert f"TORCH_FLOOR_SPEC ?= torch=={floor}.0" in (root / "Makefile").read_text()
    assert "make test-torch-floor" in (root / ".ci" / "run").read_text()
    assert torch_version_problem(torch.__version__) is None
    assert torch_version_problem(f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1] + 1}.0") is None
    assert torch_version_problem("3.0.0") is None
    old = f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1] - 1}.0+cu124"
    assert f"needs torch >= {floor}" in torch_version_problem(old) and old in torch_version_problem(old)
    monkeypatch.setattr(torch, "__version__", "2.6.0+cu124")
    assert main(["--model", "llama-tiny", "--world-size", "4", "--dry-run"]) == 2
    assert f"needs torch >= {floor} (the oldest its tests run on), found 2.6.0+cu124" in capsys.readouterr().err


def test_every_non_finite_number_is_refused_naming_the_field(tmp_path, capsys, monkeypatch):
    """nan, inf and -inf in every float field, as a flag and in a --config file, and in the
    DeepSpeed JSON: the dry run exits 2 naming section.field (before, --lr nan passed)."""
    import dataclasses
    import json
    import typing

    from fl_megatron.config.flags import flag_name
    from fl_megatron.config.run import SECTIONS, RunConfig
    from fl_megatron.pretrain import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    base = ["--model", "llama-tiny", "--world-size", "4", "--dry-run"]
    floats = [(section, f.name) for section in SECTIONS for f in dataclasses.fields(getattr(RunConfig(), section))
              if float in (typing.get_args(typing.get_type_hints(type(getattr(RunConfig(), section)))[f.name]) or
                           (typing.get_type_hints(type(getattr(RunConfig(), section)))[f.name],))]
    assert len(floats) >= 15 and ("training", "lr") in floats and ("federation", "sick_loss_ratio") in floats
    for i, (section, name) in enumerate(floats):
        value = ("nan", "inf", "-inf")[i % 3]
        assert main([*base, f"{flag_name(section, name)}={value}"]) == 2, (section, name)
        assert f"not a finite number: {section}.{name}={float(value)!r}" in capsys.readouterr().err
        config = tmp_path / f"{section}.{name}.json"
        config.write_text(json.dumps({section: {name: float(value)}}))  # NaN / Infinity literals
        assert main([*base, "--config", str(config)]) == 2, (section, name)
        assert f"{section}.{name}=" in capsys.readouterr().err
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"eps": NaN}}}')
    assert main([*base, "--deepspeed", "--deepspeed_config", str(ds)]) == 2
    assert "deepspeed.optimizer.params.eps=nan" in capsys.readouterr().err


def test_async_save_is_refused_where_it_cannot_work(capsys, monkeypatch):
    """--async-save writes with torch.distributed.checkpoint (fsdp2 only) and needs --save."""
    from fl_megatron.pretrain import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    base = ["--model", "llama-tiny", "--world-size", "4", "--dry-run", "--async-save"]
    assert main(base) == 2 and "async_save need --save DIR" in capsys.readouterr().err
    assert main([*base, "--save", "/tmp/x", "--backend", "megatron"]) == 2
    assert "async_save writes with torch.distributed.checkpoint: it is for the fsdp2 backend, not megatron" in \
        capsys.readouterr().err
    assert main([*base, "--save", "/tmp/x"]) == 0


ELASTIC = ["--fl-elastic", "--fl-lighthouse", "localhost:29510", "--fl-group-id", "1", "--fl-num-groups", "3"]


@pytest.mark.parametrize("flags,needles", [
    (ELASTIC[:-2], ["elastic mode (--fl-elastic) needs --fl-num-groups"]),
    (ELASTIC[:1] + ELASTIC[-2:], ["needs --fl-group-id (or FL_GROUP_ID), --fl-lighthouse (or TORCHFT_LIGHTHOUSE)"]),
    (ELASTIC[:3] + ["--fl-group-id", "3", "--fl-num-groups", "3"], ["group_id=3 is not a slot of num_groups=3"]),
    (ELASTIC + ["--fl-min-groups", "4"], ["min_groups=4 exceeds num_groups=3"]),
    (ELASTIC + ["--fl-group-size", "4"], ["--fl-group-size 4 differs from the job's 8 ranks"]),
    (ELASTIC + ["--fl-topology", "ring"], ["needs topology complete, not ring"]),
    (ELASTIC + ["--fl-tune", "--fl-tune-max-sync-interval", "16"],
     ["tune_max_sync_interval=16: in elastic mode tune keeps sync_interval", "leave --fl-tune-max-sync-interval out"]),
    (ELASTIC + ["--save", "/tmp/ckpt", "--save-interval", "6"], ["--save-interval 6", "multiple of --fl-sync-interval"]),
    (ELASTIC + ["--save", "/tmp/ckpt", "--exit-interval", "6"], ["--exit-interval 6", "multiple of --fl-sync-interval"]),
    (ELASTIC + ["--save", "/tmp/ckpt", "--ckpt-mode", "compact"], ["--ckpt-mode compact"]),
    (ELASTIC[:5] + ["--fl-group-sizes", "8,4", "--fl-num-groups", "2"], ["group_sizes replaces num_groups=2"]),
    (ELASTIC[:3] + ["--fl-group-id", "2", "--fl-group-sizes", "8,4"],
     ["group_id=2 is not a group of group_sizes='8,4' (0 .. 1)"]),
    (ELASTIC[:3] + ["--fl-group-id", "1", "--fl-group-sizes", "8,4"],
     ["--fl-group-sizes 8,4 gives group 1 4 ranks, but this job has 8"]),
    (ELASTIC[:3] + ["--fl-group-id", "0", "--fl-group-sizes", "8,4", "--backend", "megatron"],
     ["backend megatron in elastic mode: its distributed optimizer's buckets", "use fsdp2 or deepspeed"]),
    (["--fl-lighthouse", "localhost:29510"], ["lighthouse='localhost:29510' is for elastic mode"]),
    (["--fl-sync-digest"], ["sync_digest is for elastic mode"]),
])
def test_elastic_mode_refuses_what_it_cannot_run(launched, capsys, flags, needles):
    _fails(capsys, BASE + flags, *needles)


def test_elastic_mode_refuses_a_deepspeed_scheduler(launched, capsys, tmp_path):
    path = _ds_json(tmp_path, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
                   train_batch_size=32, federation={"group_size": 8, "sync_interval": 4})
    _fails(capsys, BASE + ELASTIC + ["--deepspeed_config", path], "a DeepSpeed 'scheduler' block")
