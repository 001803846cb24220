"""A hand-written model whose own code reads a submodule's weight outside that submodule (a head tied by
``x @ self.transformer.wte.weight.t()`` in the root's forward) trains under zero3 exactly as under single:
the embedding is not made an FSDP unit of its own (it would be sharded where the root reads it, and the
step fails after launch with DTensor's "mixed torch.Tensor and DTensor"); a wrap that names it is refused
before launch, naming the read."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.strategies.sharded.reads import reads_outside
from shardwise.strategies.sharded.units import auto_wrap_units, resolve_units
from tests.support import harness, zoo


def test_the_read_is_found_in_the_source_and_the_read_module_stays_with_the_root() -> None:
    model = zoo.build("nanogpt_fhead")
    assert reads_outside(model) == {"transformer.wte": "NanoGPTFunctionalHead.forward reads transformer.wte.weight"}
    units = auto_wrap_units(model)
    assert units == [f"transformer.h.{i}" for i in range(4)]
    # its own code reading its own weight (LayerNorm's F.layer_norm(x, self.weight.shape, self.weight)) is no read outside
    assert reads_outside(zoo.build("nanogpt")) == {}


def test_a_wrap_naming_a_module_read_outside_it_is_refused_with_the_read() -> None:
    with pytest.raises(ConfigError, match=r"'transformer.wte' cannot be a unit.*NanoGPTFunctionalHead.forward reads transformer.wte.weight.*wrap='auto'"):
        resolve_units(zoo.build("nanogpt_fhead"), ["transformer.wte", "transformer.h.0"])


def test_metadata_reads_and_init_code_are_not_reads() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.inner.weight.data.zero_()  # construction: runs before sharding

        def reset_parameters(self) -> None:
            nn.init.ones_(self.inner.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert x.shape[-1] == self.inner.weight.shape[1]  # a shape is the same sharded or whole
            return self.inner(x)

    assert reads_outside(Net()) == {}


def test_zero3_trains_the_functional_head_model_exactly_as_single() -> None:
    cells = [("nanogpt_fhead", "zero3", {})]
    results = harness.run_cells(cells)
    _, state = harness.result(results, cells[0])
    harness.assert_matches_single("nanogpt_fhead", state, what="zero3")
