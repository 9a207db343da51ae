"""learning_rate against closed forms of linear warm-up + cosine / linear / constant decay."""

import itertools
import math

import pytest

from fl_megatron.config.training import TrainingConfig
from fl_megatron.training.lr_schedule import learning_rate


def _cfg(style, lr=1e-3, min_lr=1e-5, warmup=10, decay=None, train=100):
    cfg = TrainingConfig(lr=lr, min_lr=min_lr, lr_warmup_iters=warmup, lr_decay_style=style,
                         lr_decay_iters=decay, train_iters=train)
    cfg.validate()
    return cfg


def _reference(step, style, lr, min_lr, warmup, decay_end):
    if step < warmup:
        return lr * (step + 1) / warmup
    if style == "constant":
        return lr
    if step >= decay_end:
        return min_lr
    frac = (step - warmup) / (decay_end - warmup)
    if style == "linear":
        return lr + (min_lr - lr) * frac
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * frac))


SETTINGS = list(itertools.product(
    ["cosine", "linear", "constant"],
    [(1e-3, 0.0), (3e-4, 3e-5), (0.5, 0.5)],
    [0, 1, 7, 20],
    [None, 20, 60, 150],
))


@pytest.mark.parametrize("style,lrs,warmup,decay", SETTINGS)
def test_matches_closed_form(style, lrs, warmup, decay):
    lr, min_lr = lrs
    train = 100
    cfg = _cfg(style, lr, min_lr, warmup, decay, train)
    decay_end = train if decay is None else decay
    for step in range(0, 200):
        expect = _reference(step, style, lr, min_lr, warmup, decay_end)
        assert learning_rate(step, cfg) == pytest.approx(expect, rel=1e-12, abs=1e-15), step


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_warmup_is_linear_and_reaches_lr_at_last_warmup_step(style):
    cfg = _cfg(style, lr=2e-3, min_lr=0.0, warmup=8)
    values = [learning_rate(s, cfg) for s in range(8)]
    assert values[0] == pytest.approx(2e-3 / 8)
    assert values[7] == pytest.approx(2e-3)
    diffs = [b - a for a, b in zip(values, values[1:])]
    assert all(d == pytest.approx(2e-3 / 8) for d in diffs)
    assert learning_rate(8, cfg) == pytest.approx(2e-3)   # first step after warm-up is at peak


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_decay_end_points(style):
    cfg = _cfg(style, lr=1.0, min_lr=0.1, warmup=5, decay=45, train=100)
    assert learning_rate(5, cfg) == pytest.approx(1.0)
    assert learning_rate(45, cfg) == pytest.approx(0.1)
    assert learning_rate(99, cfg) == pytest.approx(0.1)
    # midpoint: both styles give the arithmetic mean
    assert learning_rate(25, cfg) == pytest.approx(0.55)
    # monotone non-increasing after warm-up
    vals = [learning_rate(s, cfg) for s in range(5, 60)]
    assert all(a >= b - 1e-15 for a, b in zip(vals, vals[1:]))


def test_cosine_quarter_points():
    cfg = _cfg("cosine", lr=1.0, min_lr=0.0, warmup=0, decay=None, train=40)
    assert learning_rate(10, cfg) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert learning_rate(30, cfg) == pytest.approx(0.5 * (1 + math.cos(3 * math.pi / 4)))
    assert learning_rate(40, cfg) == pytest.approx(0.0, abs=1e-15)


def test_decay_iters_defaults_to_train_iters():
    a = _cfg("linear", lr=1.0, min_lr=0.0, warmup=3, decay=None, train=50)
    b = _cfg("linear", lr=1.0, min_lr=0.0, warmup=3, decay=50, train=50)
    assert a.decay_iters() == 50
    for s in range(0, 70):
        assert learning_rate(s, a) == learning_rate(s, b)
    assert learning_rate(50, a) == 0.0


def test_negative_step_raises():
    with pytest.raises(ValueError, match="step=-1 must be >= 0"):
        learning_rate(-1, _cfg("cosine"))
