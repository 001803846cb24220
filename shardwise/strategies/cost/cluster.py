"""Device profiles and clusters: memory, compute speed and links, as the cost model sees them.

A link is the alpha-beta (latency-bandwidth) model of Hockney ("The communication challenge
for MPP: Intel Paragon and Meiko CS-2", Parallel Computing 20(3), 1994), used per round of a
collective as in Thakur, Rabenseifner & Gropp ("Optimization of Collective Communication
Operations in MPICH", IJHPCA 19(1), 2005): a round that sends ``n`` bytes takes
``alpha + n beta``. A collective of ``r`` rounds sending ``N`` bytes in all from one rank takes
``r alpha + N beta``.

Built-in profiles (vendor datasheet figures; dense, no sparsity):

- ``h100-80gb``: NVIDIA H100 SXM5 80GB datasheet (2023): 989 TFLOPS bf16 dense tensor core
  (1979 with sparsity), 67 TFLOPS fp32 (non-tensor), 80 GB HBM3 at 3.35 TB/s; NVLink 4 at
  900 GB/s total bidirectional per GPU, so 450 GB/s each way; one ConnectX-7 NDR InfiniBand port
  per GPU at 400 Gb/s = 50 GB/s each way (NVIDIA DGX H100 datasheet). TF32 tensor core 494 TFLOPS dense
  (989 with sparsity).
- ``h200``: NVIDIA H200 Tensor Core GPU datasheet (2024), SXM: 989 TFLOPS bf16 dense tensor core (1979
  with sparsity), TF32 494 dense, 67 TFLOPS fp32 (non-tensor), 141 GB HBM3e at 4.8 TB/s; NVLink at
  900 GB/s bidirectional (450 GB/s each way); the network as the H100's (one NDR port per GPU).
- ``a100-40gb``: NVIDIA A100 Tensor Core GPU datasheet (2021), SXM4 40GB: 312 TFLOPS bf16
  dense, 19.5 TFLOPS fp32, 40 GB HBM2 at 1.555 TB/s; NVLink 3 at 600 GB/s bidirectional (300 GB/s
  each way); one HDR InfiniBand port per GPU at 200 Gb/s = 25 GB/s each way (DGX A100 datasheet). TF32
  tensor core 156 TFLOPS dense.
- ``cpu``: this machine, measured by ``shardwise plan --calibrate`` (profiles/cpu.json).

The latencies (NVLink 3 us, InfiniBand 6 us per round, including software) and the fraction of
peak a training step reaches (``efficiency`` 0.5; Narayanan et al. 2021 report 52% of peak for
GPT models on A100) are assumptions, not datasheet figures, and are marked as such in the files.

A profile is a TOML or JSON file with the fields of `DeviceProfile`; ``--device PATH`` reads one
and a missing field is a `ConfigError` naming it.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PROFILES_DIR = Path(__file__).with_name("profiles")


@dataclass(frozen=True)
class Link:
    """One link class: seconds per round (``alpha``) and per byte (``beta``)."""

    alpha: float
    """Latency of one round, seconds."""
    beta: float
    """Seconds per byte (1 / bandwidth each way)."""

    def time(self, rounds: float, nbytes: float) -> float:
        return rounds * self.alpha + nbytes * self.beta


@dataclass(frozen=True)
class Framework:
    """What one strategy costs per step on top of its model's compute and its collectives' alpha-beta
    time: ``step_s + per_unit_s * units + per_param_s * params + per_compute * compute_s`` (units:
    `shardwise.strategies.cost.estimate.framework_units`; params: the rank's share of the model before any
    data-parallel sharding). Hooks, Python, the launch of each collective, waits the alpha-beta model
    does not see, work over every gradient or weight element (DDP's bucket copies and averaging, a
    codec's encode and decode, ZeRO-1's sharded step), and the compute slowed by work running beside it
    (tensor parallelism's and a pipeline's on activations, FSDP's gathers around each unit); measured by
    ``shardwise plan --calibrate`` on this machine (`shardwise.tools.advisor.calibrate_framework.scaling`
    says which of the two last terms a key has), empty on the datasheet profiles."""

    step_s: float
    per_unit_s: float = 0.0
    per_compute: float = 0.0
    """Seconds added per second of the rank's compute."""
    per_param_s: float = 0.0
    """Seconds added per parameter of the rank's share of the model."""

    def seconds(self, units: float, compute_s: float = 0.0, params: float = 0.0) -> float:
        return self.step_s + self.per_unit_s * units + self.per_compute * compute_s + self.per_param_s * params


@dataclass(frozen=True)
class DeviceProfile:
    """One device kind and the links between devices of that kind."""

    name: str
    memory_bytes: float
    """Memory one process may use (device memory; the share of host memory on CPU)."""
    flops: Mapping[str, float]
    """Peak FLOP/s per precision (``"32"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"64"``)."""
    efficiency: float
    """Fraction of the peak a training step reaches (1.0 when ``flops`` was measured on training-sized matmuls)."""
    memory_bandwidth: float
    """Bytes/s of device memory (the optimizer step is bound by it)."""
    intra: Link
    """Between processes of one node."""
    inter: Link
    """Between nodes."""
    overlap: float = 1.0
    """Share of the gradient communication that hides behind backward (1: all of it can; 0: none)."""
    host: Link | None = None
    """Between the device and its host's memory (PCIe): what CPU offload moves over. None on a CPU, whose
    host memory is its memory (offload moves nothing there)."""
    step_overhead_s: float = 0.0
    """Fixed seconds each step costs beyond compute and communication (launch, Python, data)."""
    collectives: Mapping[str, Link] = field(default_factory=dict)
    """Fitted links per collective and algorithm (``"all_reduce/ring"``), used on one node instead of ``intra``."""
    source: str = ""
    """Where the figures come from."""
    local: bool = False
    """Measured on this machine (``--calibrate``): a model's own step can be timed here
    (`shardwise.strategies.cost.model_spec.StepFit`) and used instead of FLOPs over FLOP/s."""
    cores: int = 0
    """CPU cores of a machine measured here (0: not a shared-core device). More processes than cores
    on one node share them: `shardwise.strategies.cost.estimate.estimate` stretches the step by ``per_node / cores``."""
    framework: Mapping[str, Framework] = field(default_factory=dict)
    """Per-step cost of each strategy beyond compute and collectives (keys as `shardwise.strategies.cost.estimate.framework_key`)."""
    runtime_baseline_bytes: float = 0.0
    """Resident memory of an interpreter that imported torch, transformers and shardwise (``--calibrate``
    measures it in a fresh process): every process's floor, the first part of `shardwise.strategies.cost.peak`'s
    per-rank prediction. 0 where not measured (and on a GPU, whose memory the runtime does not use)."""

    def flops_for(self, precision: str) -> float:
        if precision in self.flops:
            return float(self.flops[precision])
        if "32" in self.flops:
            return float(self.flops["32"])
        raise ConfigError(f"device profile {self.name!r} has no FLOP/s for precision {precision!r}; add flops.{precision} to it")

    def link(self, key: str, inter_node: bool) -> Link:
        """The link a collective ``key`` (``"all_reduce/ring"``) runs over."""
        if inter_node:
            return self.inter
        if key in self.collectives:
            return self.collectives[key]
        op = key.split("/")[0]
        return self.collectives.get(op, self.intra)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Link):
                v = {"alpha": v.alpha, "beta": v.beta}
            elif f.name == "collectives":
                v = {k: {"alpha": x.alpha, "beta": x.beta} for k, x in v.items()}
            elif f.name == "flops":
                v = dict(v)
            elif f.name == "framework":
                v = {k: {"step_s": x.step_s, "per_unit_s": x.per_unit_s, "per_param_s": x.per_param_s, "per_compute": x.per_compute} for k, x in v.items()}
            out[f.name] = v
        return out


