"""tools/convert_checkpoint_to_hf.py on a real multi-group checkpoint, and --init-from-hf."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_utils import launch, run_pretrain
from fl_megatron.checkpoint.reader import CheckpointReader
from fl_megatron.convert import SafetensorsDir, import_tensor
from fl_megatron.models import build_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(900)
TOOL = Path(__file__).resolve().parents[1] / "tools" / "convert_checkpoint_to_hf.py"


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """2 groups of 2 ranks, AdamW, saved after step 3 with a sync every 4 steps: the groups differ."""
    tmp = tmp_path_factory.mktemp("export")
    run_pretrain(4, tmp / "run", tmp / "cache", "--optimizer", "adamw", "--lr", "0.01", "--train-iters", "6",
                 "--eval-iters", "0", "--fl-group-size", "2", "--fl-sync-interval", "4", "--save", str(tmp / "ckpt"),
                 "--exit-interval", "3")
    return tmp / "ckpt"


def test_default_export_is_the_groups_mean_and_transformers_agrees(checkpoint, tmp_path):
    proc = _convert("--checkpoint", str(checkpoint), "--output", str(tmp_path / "hf"), "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr
    reader = CheckpointReader(checkpoint)
    assert reader.groups == [0, 1]
    hf_dir = SafetensorsDir(tmp_path / "hf")
    mean = {n: torch.stack([reader.tensor(n, 0), reader.tensor(n, 1)]).mean(0) for n in reader.names}
    assert any(not torch.equal(reader.tensor(n, 0), reader.tensor(n, 1)) for n in reader.names)
    for name in reader.names:
        got = import_tensor(reader.model_cfg, name, hf_dir.read)
        torch.testing.assert_close(got, mean[name], rtol=1e-6, atol=1e-7)
    # transformers' logits on the exported model against ours with the mean parameters
    ours = build_model(reader.model_cfg, "cpu")
    ours.load_state_dict(mean)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    tokens = torch.randint(0, reader.model_cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(tokens).logits - ours(tokens)).abs().max().item() <= 1e-4
    # one group, bit for bit
    proc = _convert("--checkpoint", str(checkpoint), "--output", str(tmp_path / "g1"), "--dtype", "fp32", "--group", "1")
    assert proc.returncode == 0, proc.stderr
    one = SafetensorsDir(tmp_path / "g1")
    assert all(torch.equal(import_tensor(reader.model_cfg, n, one.read), reader.tensor(n, 1)) for n in reader.names)


def _damaged(checkpoint: Path, tmp: Path, how: str) -> Path:
    copy = tmp / f"ckpt-{how}"
    shutil.copytree(checkpoint, copy)
    shard = sorted((copy / "iter_0000003" / "group_001").glob("*.distcp"))[0]
    if how == "truncated":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
    else:
        shard.unlink()
    return copy


@pytest.mark.parametrize("case", ["truncated", "missing", "not-a-checkpoint", "no-such-iteration"])
def test_bad_checkpoints_get_a_clear_error_and_no_output(checkpoint, tmp_path, case):
    args, needle = {
        "truncated": (["--checkpoint", None], "truncated"),
        "missing": (["--checkpoint", None], "is missing"),
        "not-a-checkpoint": (["--checkpoint", str(tmp_path)], "is not a checkpoint directory"),
        "no-such-iteration": (["--checkpoint", str(checkpoint), "--iteration", "7"], "no checkpoint of iteration 7"),
    }[case]
    if args[1] is None:
        args[1] = str(_damaged(checkpoint, tmp_path, case))
    out = tmp_path / "out"
    proc = _convert(*args, "--output", str(out))
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    assert not list(tmp_path.glob(".out*"))  # no temporary directory left either


def test_init_from_hf_reads_each_rank_its_rows(checkpoint, tmp_path):
    """A run started from an exported directory holds exactly its weights (SGD at lr 0 keeps them),
    on another layout (1 group of 4) than the one that trained them; a directory of another
    shape is refused by name."""
    assert _convert("--checkpoint", str(checkpoint), "--output", str(tmp_path / "hf"), "--dtype", "fp32",
                    "--group", "0").returncode == 0
    run_pretrain(4, tmp_path / "run", tmp_path / "cache", "--init-from-hf", str(tmp_path / "hf"), "--optimizer", "sgd",
                 "--lr", "0", "--train-iters", "1", "--eval-iters", "0", "--save", str(tmp_path / "ckpt"))
    started, source = CheckpointReader(tmp_path / "ckpt"), CheckpointReader(checkpoint)
    assert all(torch.equal(started.tensor(n, 0), source.tensor(n, 0)) for n in source.names)
    proc = launch(4, tmp_path / "bad", tmp_path / "cache", "--init-from-hf", str(tmp_path / "hf"), "--hidden-size", "128")
    assert proc.returncode != 0 and "hidden_size 64 (Hugging Face) vs 128 (run)" in proc.stderr


TEXTS = ["Hello world", "two  spaces and\nnewline", "  leading spaces", "The quick brown fox, 1234!", " leading space", "zz", ""]
# and what SentencePiece does its own way: tabs, newlines, characters it only has as bytes, "<s>" as text
HARD = TEXTS + ["\ttab\t", "\n\nlines\n", "trailing  ", "Grüße 日本 😀🚀", "a <s> b </s>", "   "]


def _sentencepiece_model(path: Path, dummy_prefix: bool, vocab_size: int = 320) -> Path:
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    corpus = [f"{w} the quick brown fox jumps over {n} lazy dogs\n  and spaces" for n, w in
              enumerate(["Hello", "world", "Token", "ids"] * 40)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=model, vocab_size=vocab_size,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, add_dummy_prefix=dummy_prefix,
                                   bos_id=1, eos_id=2, unk_id=0, num_threads=1)
    path.write_bytes(model.getvalue())
    return path


def _tokenizer_json(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path))
    return path


@pytest.mark.parametrize("kind", ["GPTSentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer"])
def test_export_with_the_runs_tokenizer_gives_autotokenizer_our_ids(checkpoint, tmp_path, kind):
    """A run trained on a custom tokenizer: --tokenizer puts it in the export (a SentencePiece
    model as train_sentencepiece trains it, or with a prefix space and BOS, or a tokenizer.json
    with a post-processor), and AutoTokenizer on the directory gives our tokenizer's ids and
    decodes them to our text, from tokenizer.json alone; config.json names bos/eos."""
    import json

    from fl_megatron.convert.from_checkpoint import convert
    from fl_megatron.data.corpus import demo_corpus_path, load_documents
    from fl_megatron.data.text_tokenizers import build_tokenizer
    from fl_megatron.data.tokenizer import train_sentencepiece

    if kind == "HuggingFaceTokenizer":
        path = _tokenizer_json(tmp_path / "tokenizer.json")
    elif kind == "Llama2Tokenizer":
        path = _sentencepiece_model(tmp_path / "sp.model", dummy_prefix=True)
    else:
        path = train_sentencepiece(load_documents(demo_corpus_path())[:20], 480, tmp_path / "sp.model")
    out = convert(str(checkpoint), str(tmp_path / "hf"), dtype="fp32", log=lambda *_: None,
                  tokenizer=str(path), tokenizer_type=kind)
    if kind != "HuggingFaceTokenizer":  # no conversion at load time: transformers never reads the .model
        (out / "tokenizer.model").unlink()
    ours = build_tokenizer(kind, path)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in HARD:
        ids = theirs(text)["input_ids"]
        assert ids == ours.encode(text), (kind, text, theirs.convert_ids_to_tokens(ids))
        if kind != "HuggingFaceTokenizer":  # SentencePiece decodes control pieces to nothing
            assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids), (kind, text)
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == ours.eod_id == theirs.eos_token_id
    assert config["bos_token_id"] == theirs.bos_token_id is not None
    # a tokenizer larger than the model's vocabulary is not this model's: refused before any writing
    big = _sentencepiece_model(tmp_path / "big.model", False, CheckpointReader(checkpoint).model_cfg.vocab_size + 8)
    with pytest.raises(ValueError, match="is not the tokenizer this model was trained with"):
        convert(str(checkpoint), str(tmp_path / "hf-big"), tokenizer=str(big))
    assert not (tmp_path / "hf-big").exists()
