"""The CUDA path on one GPU: what CI, which has no GPU, cannot run.

Run on a machine with a GPU: ``python -m pytest -m gpu tests``. Every test here is skipped
where torch sees no CUDA device. On one GPU:

- ``single`` on CUDA trains each model of the zoo (Llama, GPT-2, BERT, ViT, ResNet, nanoGPT) to
  the same float64 parameters as on the CPU;
- ``ddp``, ``zero2`` and ``zero3`` joined over NCCL (one process) match ``single``;
- ``bf16-mixed`` on CUDA is the loop a user writes with ``torch.autocast(bfloat16)``, float32
  parameters kept;
- asking for more processes than there are GPUs is refused before anything starts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardwise import Trainer, launch
from shardwise.errors import ConfigError
from shardwise.trainer.callbacks import Callback
from tests.support import harness, zoo

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("transformers", reason="the model tests need transformers: pip install -e '.[dev]'")


class Where(Callback):
    """Notes the device the engine trains on and the process group's backend."""

    seen: list[tuple[str, str]] = []

    def on_train_step_end(self, trainer: Any, engine: Any, step: int, loss: Any) -> None:
        Where.seen.append((engine.device.type, dist.get_backend() if dist.is_initialized() else "none"))


def _cpu(state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    assert state is not None
    return {k: v.detach().cpu() for k, v in state.items()}


@pytest.mark.parametrize("name", zoo.MODELS)
def test_single_on_cuda_trains_the_cpu_parameters_in_float64(name: str) -> None:
    Where.seen.clear()
    _, on_gpu = harness.train(name, accelerator="cuda", callbacks=[Where()])
    assert Where.seen and {d for d, _ in Where.seen} == {"cuda"}, Where.seen
    _, on_cpu = harness.train(name, accelerator="cpu")
    diff = harness.max_difference(_cpu(on_gpu), _cpu(on_cpu))
    assert diff <= 1e-8, f"{name}: CUDA float64 differs from the CPU by {diff:.3g}"
    moved = harness.max_difference(_cpu(on_cpu), zoo.build(name).state_dict(), integers=False)
    assert moved > 1e-4, f"{name}: training did not move the parameters ({moved:.3g})"


def _nccl_cells(names: list[str], strategies: list[str]) -> dict[tuple[str, str], tuple[dict[str, torch.Tensor], str, str]]:
    out = {}
    for name in names:
        for strategy in strategies:
            Where.seen.clear()
            _, state = harness.train(name, strategy, accelerator="cuda", callbacks=[Where()])
            device, backend = Where.seen[-1]
            out[(name, strategy)] = (_cpu(state), device, backend)
    return out


def test_data_parallel_strategies_over_nccl_match_single() -> None:
    names, strategies = ["llama", "gpt2", "nanogpt"], ["ddp", "zero2", "zero3"]
    results = launch(_nccl_cells, names, strategies, nproc=1, accelerator="cuda", timeout=600)[0]
    for name in names:
        ref = _cpu(harness.train(name, accelerator="cuda")[1])
        for strategy in strategies:
            state, device, backend = results[(name, strategy)]
            assert (device, backend) == ("cuda", "nccl"), (name, strategy, device, backend)
            diff = harness.max_difference(state, ref)
            assert diff <= 1e-9, f"{name} {strategy} over NCCL: largest parameter difference from single {diff:.3g}"


class Spy(torch.utils.data.Dataset):
    """Records the indices the Trainer reads, so the hand loop reads the same ones."""

    def __init__(self, inner: Any, seen: list[int]) -> None:
        self.inner, self.seen = inner, seen

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        self.seen.append(int(i))
        return self.inner[i]


def _first_linear_dtypes(model: torch.nn.Module, seen: list[torch.dtype]) -> None:
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda mod, args, out: seen.append(out.dtype) if torch.is_grad_enabled() else None)


@pytest.mark.parametrize("name", ["llama", "gpt2", "nanogpt"])
def test_bf16_mixed_on_cuda_is_the_hand_written_autocast_loop(name: str) -> None:
    steps, batch = 4, 4
    seen: list[int] = []
    dtypes: list[torch.dtype] = []
    model = zoo.build(name, dtype=torch.float32)
    _first_linear_dtypes(model, dtypes)
    Trainer(
        strategy="single",
        accelerator="cuda",
        precision="bf16-mixed",
        global_batch_size=batch,
        max_steps=steps,
        progress_bar=False,
        seed=0,
        loss_fn=zoo.loss_fn(name),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
    ).fit(model, Spy(zoo.dataset(name, steps * batch), seen))
    assert dtypes and set(dtypes) == {torch.bfloat16}, f"{name}: the Linear's output under bf16-mixed was {set(dtypes)}"
    assert all(p.dtype == torch.float32 for p in model.parameters()), "bf16-mixed keeps float32 parameters"
    order = seen[-steps * batch :]  # the parent reads sample 0 once to check the batch fits the forward

    hand = zoo.build(name, dtype=torch.float32).cuda()
    opt = torch.optim.AdamW(hand.parameters(), lr=1e-3)
    data = zoo.dataset(name, steps * batch)
    for step in range(steps):
        b = torch.utils.data.default_collate([data[i] for i in order[step * batch : (step + 1) * batch]])
        b = {k: v.cuda() for k, v in b.items()} if isinstance(b, dict) else [v.cuda() for v in b]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = zoo.hf_loss(hand, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
    start = zoo.build(name, dtype=torch.float32).state_dict()
    ours, theirs = _cpu(model.state_dict()), _cpu(hand.state_dict())
    moved = harness.max_difference(theirs, start, integers=False)
    diff = harness.max_difference(ours, theirs)
    assert moved > 1e-3, f"{name}: the hand loop did not move the parameters ({moved:.3g})"
    assert diff <= 1e-5, f"{name}: bf16-mixed differs from torch.autocast by hand by {diff:.3g} (the steps moved parameters by {moved:.3g})"


def test_more_processes_than_gpus_is_refused_before_anything_starts(tmp_path: Any) -> None:
    gpus = torch.cuda.device_count()
    trainer = Trainer(strategy="ddp", nproc=gpus + 1, max_steps=1, out=str(tmp_path / "run"), loss_fn=zoo.nanogpt_loss)
    with pytest.raises(ConfigError, match=f"nproc={gpus + 1} processes on this machine, but torch sees {gpus} CUDA device"):
        trainer.fit(zoo.build("nanogpt"), zoo.dataset("nanogpt", 8))
    assert not (tmp_path / "run").exists()
