"""Disk full and unwritable targets: a checkpoint or preprocessing output that cannot be written
fails with a message naming the path, and leaves the previous checkpoint and the input untouched.

A full disk is emulated with RLIMIT_FSIZE (writes past the limit fail with EFBIG, as ENOSPC
would: Python ignores SIGXFSZ); an unwritable target with a file where a directory must be
(running as root, permission bits would not stop a write).
"""

import hashlib
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from cli_utils import SGD, pretrain_command, run_pretrain
from fl_megatron.checkpoint import TRACKER, published_iterations

pytestmark = pytest.mark.timeout(600)
FLAGS = [*SGD, "--fl-group-size", "1", "--fl-sync-interval", "2", "--eval-iters", "0"]
REPO = Path(__file__).resolve().parents[1]


def _digests(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _limited(max_file_bytes: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
    return apply


def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path):
    ckpt, cache = tmp_path / "ckpt", tmp_path / "cache"
    run_pretrain(2, tmp_path / "run", cache, *FLAGS, "--train-iters", "2", "--save", str(ckpt))
    before = _digests(ckpt)
    largest = max((ckpt / "iter_0000002").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0)
    limit = largest.stat().st_size // 2  # the next checkpoint's largest file cannot be written
    cmd, env = pretrain_command(2, tmp_path / "run", cache, *FLAGS, "--train-iters", "4", "--save", str(ckpt),
                                "--load", str(ckpt), "--distributed-timeout-minutes", "0.5")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, preexec_fn=_limited(limit))
    assert proc.returncode != 0
    assert f"could not write the checkpoint of iteration 4 under {ckpt}" in proc.stderr, proc.stderr[-3000:]
    assert "the checkpoint of iteration 2 is untouched and stays the latest" in proc.stderr
    assert not re.search(r"\[rank\d\]: Traceback", proc.stderr)
    assert (ckpt / TRACKER).read_text().strip() == "2" and published_iterations(ckpt) == [2]
    assert {k: v for k, v in _digests(ckpt).items() if not k.startswith(".iter_0000004.staging")} == before
    # a target that cannot be created at all
    (tmp_path / "file").write_text("not a directory")
    cmd, env = pretrain_command(2, tmp_path / "run2", cache, *FLAGS, "--train-iters", "2",
                                "--save", str(tmp_path / "file" / "ckpt"), "--distributed-timeout-minutes", "0.5")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"could not write the checkpoint of iteration 2 under {tmp_path / 'file' / 'ckpt'}" in proc.stderr, \
        proc.stderr[-3000:]


def test_a_full_disk_fails_preprocessing_and_leaves_nothing(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " + "words " * 200}) + "\n" for i in range(300)))
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    out = tmp_path / "out"
    out.mkdir()
    from fl_megatron.data.tokenizer import train_sentencepiece

    model = train_sentencepiece([json.loads(line)["text"] for line in src.read_text().splitlines()], 300,
                                tmp_path / "sp" / "m.model")
    cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(src), "--output-prefix",
           str(out / "d"), "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", str(model)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, preexec_fn=_limited(4096))
    assert proc.returncode != 0
    assert f"could not write the output {out / 'd'}" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert list(out.iterdir()) == []
    assert hashlib.sha256(src.read_bytes()).hexdigest() == digest


def test_everything_a_run_creates_follows_the_umask(tmp_path):
    """Under umask 027 every file the run, its checkpoint and its data cache create is 0640 and
    every directory 0750: nothing is widened (no chmod to fixed modes), nothing world-readable."""
    cache, ckpt, run = tmp_path / "cache", tmp_path / "ckpt", tmp_path / "run"
    cmd, env = pretrain_command(2, run, cache, *FLAGS, "--train-iters", "2", "--save", str(ckpt))

    def umask_027() -> None:
        os.umask(0o027)

    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, preexec_fn=umask_027)
    assert proc.returncode == 0, proc.stderr[-3000:]
    made = [p for root in (cache, ckpt, run) for p in [root, *root.rglob("*")]]
    assert any(p.suffix == ".model" for p in made) and any(p.suffix == ".safetensors" for p in made)
    wrong = {str(p): oct(p.stat().st_mode & 0o777) for p in made
             if p.stat().st_mode & 0o777 != (0o750 if p.is_dir() else 0o640)}
    assert not wrong, wrong
