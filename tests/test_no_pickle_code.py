"""Nothing user-supplied is unpickled with code execution: crafted pickles in every place we read
one are refused, and the code they carry does not run (a control shows that it would)."""

import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fl_megatron.backends.pickle_guard import (GuardedPlanner, GuardedReader, check_deepspeed_dir,
                                               check_group_pickles, read_dcp_metadata)
from fl_megatron.convert.hf_files import SafetensorsDir


class Payload:
    """Unpickling this makes the directory `marker`: the proof that a load ran code."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _dcp_save(directory, state) -> None:
    dcp.save(state, checkpoint_id=str(directory), no_dist=True)


def test_dcp_round_trip_through_the_guard(tmp_path):
    """The guarded reader and planner load what DCP saved: tensors and plain values."""
    saved = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optim": {"lr": 0.25, "betas": (0.9, 0.95)}}
    _dcp_save(tmp_path / "ok", saved)
    read_dcp_metadata(tmp_path / "ok" / ".metadata")
    check_group_pickles("fsdp2", tmp_path / "ok")
    into = {"model": {"w": torch.zeros(2, 3)}, "optim": {"lr": 0.0, "betas": (0.0, 0.0)}}
    dcp.load(into, storage_reader=GuardedReader(str(tmp_path / "ok")), planner=GuardedPlanner(), no_dist=True)
    assert torch.equal(into["model"]["w"], saved["model"]["w"])
    assert into["optim"] == saved["optim"]


def test_crafted_dcp_metadata_is_refused_without_running(tmp_path):
    _dcp_save(tmp_path / "ckpt", {"model": {"w": torch.ones(3)}})
    marker = tmp_path / "ran"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ValueError, match=r"\.metadata: refusing to load it.*posix\.mkdir"):
        check_group_pickles("fsdp2", tmp_path / "ckpt")
    with pytest.raises((ValueError, CheckpointException), match="refusing"):  # DCP wraps what a reader raises
        dcp.load({"model": {"w": torch.zeros(3)}}, storage_reader=GuardedReader(str(tmp_path / "ckpt")),
                 planner=GuardedPlanner(), no_dist=True)
    assert not marker.exists()
    with open(tmp_path / "ckpt" / ".metadata", "rb") as f:  # control: a plain unpickle runs it
        pickle.load(f)
    assert marker.is_dir()


def test_crafted_dcp_entry_is_refused_without_running(tmp_path):
    """A non-tensor entry is a torch.save pickle inside the shard file; DCP's own planner
    would load it with weights_only=False."""
    marker = tmp_path / "ran"
    _dcp_save(tmp_path / "ckpt", {"model": {"w": torch.ones(3)}, "extra": {"x": Payload(marker)}})
    check_group_pickles("fsdp2", tmp_path / "ckpt")  # the metadata itself is clean
    into = {"model": {"w": torch.zeros(3)}, "extra": {"x": None}}
    with pytest.raises((ValueError, CheckpointException), match="checkpoint entry extra.x: refusing"):
        dcp.load(into, storage_reader=GuardedReader(str(tmp_path / "ckpt")), planner=GuardedPlanner(), no_dist=True)
    assert not marker.exists()
    dcp.load(into, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)  # control: DCP unguarded runs it
    assert marker.is_dir()


def test_crafted_deepspeed_file_is_refused_without_running(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    zero3 = tmp_path / "group" / "zero3"
    zero3.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2)}, "loss_scaler": LossScaler(1.0)},
               zero3 / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    check_group_pickles("deepspeed", tmp_path / "group")  # DeepSpeed's own classes pass
    marker = tmp_path / "ran"
    torch.save({"optimizer_state_dict": Payload(marker)}, zero3 / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(ValueError, match=r"optim_states\.pt: refusing to load it"):
        check_deepspeed_dir(zero3)
    assert not marker.exists()
    (zero3 / "truncated.pt").write_bytes((zero3 / "zero_pp_rank_0_mp_rank_00_model_states.pt").read_bytes()[:100])
    (zero3 / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ValueError, match=r"truncated\.pt: not a readable torch checkpoint file"):
        check_deepspeed_dir(zero3)


def test_pickled_hugging_face_weights_are_refused(tmp_path):
    from fl_megatron.config.model import ModelConfig
    from fl_megatron.convert.hf_config import hf_config

    (tmp_path / "config.json").write_text(json.dumps(hf_config(ModelConfig(), "float32")))
    marker = tmp_path / "ran"
    torch.save({"model.embed_tokens.weight": Payload(marker)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"only pickled PyTorch weights \(pytorch_model\.bin\).*safetensors only"):
        SafetensorsDir(tmp_path)
    assert not marker.exists()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../../etc/passwd"}}))
    with pytest.raises(ValueError, match="shards must be plain file names inside the directory"):
        SafetensorsDir(tmp_path)
