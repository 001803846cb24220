"""Hugging Face-style batches: a dict batch with ``labels`` trains with no user code
(``model(**batch).loss``), exactly as the loop a transformers user writes by hand, and a
batch that does not fit the model's forward is a clear error before anything runs."""

from __future__ import annotations

import pytest
import torch

from shardwise import Trainer
from shardwise.errors import ConfigError
from tests.support import zoo

pytest.importorskip("transformers", reason="the model tests need transformers: pip install -e '.[dev]'")

STEPS, BATCH = 3, 4


def hand_loop(name: str) -> torch.nn.Module:
    """What a transformers user writes: model(**batch).loss, backward, AdamW step."""
    model = zoo.build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = zoo.dataset(name, STEPS * BATCH)
    for step in range(STEPS):
        # shardwise's sampler shuffles; the hand loop takes the same order from it below
        batch = torch.utils.data.default_collate([data[i] for i in ORDER[name][step]])
        zoo.hf_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return model


ORDER: dict[str, list[list[int]]] = {}


class Spy(torch.utils.data.Dataset):
    """Records the indices the Trainer reads, so the hand loop can read the same ones."""

    def __init__(self, inner: torch.utils.data.Dataset, seen: list[int]) -> None:
        self.inner, self.seen = inner, seen

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i: int):
        self.seen.append(int(i))
        return self.inner[i]


@pytest.mark.parametrize("name", ["llama", "bert", "vit"])
def test_dict_batch_trains_on_the_models_own_loss_exactly_as_a_hand_loop(name):
    seen: list[int] = []
    model = zoo.build(name)
    Trainer(
        strategy="single", global_batch_size=BATCH, max_steps=STEPS, precision="64", progress_bar=False, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)
    ).fit(model, Spy(zoo.dataset(name, STEPS * BATCH), seen))
    seen = seen[-STEPS * BATCH :]  # the parent reads sample 0 once to check the batch fits the forward
    ORDER[name] = [seen[i * BATCH : (i + 1) * BATCH] for i in range(STEPS)]
    reference = hand_loop(name)
    for (k, a), b in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_a_mapping_batch_for_a_positional_forward_is_refused_naming_both_sides():
    with pytest.raises(ConfigError) as err:
        Trainer(strategy="single", max_steps=1, global_batch_size=8, loss_fn=zoo.nanogpt_loss).fit(zoo.build("nanogpt"), zoo.dataset("llama", 8))
    message = str(err.value)
    assert "NanoGPT.forward(idx" in message and "['input_ids', 'labels']" in message and "model(**batch)" in message


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.fc(features)
        return {"logits": logits, "loss": torch.nn.functional.cross_entropy(logits, labels)}


def test_a_key_the_forward_does_not_take_is_refused():
    data = [{"features": torch.randn(4), "labels": torch.tensor(i % 3), "pixel_values": torch.zeros(1)} for i in range(8)]
    with pytest.raises(ConfigError, match="pixel_values"):
        Trainer(strategy="single", max_steps=1, global_batch_size=8).fit(Classifier(), data)


def test_a_dict_output_with_a_loss_trains_with_no_loss_fn():
    data = [{"features": torch.randn(4), "labels": torch.tensor(i % 3)} for i in range(8)]
    summary = Trainer(strategy="single", max_steps=2, global_batch_size=4, progress_bar=False).fit(Classifier(), data)
    assert summary["steps"] == 2 and summary["train_loss"] > 0


def test_no_loss_anywhere_is_refused_before_launch():
    with pytest.raises(ConfigError, match="no loss"):
        Trainer(strategy="ddp", nproc=2, max_steps=1, global_batch_size=8).fit(zoo.build("nanogpt"), zoo.dataset("nanogpt", 8))


def test_a_model_output_without_loss_says_how_to_get_one():
    data = [{"input_ids": zoo.sample("llama", i)["input_ids"]} for i in range(8)]
    with pytest.raises(ConfigError, match="without a `loss`.*labels"):
        Trainer(strategy="single", max_steps=1, global_batch_size=8, progress_bar=False).fit(zoo.build("llama"), data)
