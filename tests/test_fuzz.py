"""Property-based fuzzing (hypothesis) of everything a user hands the program before it starts:
flags, --config files, DeepSpeed JSON, indexed data files and checkpoints.

The property, for every input: the dry run (which opens what the run would open) either passes
or exits 2 with one `error:` line; never another exception, never a hang, and no file is left
next to the inputs. Fixed seed (derandomize) and FL_FUZZ_EXAMPLES examples per fuzzer (default
200; the long run: FL_FUZZ_EXAMPLES=5000).
"""

import contextlib
import io
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fl_megatron.config.deepspeed_json import DEEPSPEED_KEYS
from fl_megatron.config.flags import build_parser
from fl_megatron.config.parallel import FederationConfig
from fl_megatron.config.run import RunConfig
from fl_megatron.data.indexed import IndexedDatasetWriter
from fl_megatron.pretrain import main

EXAMPLES = int(os.environ.get("FL_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])
BASE = ["--model", "llama-tiny", "--world-size", "8", "--ranks-per-node", "4"]
TINY_DATA = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "96", "--num-attention-heads", "4",
             "--num-query-groups", "2", "--vocab-size", "512", "--seq-length", "16", "--micro-batch-size", "1"]


def dry_run(argv: list[str]) -> tuple[int, str]:
    """pretrain's main with --dry-run, in this process: (exit code, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([*argv, "--dry-run"])
        except SystemExit as e:  # argparse: usage errors exit 2, --help exits 0
            code = e.code
    return code, err.getvalue()


def assert_clean(argv: list[str]) -> int:
    code, err = dry_run(argv)
    assert code in (0, 2), f"exit {code} for {argv}:\n{err[-2000:]}"
    if code == 2:
        assert "error:" in err and "Traceback" not in err, err[-2000:]
    if os.environ.get("FL_FUZZ_LOG"):  # outcomes, for the long run's report
        with open(os.environ["FL_FUZZ_LOG"], "a") as log:
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[-1].split(" ")[0]
            log.write(json.dumps({"test": test, "code": code, "error": err.strip().splitlines()[-1][:160]
                                  if code else ""}) + "\n")
    return code


# --- values ---------------------------------------------------------------------------------
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.integers(-2**40, 2**62),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["", "0", "-1", "1e400", "nan", "auto", "fp32", "int8", "ring", "adam"]))
JSON_VALUES = st.recursive(SCALARS,  # NaN and Infinity included: json.dumps writes them, json.loads reads them
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                           max_leaves=6)


def _flag_actions():
    skip = {"--dry-run", "--help", "-h"}
    return [a for a in build_parser()._actions if a.option_strings and not set(a.option_strings) & skip]


ACTIONS = _flag_actions()


@st.composite
def flag_argv(draw) -> list[str]:
    argv = []
    for action in draw(st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=4)):
        argv.append(draw(st.sampled_from(action.option_strings)))
        if action.nargs == 0:
            continue
        choices = [str(c) for c in action.choices] if action.choices else []
        value = draw(st.one_of(st.sampled_from(choices), SCALARS.map(str)) if choices else SCALARS.map(str))
        argv.append(value)
        if action.nargs in ("+", "*") and draw(st.booleans()):
            argv.append(draw(SCALARS.map(str)))
    return argv


@FUZZ
@given(flag_argv())
def test_fuzz_flags(argv):
    assert_clean([*BASE, *argv])


def _config_keys() -> dict[str, list[str]]:
    import dataclasses

    sections = {}
    for f in dataclasses.fields(RunConfig):
        if dataclasses.is_dataclass(f.type) or (isinstance(f.type, type) and dataclasses.is_dataclass(f.type)):
            sections[f.name] = [g.name for g in dataclasses.fields(f.type)]
    return sections


SECTIONS = _config_keys()


@st.composite
def config_json(draw) -> object:
    if draw(st.integers(0, 9)) == 0:  # not an object at all
        return draw(JSON_VALUES)
    doc: dict = {}
    for _ in range(draw(st.integers(1, 4))):
        section = draw(st.sampled_from([*SECTIONS, "preset", "deepspeed", "modle"]))
        if section not in SECTIONS:
            doc[section] = draw(JSON_VALUES)
            continue
        key = draw(st.sampled_from(SECTIONS[section]) | st.text(max_size=10))
        doc.setdefault(section, {})[key] = draw(JSON_VALUES)
    return doc


@FUZZ
@given(config_json())
def test_fuzz_config_files(tmp_path, doc):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    assert_clean([*BASE, "--config", str(path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


FEDERATION_KEYS = [f.name for f in __import__("dataclasses").fields(FederationConfig)]


@st.composite
def deepspeed_json(draw) -> dict:
    doc = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from(sorted(DEEPSPEED_KEYS)) | st.text(max_size=10))
        doc[key] = draw(JSON_VALUES)
    if draw(st.booleans()):
        doc["federation"] = {draw(st.sampled_from(FEDERATION_KEYS) | st.text(max_size=8)): draw(JSON_VALUES)
                             for _ in range(draw(st.integers(1, 3)))}
    return doc


@FUZZ
@given(deepspeed_json())
def test_fuzz_deepspeed_json(tmp_path, doc):
    pytest.importorskip("deepspeed")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(doc))
    assert_clean([*BASE, "--deepspeed", "--deepspeed_config", str(path)])


# --- files ----------------------------------------------------------------------------------
@st.composite
def damage(draw) -> tuple:
    """(kind, position in [0, 1), bytes): truncate, flip bytes, or append."""
    kind = draw(st.sampled_from(["truncate", "flip", "append", "empty"]))
    return kind, draw(st.floats(0, 0.999)), draw(st.binary(min_size=1, max_size=16))


def apply_damage(path: Path, how: tuple) -> None:
    kind, where, data = how
    raw = bytearray(path.read_bytes())
    at = int(where * len(raw))
    if kind == "truncate":
        raw = raw[:at]
    elif kind == "flip":
        for i, b in enumerate(data):
            raw[(at + i) % len(raw)] ^= b or 0xFF
    elif kind == "append":
        raw += data
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))


def _dataset(prefix: Path) -> None:
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
        w.add_documents([rng.integers(0, 512, size=int(n)) for n in rng.integers(1, 60, size=40)])


@FUZZ
@given(st.sampled_from(["idx", "bin"]), damage())
def test_fuzz_indexed_data_files(tmp_path_factory, which, how):
    folder = tmp_path_factory.mktemp("data")
    _dataset(folder / "d")
    apply_damage(folder / f"d.{which}", how)
    os.environ["FL_MEGATRON_CACHE"] = str(folder / "cache")
    try:
        assert_clean([*BASE, *TINY_DATA, "--data-path", str(folder / "d"), "--split", "90,10,0"])
    finally:
        del os.environ["FL_MEGATRON_CACHE"]
    left = sorted(p.name for p in folder.iterdir() if p.name != "cache")
    assert left == ["d.bin", "d.idx"]
    assert not [p for p in folder.rglob("*") if ".tmp" in p.name]


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    from cli_utils import SGD, run_pretrain

    root = tmp_path_factory.mktemp("ckpt")
    run_pretrain(2, root / "run", root / "cache", *SGD, "--train-iters", "2", "--fl-group-size", "1",
                 "--fl-sync-interval", "2", "--save", str(root / "ckpt"))
    return root / "ckpt"


def _checkpoint_args() -> list[str]:
    from cli_utils import TINY

    return [*TINY, "--world-size", "2", "--ranks-per-node", "2", "--fl-group-size", "1", "--fl-sync-interval", "2",
            "--train-iters", "4"]


CHECKPOINT_ARGS = _checkpoint_args()


@FUZZ
@given(st.data())
def test_fuzz_checkpoints(saved_checkpoint, tmp_path_factory, data):
    import shutil

    ckpt = tmp_path_factory.mktemp("damaged") / "ckpt"
    shutil.copytree(saved_checkpoint, ckpt)
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    target = data.draw(st.sampled_from(files))
    if target.name == "metadata.json" and data.draw(st.booleans()):
        meta = json.loads(target.read_text())
        key = data.draw(st.sampled_from(sorted(meta)))
        meta[key] = data.draw(JSON_VALUES)
        target.write_text(json.dumps(meta))
    else:
        apply_damage(target, data.draw(damage()))
    before = sorted(str(p) for p in ckpt.rglob("*"))
    assert_clean([*CHECKPOINT_ARGS, "--load", str(ckpt)])
    assert sorted(str(p) for p in ckpt.rglob("*")) == before


def test_damaged_tokens_stop_the_run_with_an_error(tmp_path):
    """Flipped bytes in a .bin are token ids past the vocabulary: the dry run and every rank's
    start-up check (all tokens of a file up to 16 Mi, evenly spaced blocks beyond) refuse the
    file naming the id; a token the bounded scan did not read stops training at its batch."""
    import torch

    from cli_utils import SGD, launch
    from fl_megatron.training.run_data import DataError, next_token_loss

    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "d", dtype=np.uint16) as w:
        w.add_documents([rng.integers(0, 512, size=50) for _ in range(40)])
    raw = bytearray((tmp_path / "d.bin").read_bytes())
    for at in range(100, len(raw) - 1, 200):  # every 100th token
        raw[at:at + 2] = (60000).to_bytes(2, "little")
    (tmp_path / "d.bin").write_bytes(bytes(raw))
    flags = [*SGD, "--train-iters", "3", "--data-path", str(tmp_path / "d"), "--split", "100,0,0",
             "--eval-iters", "0", "--fl-group-size", "1", "--distributed-timeout-minutes", "0.5"]
    message = f"{tmp_path / 'd'} has token id 60000 among all its tokens, but --vocab-size is 512"
    assert assert_clean([*flags, "--world-size", "2", "--model", "llama-tiny", *TINY_DATA]) == 2
    assert message in dry_run([*flags, "--world-size", "2", "--model", "llama-tiny", *TINY_DATA])[1]
    proc = launch(2, tmp_path / "run", tmp_path / "cache", *flags, timeout=240)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-3000:]
    assert not re.search(r"\[rank\d\]: Traceback", proc.stderr)  # torchrun's own traceback for a failed child aside
    with pytest.raises(DataError, match="the data holds token id 60000 but the model's vocab_size is 512"):
        next_token_loss(None, torch.tensor([[1, 2, 60000, 3]]), 512, torch.device("cpu"))


def test_the_dry_run_opens_the_checkpoint_and_data_the_run_would(saved_checkpoint, tmp_path):
    """What the fuzzers rely on: a dry run fails on a checkpoint or data file the run would fail on."""
    import pickle
    import shutil

    from test_no_pickle_code import Payload

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_checkpoint, ckpt)
    argv = [*CHECKPOINT_ARGS, "--load", str(ckpt)]
    assert dry_run(argv)[0] == 0
    metadata = ckpt / "iter_0000002" / "group_001" / ".metadata"
    good = metadata.read_bytes()
    crafted = pickle.dumps(Payload(tmp_path / "ran"))  # padded past STOP: the manifest's size matches
    metadata.write_bytes(crafted + b"\0" * (len(good) - len(crafted)))
    code, err = dry_run(argv)
    assert code == 2 and f"{metadata}: refusing to load it" in err and not (tmp_path / "ran").exists()
    metadata.write_bytes(good[:-10])
    code, err = dry_run(argv)
    assert code == 2 and "is incomplete: group_001/.metadata has" in err
    _dataset(tmp_path / "d")
    data = [*BASE, *TINY_DATA, "--data-path", str(tmp_path / "d"), "--split", "90,10,0"]
    os.environ["FL_MEGATRON_CACHE"] = str(tmp_path / "cache")
    try:
        assert dry_run(data)[0] == 0
        apply_damage(tmp_path / "d.idx", ("truncate", 0.5, b""))
        code, err = dry_run(data)
    finally:
        del os.environ["FL_MEGATRON_CACHE"]
    assert code == 2 and f"{tmp_path / 'd'}.idx: index truncated" in err


def test_a_file_damaged_inside_stops_the_resume_with_an_error(saved_checkpoint, tmp_path):
    """Bytes changed inside a shard file keep its size, so the manifest passes; loading it fails,
    and the run says which checkpoint directory it could not read (no traceback)."""
    import shutil

    from cli_utils import SGD, launch

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_checkpoint, ckpt)
    shard = sorted((ckpt / "iter_0000002" / "group_001").glob("*.distcp"))[0]
    apply_damage(shard, ("flip", 0.0, b"\xff\xff\xff\xff"))  # the first entry's zip header
    proc = launch(2, tmp_path / "run", tmp_path / "cache", *SGD, "--train-iters", "4", "--fl-group-size", "1",
                  "--fl-sync-interval", "2", "--load", str(ckpt), "--distributed-timeout-minutes", "0.5", timeout=240)
    assert proc.returncode != 0
    assert f"could not read the checkpoint {ckpt / 'iter_0000002' / 'group_001'}" in proc.stderr, proc.stderr[-3000:]
    assert not re.search(r"\[rank\d\]: Traceback", proc.stderr)  # torchrun's own traceback for a failed child aside
