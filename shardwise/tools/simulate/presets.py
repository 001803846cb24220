"""Two published scaling results, reproduced by `shardwise.tools.simulate.network` from their papers' inputs.

Goyal et al. 2017 (ResNet-50, 8 to 256 GPUs) and Sergeev & Del Balso 2018 (Horovod, 128 GPUs): each
preset states which numbers go in and which comes out to be compared with the paper (scaling
efficiency); nothing is fitted to the published output. The inputs, what was assumed and what
overlap does to them: docs/simulator.md. `tests/tools/simulate/test_simulate_presets.py` holds
both within 10% of the published figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardwise.errors import ConfigError
from shardwise.tools.simulate.network import Exchange, Network, simulate


@dataclass(frozen=True)
class Reproduction:
    """One published figure against the simulation."""

    name: str
    citation: str
    published: float
    simulated: float

    @property
    def relative_error(self) -> float:
        return abs(self.simulated - self.published) / self.published


GOYAL = "Goyal et al. 2017, Accurate, Large Minibatch SGD (arXiv:1706.02677), abstract and section 5.5"
HOROVOD = "Sergeev & Del Balso 2018, Horovod (arXiv:1802.05799), section 5 and figure 6"
IMAGENET_TRAIN = 1_281_167


def goyal_config() -> dict[str, Any]:
    """`simulate` keyword arguments for Goyal et al. 2017 (inputs in the module docstring)."""
    net = Network.from_gbps(50, 10, gpus_per_node=8, intra_gbps=160, intra_latency_us=5)
    exchange = Exchange(algorithm="hierarchical")
    stated_step_s = 29 * 3600 / (90 * IMAGENET_TRAIN / 256)  # the 8-GPU baseline's iteration time
    eight = simulate(8, params=25.5e6, compute_s=1.0, net=net, exchange=exchange, steps=1)
    return {"params": 25.5e6, "compute_s": stated_step_s - eight.exchange_s, "net": net, "exchange": exchange, "batch": 32}


def horovod_config(model: str = "resnet101") -> dict[str, Any]:
    """`simulate` keyword arguments for Horovod's figure 6 (inputs in the module docstring)."""
    params, images_per_s = {"inception_v3": (23.8e6, 142.0), "resnet101": (44.5e6, 125.0)}[model]
    net = Network.from_gbps(25, 25, gpus_per_node=4, intra_gbps=80, intra_latency_us=5)
    return {"params": params, "compute_s": 64 / images_per_s, "net": net, "exchange": Exchange(algorithm="ring"), "batch": 64}


def reproduce(preset: str) -> list[Reproduction]:
    """The published figures of ``preset`` against the simulation (pure: no timing)."""
    if preset == "goyal-2017":
        cfg = goyal_config()
        eight, full = simulate(8, **cfg, steps=4), simulate(256, **cfg, steps=4)
        return [Reproduction("ResNet-50, efficiency 8 -> 256 GPUs", GOYAL, 0.90, full.samples_per_s / 32 / eight.samples_per_s)]
    if preset == "horovod-2018":
        out = []
        for model in ("inception_v3", "resnet101"):
            r = simulate(128, **horovod_config(model), steps=4)
            out.append(Reproduction(f"{model}, ring, efficiency at 128 GPUs", HOROVOD, 0.88, r.efficiency))
        return out
    raise ConfigError(f"--preset {preset!r} is unknown; choose one of {', '.join(PRESETS)}")


def preset_config(preset: str) -> tuple[dict[str, Any], list[int]]:
    """A preset's `simulate` keyword arguments and its paper's worker counts."""
    if preset == "goyal-2017":
        return goyal_config(), [8, 16, 32, 64, 128, 256]
    if preset == "horovod-2018":
        return horovod_config(), [1, 2, 4, 8, 16, 32, 64, 128]
    raise ConfigError(f"--preset {preset!r} is unknown; choose one of {', '.join(PRESETS)}")


PRESETS = ("goyal-2017", "horovod-2018")