REQUIRED = ("name", "memory_bytes", "flops", "efficiency", "memory_bandwidth", "intra", "inter")

_GB = 1e9
H100_80GB = DeviceProfile(
    name="h100-80gb",
    memory_bytes=80 * _GB,
    flops={"bf16-mixed": 989e12, "16-mixed": 989e12, "32": 67e12, "tf32": 494e12, "64": 34e12},
    efficiency=0.5,
    memory_bandwidth=3.35e12,
    intra=Link(alpha=3e-6, beta=1 / 450e9),
    inter=Link(alpha=6e-6, beta=1 / 50e9),
    overlap=1.0,
    host=Link(alpha=1e-5, beta=1 / 50e9),  # PCIe Gen5 x16: 64 GB/s each way, about 50 reached
    source="NVIDIA H100 SXM5 and DGX H100 datasheets (bf16 989 TFLOPS dense, 80 GB, NVLink 900 GB/s bidirectional, NDR 400 Gb/s per GPU); "
    "latencies and efficiency 0.5 assumed",
)
A100_40GB = DeviceProfile(
    name="a100-40gb",
    memory_bytes=40 * _GB,
    flops={"bf16-mixed": 312e12, "16-mixed": 312e12, "32": 19.5e12, "tf32": 156e12, "64": 9.7e12},
    efficiency=0.5,
    memory_bandwidth=1.555e12,
    intra=Link(alpha=3e-6, beta=1 / 300e9),
    inter=Link(alpha=6e-6, beta=1 / 25e9),
    overlap=1.0,
    host=Link(alpha=1e-5, beta=1 / 25e9),  # PCIe Gen4 x16: 32 GB/s each way, about 25 reached
    source="NVIDIA A100 and DGX A100 datasheets (bf16 312 TFLOPS dense, 40 GB, NVLink 600 GB/s bidirectional, HDR 200 Gb/s per GPU); "
    "latencies and efficiency 0.5 assumed",
)
H200 = replace(  # the H100 SXM5 chip with more and faster memory: the same compute, links and host link
    H100_80GB,
    name="h200",
    memory_bytes=141 * _GB,
    memory_bandwidth=4.8e12,
    source="NVIDIA H200 Tensor Core GPU datasheet, SXM (bf16 989 TFLOPS dense, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s bidirectional); "
    "network as DGX H100 (NDR 400 Gb/s per GPU); latencies and efficiency 0.5 assumed",
)
BUILTIN: dict[str, DeviceProfile] = {"h100-80gb": H100_80GB, "h200": H200, "a100-40gb": A100_40GB}


