"""Process groups as values: a `Mesh` of named parallel dimensions.

A mesh is built from the world size and the degrees a user asks for (data,
pipeline, tensor, ...), validated before any process group is touched, and passed
explicitly to whatever needs a group; there is no module-level group manager.
Dimensions are laid out outermost first (``dp x pp x cp x tp``), so the tensor-parallel
ranks, which talk the most, are neighbours (same machine first), and the context-parallel
ranks (a ring over the sequence) next to them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch

from shardwise.comm.collectives import WORLD, Group
from shardwise.errors import ConfigError

DIM_ORDER = ("dp", "pp", "cp", "tp")
SHAPE_DIMS = ("dp", "pp", "tp")
"""The dimensions `valid_shapes` lists by default (cp is asked for by name, never proposed)."""


def valid_shapes(world_size: int, dims: tuple[str, ...] = SHAPE_DIMS) -> list[dict[str, int]]:
    """Every assignment of degrees to ``dims`` whose product is ``world_size``."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return [dict(zip(dims, combo, strict=True)) for combo in itertools.product(divisors, repeat=len(dims)) if prod(combo) == world_size]


@dataclass(frozen=True)
class Mesh:
    """This rank's view of the job: world size, rank, device, and named dimensions.

    >>> m = Mesh.build(world_size=4, rank=0, tp=2)
    >>> m.degrees
    {'dp': 2, 'pp': 1, 'tp': 2}
    """

    world_size: int
    rank: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    degrees: dict[str, int] = field(default_factory=dict)
    _groups: dict[str, Group] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def build(*, world_size: int, rank: int = 0, device: torch.device | None = None, dp: int | None = None, pp: int = 1, tp: int = 1, cp: int = 1) -> Mesh:
        """Validate the degrees and return the mesh; ``dp`` defaults to what is left. ``cp`` (context
        parallel) appears in ``degrees`` only when > 1."""
        for name, deg in (("pp", pp), ("cp", cp), ("tp", tp)):
            if not isinstance(deg, int) or deg < 1:
                raise ConfigError(f"{name} degree must be a whole number >= 1; got {deg!r}")
        cp_text = f" x cp {cp}" if cp > 1 else ""
        if dp is None:
            if world_size % (pp * cp * tp):
                raise ConfigError(f"world size {world_size} is not divisible by pp {pp}{cp_text} x tp {tp}; valid shapes: " + _shapes_text(world_size))
            dp = world_size // (pp * cp * tp)
        if dp * pp * cp * tp != world_size:
            raise ConfigError(
                f"degrees dp {dp} x pp {pp}{cp_text} x tp {tp} = {dp * pp * cp * tp} do not multiply to the world size {world_size}; "
                f"valid shapes: {_shapes_text(world_size)}"
            )
        degrees = dict(zip(DIM_ORDER, (dp, pp, cp, tp), strict=True))
        if cp == 1:
            del degrees["cp"]
        return Mesh(world_size=world_size, rank=rank, device=device or torch.device("cpu"), degrees=degrees)

    def fold_cp(self) -> Mesh:
        """This mesh with ``cp`` folded into ``dp`` (``dp x cp`` ranks as one data-parallel dimension):
        the mesh a data- or tensor-parallel strategy runs on under context parallelism, where the
        gradients of the cp ranks' shares of a sequence are averaged with the data-parallel ranks'.
        Needs pp 1 (dp and cp are then adjacent); the same mesh without cp."""
        if self.size("cp") == 1:
            return self
        if self.size("pp") > 1:
            raise ConfigError(f"context parallelism with a pipeline (pp {self.size('pp')}) is not supported; use pp=1 with cp > 1")
        degrees = dict(zip(SHAPE_DIMS, (self.size("dp") * self.size("cp"), 1, self.size("tp")), strict=True))
        return Mesh(world_size=self.world_size, rank=self.rank, device=self.device, degrees=degrees)

    def size(self, dim: str) -> int:
        return self.degrees.get(dim, 1)

    def coordinate(self, dim: str) -> int:
        """This rank's index along ``dim`` (ranks are laid out dp-major, tp fastest)."""
        names = [d for d in DIM_ORDER if d in self.degrees]
        stride = 1
        for d in reversed(names):
            if d == dim:
                return (self.rank // stride) % self.degrees[d]
            stride *= self.degrees[d]
        return 0

    def group(self, dim: str) -> Group:
        """The group of ranks that differ only along ``dim`` (built on first use)."""
        if dim not in self.degrees:
            raise KeyError(f"mesh has no dimension {dim!r}; it has {list(self.degrees)}")
        if self.size(dim) == self.world_size:
            return Group(dim, WORLD.pg)
        if dim not in self._groups:
            self._groups[dim] = Group(dim, self._device_mesh()[dim].get_group())
        return self._groups[dim]

    def device_mesh(self, *dims: str) -> Any:
        """torch's ``DeviceMesh`` over one or more of this mesh's dimensions (``mesh.device_mesh("dp")``,
        ``mesh.device_mesh("dp", "tp")``), for DTensor, FSDP2 and tensor parallelism; collective on first use."""
        if not dims:
            return self._device_mesh()
        unknown = [d for d in dims if d not in self.degrees]
        if unknown:
            raise KeyError(f"mesh has no dimension {unknown[0]!r}; it has {list(self.degrees)}")
        full = self._device_mesh()
        return full[dims[0]] if len(dims) == 1 else full[tuple(dims)]

    def _device_mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        if "_mesh" not in self._groups:
            names = tuple(d for d in DIM_ORDER if d in self.degrees)
            shape = tuple(self.degrees[d] for d in names)
            self._groups["_mesh"] = init_device_mesh(self.device.type, shape, mesh_dim_names=names)  # type: ignore[assignment]
        return self._groups["_mesh"]


def _shapes_text(world_size: int) -> str:
    return ", ".join("x".join(f"{k}{v}" for k, v in s.items()) for s in valid_shapes(world_size))
