"""The DeepSpeed top-level keys we accept are the ones the installed DeepSpeed reads: recorded
while DeepSpeedConfig parses a minimal config, independently of our stored list."""

import pytest

from fl_megatron.config.deepspeed_json import DEEPSPEED_KEYS, DEEPSPEED_VERSION
from fl_megatron.config.keys import unknown_keys_problem


def _keys_deepspeed_reads() -> set:
    from deepspeed.runtime.config import DeepSpeedConfig

    seen = set()

    class KeySet(set):
        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

    class Recording(dict):
        def get(self, key, *default):
            seen.add(key)
            return super().get(key, *default)

        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

        def keys(self):
            return KeySet(super().keys())

    DeepSpeedConfig(Recording({"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
                               "gradient_accumulation_steps": 1}), mpu=None)
    return seen


def test_the_stored_deepspeed_keys_are_what_deepspeed_reads():
    deepspeed = pytest.importorskip("deepspeed")
    if deepspeed.__version__ != DEEPSPEED_VERSION:
        pytest.skip(f"keys were recorded from DeepSpeed {DEEPSPEED_VERSION}, {deepspeed.__version__} is installed")
    assert _keys_deepspeed_reads() == set(DEEPSPEED_KEYS)


def test_unknown_keys_are_named_with_the_closest_valid_one():
    assert unknown_keys_problem({"lr": 1}, ["lr", "min_lr"], "x") is None
    text = unknown_keys_problem({"lrr": 1, "zzz": 2}, ["lr", "min_lr"], "cfg.json, training")
    assert text == ("cfg.json, training: unknown keys 'lrr' (did you mean 'lr'?), 'zzz'; "
                    "valid keys are lr, min_lr")