def _link(raw: Any, where: str) -> Link:
    if not isinstance(raw, Mapping) or "alpha" not in raw or "beta" not in raw:
        raise ConfigError(f"{where} must be a table with alpha (s) and beta (s/byte); got {raw!r}")
    link = Link(alpha=float(raw["alpha"]), beta=float(raw["beta"]))
    if not (math.isfinite(link.alpha) and math.isfinite(link.beta)) or link.alpha < 0 or link.beta <= 0:
        raise ConfigError(f"{where} needs alpha >= 0 and beta > 0 (finite); got alpha={link.alpha}, beta={link.beta}")
    return link


def profile_from_mapping(raw: Mapping[str, Any], where: str = "device profile") -> DeviceProfile:
    """A `DeviceProfile` from a parsed TOML/JSON table; a missing or bad field is a one-line `ConfigError`."""
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"{where} is missing {', '.join(missing)}; a profile needs {', '.join(REQUIRED)} (see shardwise/strategies/cost/cluster.py)")
    flops = raw["flops"]
    if not isinstance(flops, Mapping) or not flops or any(float(v) <= 0 for v in flops.values()):
        raise ConfigError(f'{where}: flops must map precisions to positive FLOP/s (e.g. flops = {{"32" = 1e11}}); got {flops!r}')
    extra = {k: raw[k] for k in ("overlap", "step_overhead_s", "source", "local", "cores", "runtime_baseline_bytes") if k in raw}
    framework = {}
    for key, value in dict(raw.get("framework", {})).items():
        if not isinstance(value, Mapping) or "step_s" not in value:
            raise ConfigError(f"{where}: framework.{key} must be a table with step_s (and per_unit_s, per_param_s, per_compute); got {value!r}")
        framework[str(key)] = Framework(
            float(value["step_s"]), float(value.get("per_unit_s", 0.0)), float(value.get("per_compute", 0.0)), float(value.get("per_param_s", 0.0))
        )
    profile = DeviceProfile(
        name=str(raw["name"]),
        memory_bytes=float(raw["memory_bytes"]),
        flops={str(k): float(v) for k, v in flops.items()},
        efficiency=float(raw["efficiency"]),
        memory_bandwidth=float(raw["memory_bandwidth"]),
        intra=_link(raw["intra"], f"{where}: intra"),
        inter=_link(raw["inter"], f"{where}: inter"),
        collectives={str(k): _link(v, f"{where}: collectives.{k}") for k, v in dict(raw.get("collectives", {})).items()},
        host=_link(raw["host"], f"{where}: host") if raw.get("host") is not None else None,
        framework=framework,
        **extra,
    )
    if profile.memory_bytes <= 0 or not 0 < profile.efficiency <= 1 or profile.memory_bandwidth <= 0 or not 0 <= profile.overlap <= 1:
        raise ConfigError(f"{where}: memory_bytes and memory_bandwidth must be > 0, efficiency in (0, 1], overlap in [0, 1]")
    return profile


