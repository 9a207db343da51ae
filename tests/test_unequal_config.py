"""Groups of unequal size from flags to layout, refusals, dry run and checkpoint metadata: no
processes (the training itself is tests/test_unequal_training.py)."""

import math

import pytest

from fl_megatron.atom_plan import plan_for_shapes
from fl_megatron.checkpoint.metadata import build_metadata, source_groups
from fl_megatron.config import resolve
from fl_megatron.config.flags import parse_args
from fl_megatron.config.sync_mode import SyncMode
from fl_megatron.group_layout import GroupLayout, recorded_group_sizes
from fl_megatron.models import build_model
from fl_megatron.pretrain import main
from fl_megatron.topology import make_layout


def _run(*flags, world=12):
    cfg, _ = parse_args(["--ranks-per-node", "4", *flags])
    return resolve(cfg, world)


def test_group_sizes_give_a_layout_of_unequal_groups_and_equal_sizes_today_s_layout():
    run = _run("--fl-group-sizes", "8,4", "--fl-hsdp-shard-sizes", "4,4")
    assert isinstance(run.layout, GroupLayout)
    assert [(g.first_rank, g.size, g.shard_size) for g in run.layout.groups] == [(0, 8, 4), (8, 4, 4)]
    assert run.layout.seen_from(9).group_size == 4 and run.layout.seen_from(3).replicas == 2
    assert _run("--fl-group-sizes", "4,4,4").layout == make_layout(12, 4, 4)
    assert _run("--fl-group-sizes", "4,4,4", "--fl-hsdp-shard-sizes", "2,2,2").layout == make_layout(12, 4, 4, shard_size=2)


@pytest.mark.parametrize("flags, message", [
    (("--fl-group-sizes", "8,x"), "'x' is not one"),
    (("--fl-group-sizes", "8,0"), "'0' is not one"),
    (("--fl-group-sizes", "8,4", "--fl-group-size", "4"), "group_sizes replaces group_size=4"),
    (("--fl-hsdp-shard-sizes", "2,2"), "hsdp_shard_sizes needs group_sizes"),
    (("--fl-group-sizes", "8,4", "--fl-hsdp-shard-sizes", "4"), "1 values for 2 groups"),
    (("--fl-group-sizes", "8,2"), "holds 10 ranks but the job has 12"),
    (("--fl-group-sizes", "6,6"), "must cover whole nodes of 4 ranks"),
    (("--fl-group-sizes", "8,4", "--fl-topology", "ring"), "topology ring"),
    (("--fl-group-sizes", "8,4", "--fl-tune"), "tune: its probe"),
])
def test_what_groups_of_unequal_size_refuse_is_named(flags, message):
    with pytest.raises(ValueError) as e:
        _run(*flags)
    assert message in str(e.value)


def test_a_deepspeed_train_batch_size_is_refused_for_groups_of_unequal_size(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 48, "zero_optimization": {"stage": 3}}')
    with pytest.raises(ValueError, match="a DeepSpeed train_batch_size: it is one group's batch"):
        _run("--fl-group-sizes", "8,4", "--deepspeed_config", str(path))
    path.write_text('{"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}')
    with pytest.raises(ValueError, match="zero_hpz_partition_size=8 must divide the ZeRO-3 group \\(8/4 ranks"):
        _run("--fl-group-sizes", "8,4", "--deepspeed_config", str(path))


