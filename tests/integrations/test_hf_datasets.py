"""Hugging Face ``datasets`` as a training source (issue 41, item 4), from files the tests write (no download).

A map-style ``datasets.Dataset`` (``with_format("torch")``) trains under ddp at world size 2 to the weights of
the same data as a TensorDataset (bitwise: the same global batches, the same float64 arithmetic). A streaming
one (``load_dataset("json", data_files=..., streaming=True)``, 3 shards) trains under ddp at world size 2:
stopped at step 3 and resumed to 6, bitwise equal to 6 steps uninterrupted; what each rank read is
``split_dataset_by_node(ds, rank, 2)`` (3 shards on 2 ranks: HF strides, as shardwise does). Where HF would
split by shard (4 shards on 2 ranks) shardwise still strides, which keeps every global batch the same set of
samples at any world size. All of it in one launch of two processes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from shardwise import Trainer, launch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # at import, in the test process and in each launched rank: nothing online
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.dist

N, FEATURES, CLASSES = 60, 4, 3
GLOBAL_BATCH = 8


def _rows(first: int, n: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(first)
    x = torch.randn(n, FEATURES, generator=g)
    return [{"id": first + i, "x": x[i].tolist(), "y": int(x[i, 0] > 0) + int(x[i, 1] > 0)} for i in range(n)]


def write_jsonl(directory: Path, shards: int, per_shard: int) -> list[str]:
    """``shards`` JSON lines files of ``per_shard`` rows each; row ids run 0.. across the files in order."""
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for s in range(shards):
        path = directory / f"part-{s:03d}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in _rows(s * per_shard, per_shard)))
        files.append(str(path))
    return files


class Classifier(nn.Module):
    """Takes a tuple batch's ``x`` or a dict batch's ``x`` (and its ``y``/``id``); records the ids it trained on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES)).double()
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, id: torch.Tensor | None = None) -> torch.Tensor:  # noqa: A002
        if self.training and id is not None:
            self.seen.extend(int(i) for i in id)
        return self.net(x)  # type: ignore[no-any-return]


def loss_fn(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(out, batch["y"] if isinstance(batch, dict) else batch[1])


def trainer(**settings: Any) -> Trainer:
    base: dict[str, Any] = dict(
        strategy="ddp", global_batch_size=GLOBAL_BATCH, precision="64", log_every=3, progress_bar=False, model_summary=False, timeout_s=120
    )
    return Trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), loss_fn=loss_fn, **{**base, **settings})


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def map_style(files: list[str]) -> dict[str, Any]:
    """A map-style HF Dataset and the same rows as tensors, 2 epochs (the last partial batch dropped)."""
    hf = datasets.load_dataset("json", data_files=files, split="train").select_columns(["x", "y"]).with_format("torch")
    rows = [r for f in files for r in map(json.loads, Path(f).read_text().splitlines())]
    tensors = TensorDataset(torch.tensor([r["x"] for r in rows]), torch.tensor([r["y"] for r in rows]))
    out: dict[str, Any] = {}
    for name, data in (("hf", hf), ("tensors", tensors)):
        model = Classifier()
        summary = trainer(max_steps=12).fit(model, data)
        out[name] = (weights(model), summary["steps"])
    return out


def _in_workers(root: str, files: list[str]) -> dict[str, Any]:
    return {"map": map_style(files)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("hf")
    files = write_jsonl(root / "three", shards=3, per_shard=N // 3)
    return root, launch(_in_workers, str(root), files, nproc=2, threads_per_proc=1)


def test_a_map_style_hf_dataset_trains_as_the_same_tensors(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = runs
    for rank in range(2):
        (hf, hf_steps), (tensors, steps) = results[rank]["map"]["hf"], results[rank]["map"]["tensors"]
        assert hf_steps == steps == 12
        for k in tensors:
            assert torch.equal(hf[k], tensors[k]), k