def load_profile(spec: str) -> DeviceProfile:
    """A built-in profile by name (``h100-80gb``, ``h200``, ``a100-40gb``, ``cpu``) or a ``.toml`` / ``.json`` file."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    path = PROFILES_DIR / f"{spec}.json" if spec == "cpu" else Path(spec)
    if spec == "cpu" and not path.exists():
        raise ConfigError("no measured cpu profile yet; run `shardwise plan --calibrate` to measure this machine")
    if not path.exists():
        names = ", ".join([*BUILTIN, "cpu"])
        raise ConfigError(f"unknown device {spec!r}: not a built-in profile ({names}) nor an existing .toml/.json file")
    try:
        raw = tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"device profile {str(path)!r} does not parse: {exc}") from None
    return profile_from_mapping(raw, f"device profile {str(path)!r}")


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``per_node`` processes on one device kind."""

    device: DeviceProfile
    nproc: int
    nodes: int = 1
    threads: int = 0
    """Intra-op threads each process runs; 0: `shardwise.launch`'s own count, ``cores // per_node`` (at least 1)."""
    load: float = 0.0
    """Other work's runnable threads on each node (``os.getloadavg``'s 1-minute figure, where planned for
    this machine): on a profile with ``cores`` it takes its share of them (`shared`)."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1; got {self.nproc}")
        if self.nodes < 1 or self.nproc % self.nodes:
            raise ConfigError(f"--nodes {self.nodes} must be >= 1 and divide --nproc {self.nproc}; choose nodes that split the processes evenly")
        if self.threads < 0 or not (math.isfinite(self.load) and self.load >= 0):
            raise ConfigError(f"threads must be >= 0 and the load a finite number >= 0; got threads {self.threads}, load {self.load}")

    @property
    def per_node(self) -> int:
        return self.nproc // self.nodes

    @property
    def threads_per_process(self) -> int:
        """`threads`, or the launcher's: each process gets an equal share of the cores, at least one."""
        if self.threads:
            return self.threads
        return max(1, self.device.cores // self.per_node) if self.device.cores else 1

    def shared(self, timed_threads: int) -> float:
        """How much longer each process's step takes than a step timed alone with ``timed_threads`` threads
        under the same load: the node's runnable threads (its processes' and the other work's) over its
        cores, against the same for the timing (1 where the cores are enough for both). A machine without
        ``cores`` (a datasheet device: a process owns its device) shares nothing."""
        cores = self.device.cores
        if not cores:
            return 1.0
        run = max(1.0, (self.per_node * self.threads_per_process + self.load) / cores)
        return run / max(1.0, (timed_threads + self.load) / cores)

    def free_cores(self) -> int:
        """The cores the other work (`load`) leaves idle, rounded, at least one (all of them on a datasheet device)."""
        cores = self.device.cores
        return max(1, math.floor(cores - self.load + 0.5)) if cores else 1

    def spans_nodes(self, group_size: int, stride: int = 1) -> bool:
        """Whether a group of ``group_size`` ranks ``stride`` apart (rank-major layout) crosses a node boundary."""
        return group_size > 1 and group_size * stride > self.per_node