def test_the_dry_run_prints_each_group_and_the_atom_plan_s_cost(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "12")
    args = ["--dry-run", "--world-size", "12", "--ranks-per-node", "4", "--fl-group-sizes", "8,4",
            "--model", "llama-tiny"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "2 federation groups of unequal size (8+4)" in out
    assert "group 1: 4 ranks (8-11, node 2), FSDP over 4" in out
    assert "32/16 (by group size) per group step" in out
    # against a count from the shapes alone: with FSDP in every group a rank averages its whole shard,
    # and FSDP2 gives a group's rank 0 the most, ceil(rows / S) rows of every tensor
    shapes = [tuple(p.shape) for p in build_model(parse_args(args)[0].model, "meta").parameters()]
    for f, size in enumerate((8, 4)):
        most = sum(math.prod(s) // s[0] * min(-(-s[0] // size), s[0]) for s in shapes)
        assert f"group {f}: {size} ranks (FSDP {size}), up to {most:,} elements" in out
    plan = plan_for_shapes(_run("--fl-group-sizes", "8,4").layout.groups, shapes, "fsdp2")
    assert f"{len(plan.owner_tuples()):,} communicators across groups" in out
    assert "inner state" not in out
    assert main(args + ["--fl-inner-state", "average", "--fl-fragments", "2"]) == 0
    assert "(AdamW: 2) is averaged the same way, in fp32: 4 bytes per element each, a fragment its window in its " \
        "turn" in capsys.readouterr().out


def test_checkpoint_metadata_records_every_group_and_resumes_only_into_the_same(tmp_path):
    run = _run("--fl-group-sizes", "8,4")
    meta = build_metadata(run, 4, 4, True, "exact", [0, 1], SyncMode("fp32", 0, 1, 8, False))
    assert recorded_group_sizes(meta["layout"]) == ((8, 4), (8, 4))
    assert source_groups(meta, run) == ([0, 1], [])
    with pytest.raises(ValueError, match="groups 8\\+4 sharded 8\\+4 .* vs groups 4\\+8 sharded 4\\+8"):
        source_groups(meta, _run("--fl-group-sizes", "4,8"))
    with pytest.raises(ValueError, match="groups of unequal size resume only into the same groups"):
        source_groups(meta, _run("--fl-group-size", "4"))


def test_sites_with_nodes_of_8_and_4_ranks_are_checked_and_counted_node_by_node():
    layout = _run("--fl-group-sizes", "16,8", "--fl-hsdp-shard-sizes", "8,4", "--fl-group-ranks-per-node", "8,4",
                  world=24).layout
    assert layout.num_nodes == 4 and [layout.node_of(r) for r in (0, 15, 16, 19, 20, 23)] == [0, 1, 2, 2, 3, 3]
    assert layout.seen_from(20).ranks_per_node == 4 and layout.seen_from(3).ranks_per_node == 8
    assert "24 ranks on 4 nodes x 8/4" in layout.describe() and "(16-23, nodes 2-3)" in layout.describe()
    for flags, message in ((("16,8", "8,4", "8,16"), "group 1 \\(8 ranks\\) must cover whole nodes of its 16"),
                           (("16,12", "8,6", "8,4"), "group 1: its shard groups of 6 ranks would straddle"),
                           (("16,8", "8,3", "8,4"), "group 1: shard size 3 does not divide its size 8"),
                           (("16,8", "8,4", "8"), "group_ranks_per_node has 1 values for 2 groups")):
        sizes, shards, nodes = flags
        with pytest.raises(ValueError, match=message):
            _run("--fl-group-sizes", sizes, "--fl-hsdp-shard-sizes", shards, "--fl-group-ranks-per-node", nodes,
                 world=sum(map(int, sizes.split(","))))


def test_the_readme_s_two_site_recipe_prints_what_the_docs_quote(capsys):
    """README's "Heterogeneous sites" command, as written; docs/heterogeneous.md quotes its figures."""
    import shlex

    from test_readme import readme_block

    argv = shlex.split(readme_block("readme-heterogeneous").replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "fl_megatron.pretrain"]
    assert main(argv[3:]) == 0
    out = capsys.readouterr().out
    for quoted in ("512 ranks on 80 nodes x 8/4", "HSDP 48 x 8: memory", "HSDP 8 x 16: memory 26.1 GiB",
                   "group 0: 384 ranks (HSDP 48 x 8), up to 20,912,267 elements (79.8 MiB)",
                   "group 1: 128 ranks (HSDP 8 x 16), up to 62,736,416 elements (239.3 MiB)",
                   "in up to 5 communicators", "536 communicators across groups", "carry 3.0x the elements"):
        assert quoted in out, quoted


def test_a_damaged_group_list_in_checkpoint_metadata_is_named():
    from fl_megatron.checkpoint.metadata_schema import metadata_problems

    meta = build_metadata(_run("--fl-group-sizes", "8,4"), 4, 4, True, "exact", [0, 1],
                          SyncMode("fp32", 0, 1, 8, False))
    meta["manifest"] = {}
    assert metadata_problems(meta) == []
    for key, value in (("group_sizes", 12), ("hsdp_shard_sizes", [8]), ("group_ranks_per_node", [8, "4"])):
        damaged = {**meta, "layout": {**meta["layout"], key: value}}
        assert metadata_problems(damaged) == [f"layout.{key} is {value!r}, not a positive integer for each of "
                                              "the 2 groups"]


def test_the_dry_run_counts_a_compressed_sync_in_its_own_bytes(capsys):
    """int8 on the wire: each element is a byte plus its block's share of a 4-byte scale, so the
    MiB per rank are the elements x (1 + 4 / 256), not fp32's 4 bytes."""
    argv = ["--model", "llama3.1-8b", "--world-size", "512", "--ranks-per-node", "8", "--fl-group-sizes", "384,128",
            "--fl-hsdp-shard-sizes", "8,16", "--fl-sync-dtype", "int8", "--fl-error-feedback", "--fl-fragments", "2",
            "--fl-sync-interval", "8", "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "int8 on the wire, atom by atom" in out and "each sync moves one of its 2 fragments" in out
    mib = 62_736_416 * (1 + 4 / 256) / 2 ** 20
    assert f"group 1: 128 ranks (HSDP 8 x 16), up to 62,736,416 elements ({mib:,.1f} MiB)" in out, out
