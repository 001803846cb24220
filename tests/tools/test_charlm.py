"""The charlm recipe: Python's own documentation text, a position split, and a GPT that learns from it."""

from __future__ import annotations

import itertools

import torch

from shardwise.tools.recipes import get_recipe
from shardwise.tools.recipes.charlm import CharGPT, CharVocab, lm_loss, load_charlm_split, python_docs_text


def test_text_ships_with_python_and_the_vocabulary_round_trips():
    text = python_docs_text()
    assert len(text) > 100_000
    vocab = CharVocab(text)
    piece = text[1000:1300]
    assert vocab.decode(vocab.encode(piece)) == piece
    assert len(vocab) == len(set(text))


def test_split_is_by_position_and_windows_shift_by_one():
    text = "".join(chr(97 + i % 26) for i in range(1000))
    vocab, train, val = load_charlm_split(block_size=8, val_fraction=0.1, stride=4, text=text)
    x, y = train[3]
    assert torch.equal(x[1:], y[:-1]) and x.shape == (8,)
    assert vocab.decode(x) == text[12:20] and vocab.decode(y) == text[13:21]
    last_train_end = train.starts[-1] + 8 + 1
    assert last_train_end <= 900  # every training window lies in the first 90%
    vx, _ = val[0]
    assert vocab.decode(vx) == text[900:908]  # validation starts where training text ends
    assert len(val) == (100 - 1) // 8


def test_model_is_causal_and_shapes_are_right():
    torch.manual_seed(0)
    model = CharGPT(vocab_size=13, block_size=8, d_model=16, n_heads=2, n_layers=2).double().eval()
    idx = torch.randint(0, 13, (3, 8))
    out = model(idx)
    assert out.shape == (3, 8, 13)
    changed = idx.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 13
    out2 = model(changed)
    assert torch.equal(out[:, :5], out2[:, :5])  # earlier positions do not see a later character
    assert not torch.allclose(out[:, 5:], out2[:, 5:])


def test_top_level_children_in_order_are_the_forward():
    """The contract pipeline parallelism splits on: embed, blocks..., head applied in order."""
    torch.manual_seed(0)
    model = CharGPT(vocab_size=11, block_size=8, d_model=16, n_heads=2, n_layers=3).double()
    idx = torch.randint(0, 11, (2, 8))
    x = idx
    for layer in [model.embed, *model.blocks, model.head]:
        x = layer(x)
    assert torch.equal(x, model(idx))


def test_too_long_a_sequence_is_a_clear_error():
    model = CharGPT(vocab_size=5, block_size=4, d_model=8, n_heads=2, n_layers=1)
    try:
        model(torch.zeros(1, 5, dtype=torch.long))
    except ValueError as exc:
        assert "longer than the model's block size 4" in str(exc)
    else:
        raise AssertionError("no error")


def test_a_few_steps_lower_the_loss_and_sampling_is_seeded():
    parts = get_recipe("charlm").parts({"d_model": 32, "n_layers": 1, "n_heads": 2, "block_size": 16, "sample_chars": 20})
    torch.manual_seed(0)
    opt = parts.optimizer(parts.model.parameters())
    loader = torch.utils.data.DataLoader(parts.train, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    losses = []
    for batch in itertools.islice(loader, 40):
        loss = lm_loss(parts.model(batch[0]), batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    assert parts.after_fit is not None
    text = parts.after_fit(parts.model)
    assert text.startswith("The ") and len(text) == 4 + 20
    assert text == parts.after_fit(parts.model)  # same seed, same text
