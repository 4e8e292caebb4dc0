"""The char LM example: block structure, causality, reproducible batches, a loss that falls."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CHARLM = REPO / "examples" / "charlm"


def _load(name: str):
    """examples/charlm/<name>.py under a unique module name ('model' and 'data' are common names)."""
    spec = importlib.util.spec_from_file_location(f"charlm_{name}", CHARLM / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_data = _load("data")
CharCorpus, text_windows, window_batch = _data.CharCorpus, _data.text_windows, _data.window_batch
_model = _load("model")
Block, CharLM, CharLMConfig, Embedding, Head = _model.Block, _model.CharLM, _model.CharLMConfig, _model.Embedding, _model.Head
build_blocks, lm_loss = _model.build_blocks, _model.lm_loss

pytestmark = pytest.mark.timeout(60)

TEXT = "the quick brown fox jumps over the lazy dog. " * 40


def test_model_is_a_flat_list_of_blocks_a_pipeline_can_cut():
    cfg = CharLMConfig(vocab_size=30, context=16, d_model=32, n_heads=4, n_layers=3)
    blocks = build_blocks(cfg)
    assert [type(b) for b in blocks] == [Embedding, Block, Block, Block, Head]
    torch.manual_seed(0)
    model = CharLM(cfg)
    ids = torch.randint(30, (2, 16))
    x = ids
    for block in model:  # running the blocks one by one is running the model
        x = block(x)
    assert x.shape == (2, 16, 30)
    assert torch.allclose(x, model(ids))
    assert not list(model.buffers()), "buffers would make DDP broadcast every step"


def test_model_is_causal():
    torch.manual_seed(0)
    model = CharLM(CharLMConfig(vocab_size=30, context=16, d_model=32, n_heads=4, n_layers=2)).eval()
    ids = torch.randint(30, (1, 16))
    changed = ids.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 30
    with torch.no_grad():
        assert torch.allclose(model(ids)[0, :10], model(changed)[0, :10], atol=1e-6)
        assert not torch.allclose(model(ids)[0, 10:], model(changed)[0, 10:])


@pytest.mark.parametrize("kwargs, message", [
    (dict(vocab_size=30, d_model=30, n_heads=4), "d_model=30 must be a multiple of n_heads=4"),
    (dict(vocab_size=0), "vocab_size=0"),
])
def test_config_refuses_bad_shapes_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CharLMConfig(**kwargs)


def test_too_long_input_is_refused_with_the_context():
    model = CharLM(CharLMConfig(vocab_size=30, context=8, d_model=16, n_heads=2, n_layers=1))
    with pytest.raises(ValueError, match="longer than the model's context 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_batches_are_reproducible_per_step_and_rank():
    corpus = CharCorpus.from_text(TEXT)
    assert corpus.decode(corpus.train[:9].tolist()) == "the quick"
    a = corpus.train_batch(5, 0, batch_size=4, context=8)
    assert torch.equal(a[0], corpus.train_batch(5, 0, batch_size=4, context=8)[0])
    assert not torch.equal(a[0], corpus.train_batch(5, 1, batch_size=4, context=8)[0])
    assert not torch.equal(a[0], corpus.train_batch(6, 0, batch_size=4, context=8)[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1]), "targets are the inputs shifted by one"
    val = corpus.val_batches(batch_size=4, context=8, batches=3)
    assert len(val) == 3 and val[0][0].shape == (4, 8)


@pytest.mark.parametrize("length, context, starts", [
    (9, 4, [0, 4]),         # 0..4 and 4..8: consecutive windows share one character
    (10, 4, [0, 4]),        # a tail shorter than a window is left out
    (5, 4, [0]),            # exactly one window
    (7, 1, [0, 1, 2, 3, 4, 5]),
])
def test_text_windows_make_every_character_a_target_once(length, context, starts):
    ids = torch.arange(length)
    windows, offsets = text_windows(ids, context)
    assert offsets.tolist() == starts
    assert [w.tolist() for w in windows] == [list(range(s, s + context + 1)) for s in starts]
    inputs, targets = window_batch({"window": windows.to(torch.int32), "start": offsets})
    assert inputs.dtype == torch.long and targets.flatten().tolist() == list(range(1, starts[-1] + context + 1))


@pytest.mark.parametrize("length, context", [(4, 4), (0, 1), (10, 0)])
def test_a_text_without_a_whole_window_is_refused_by_name(length, context):
    with pytest.raises(ValueError, match=f"{length} characters holds no window of context={context}"):
        text_windows(torch.arange(length), context)


def test_missing_data_file_is_named():
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        CharCorpus.from_file("nope.txt")


def test_a_few_steps_lower_the_loss():
    corpus = CharCorpus.from_text(TEXT)
    torch.manual_seed(0)
    model = CharLM(CharLMConfig(vocab_size=corpus.vocab_size, context=16, d_model=32, n_heads=4, n_layers=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    val = corpus.val_batches(batch_size=8, context=16, batches=2)
    with torch.no_grad():
        before = sum(float(lm_loss(model(x), y)) for x, y in val)
    for step in range(1, 31):
        x, y = corpus.train_batch(step, 0, batch_size=8, context=16)
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        after = sum(float(lm_loss(model(x), y)) for x, y in val)
    assert after < 0.8 * before


def test_a_packed_corpus_reads_back_its_vocabulary_and_validation_windows(tmp_path):
    import torchrelay.train as rt

    corpus = CharCorpus.from_text(TEXT)
    meta = _data.pack_corpus(corpus, str(tmp_path / "store"), context=8, shard_size=256)
    assert meta["chars"] == corpus.chars and meta["windows"] == {"train": (len(corpus.train) - 1) // 8,
                                                                 "val": (len(corpus.val) - 1) // 8}
    loader = rt.stream(str(tmp_path / "store"), batch_size=4, rank=0, world_size=1)
    try:
        assert _data.read_vocabulary(loader) == meta
    finally:
        loader.close()
    val = _data.stored_val_batches(str(tmp_path / "store"), batch_size=4, batches=2)
    windows, _starts = text_windows(corpus.val, 8)
    assert [x.tolist() for x, _y in val] == [windows[:4, :-1].tolist(), windows[4:8, :-1].tolist()]


def test_a_store_without_the_vocabulary_is_refused_by_name(tmp_path):
    import torchrelay.train as rt
    from torchrelay.errors import InvalidSpec
    from torchrelay.shards import pack

    pack({"window": torch.zeros(4, 9, dtype=torch.int32)}, str(tmp_path / "other"))  # a dataset, not pack.py's
    loader = rt.stream(str(tmp_path / "other"), batch_size=4, rank=0, world_size=1)
    try:
        with pytest.raises(InvalidSpec, match="corpus.json is missing: --data must be a text file or a store"):
            _data.read_vocabulary(loader)
    finally:
        loader.close()
