"""Every strategy family against the hand-written PyTorch it wraps, side by side in one run.

For each family the same model (charlm's GPT, ``--d-model`` wide, ``--layers`` blocks), data
(charlm's windows of Python's documentation, as one tensor), seed, optimizer (AdamW), global
batch and number of steps run twice in the same launched processes: once through
``shardwise.Trainer`` and once through the torch calls it stands on, written out by hand as a
careful user would (the same order of samples: epoch ``e``'s permutation seeded ``(seed, e)``,
rank ``r`` taking the ``r``-th slice of each global batch; a loss allreduced every 20 steps):

=========== ======================================================================== =======
family      hand-written                                                              ranks
=========== ======================================================================== =======
control     the hand loop of ``single`` against itself: the noise floor of this machine   1
single      the model itself (the Trainer's loop against a plain loop, one process)   1
ddp         ``DistributedDataParallel``                                               2
zero1       ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer``                 2
zero2       ``fully_shard(reshard_after_forward=False)`` per block and the root,      2
            resharding after backward off, parameters gathered after each step
zero3       ``fully_shard`` per block and the root                                    2
hsdp        ``fully_shard`` on a 2 x 2 ``(replicate, shard)`` DeviceMesh              4
tp          ``parallelize_module``: q, k, v, fc colwise, proj rowwise, the            2
            attention's input made one replicated DTensor (``PrepareModuleInput``)
pipeline    ``PipelineStage`` + ``Schedule1F1B``, 2 stages, 4 micro-batches            2
local-sgd   each rank steps alone; one allreduce of the parameters every 8 steps       2
=========== ======================================================================== =======

(``ps`` and ``central`` need server ranks and their own wire protocol: no short hand-written
equivalent, so they are not in the table.)

Each row's pair runs ``--repeats`` times, alternating which side goes first, inside one launch
(so process start is out of it). Two measures, each side's slowest rank: ``step``, the median
time between the ends of consecutive steps (the first step left out; robust to the few slow
steps a shared virtual machine deals out), as the median of the per-pair ratios; and ``loop``,
the whole training loop (first step, logging and all), as the ratio of the medians. The final losses of
both sides are printed: they agree to float32 round-off (a different loss means the two
sides did not train the same thing and the row is not a comparison).

``--whole`` adds a second table: the whole process (``python -c`` that trains with 2 processes
and exits) for ``ddp`` and the other families named by ``--whole-families``: ``Trainer(nproc=2)``
(its ranks forked from the launcher's zygote, and with ``start_method="spawn"``: fresh
interpreters) against the hand-written loop in interpreters started by hand, under
``torch.multiprocessing.spawn`` and under torchrun, interleaved likewise; wall and CPU seconds.

    python benchmarks/families.py [--families ddp zero3 tp pipeline ...] [--steps 30] [--repeats 3] [--whole]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.trainer.callbacks import Callback

FAMILIES = ("control", "single", "ddp", "zero1", "zero2", "zero3", "hsdp", "tp", "pipeline", "local-sgd")
RANKS = {"control": 1, "single": 1, "hsdp": 4}
LOG_EVERY = 20
SYNC_EVERY = 8
MICROBATCHES = 4


def settings(args: Any) -> dict[str, Any]:
    return {
        "d_model": args.d_model,
        "layers": args.layers,
        "batch": args.batch,
        "block": args.block,
        "steps": args.steps,
        "accelerator": args.accelerator,
        "precision": args.precision,
    }


def device(s: dict[str, Any]) -> torch.device:
    """This rank's device: its GPU of the local rank under ``--accelerator cuda``, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if s.get("accelerator") == "cuda" else torch.device("cpu")


def autocast(s: dict[str, Any]) -> Any:
    """What ``precision='bf16-mixed'`` means by hand: bfloat16 autocast, float32 parameters."""
    if s.get("precision") == "bf16-mixed":
        return torch.autocast(device(s).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ---------------------------------------------------------------- shared parts (both sides)


def data(block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    from shardwise.tools.recipes.charlm import load_charlm_split

    vocab, train, _ = load_charlm_split(block)
    x = torch.stack([train[i][0] for i in range(len(train))])
    y = torch.stack([train[i][1] for i in range(len(train))])
    return x, y, len(vocab)


def model(vocab: int, s: dict[str, Any]) -> torch.nn.Module:
    from shardwise.tools.recipes.charlm import CharGPT

    torch.manual_seed(0)
    return CharGPT(vocab, s["block"], s["d_model"], 4, s["layers"])


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def batch_loss(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    return lm_loss(logits, batch[1])


def batches(x: torch.Tensor, y: torch.Tensor, batch: int, steps: int, part: int, parts: int) -> Any:
    """The global batches the Trainer draws (epoch e: randperm seeded seed * 1_000_003 + e, seed 0),
    this rank's ``part`` of ``parts`` contiguous slices of each."""
    per = batch // parts
    step, epoch = 0, 0
    while True:
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for i in range(len(x) // batch):
            idx = perm[i * batch + part * per : i * batch + (part + 1) * per]
            yield x[idx], y[idx]
            step += 1
            if step == steps:
                return
        epoch += 1


def log_loss(recent: list[torch.Tensor], group: Any = None) -> float:
    """The mean of the recent losses over the replicas, as a number (every LOG_EVERY steps and at the end)."""
    mean = torch.stack(recent).mean().reshape(1)
    recent.clear()
    dist.all_reduce(mean, group=group)
    return mean.item() / dist.get_world_size(group)


# ---------------------------------------------------------------- the hand-written side


def hand(family: str, s: dict[str, Any]) -> tuple[float, float]:
    """(seconds of the training loop, last logged loss) of the hand-written loop, on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    x, y, vocab = data(s["block"])
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model(vocab, s).to(device(s))
    logged: float | None = None
    if family == "pipeline":
        return hand_pipeline(net, x, y, s)
    if family == "tp":
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(device(s).type, (world,))
        for block in net.blocks:
            parallelize_module(
                block,
                mesh,
                {
                    "attn": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
                    "attn.q": ColwiseParallel(),
                    "attn.k": ColwiseParallel(),
                    "attn.v": ColwiseParallel(),
                    "attn.proj": RowwiseParallel(),
                    "mlp.fc": ColwiseParallel(),
                    "mlp.proj": RowwiseParallel(),
                },
            )
        part, parts = 0, 1  # every tp rank reads the whole batch
    else:
        part, parts = rank, world
    if family in ("zero2", "zero3", "hsdp"):
        from torch.distributed.fsdp import fully_shard

        kind = device(s).type
        mesh = init_device_mesh(kind, (2, world // 2), mesh_dim_names=("replicate", "shard")) if family == "hsdp" else init_device_mesh(kind, (world,))
        reshard = family != "zero2"
        for block in net.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(net, mesh=mesh, reshard_after_forward=reshard)
        units = [*net.blocks, net]
        if family == "zero2":
            net.set_reshard_after_backward(False)
    if family in ("ddp", "zero1"):
        net = torch.nn.parallel.DistributedDataParallel(net)
    if family == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    else:
        opt = optimizer(net.parameters())
    recent: list[torch.Tensor] = []
    on = device(s)
    start = time.perf_counter()
    for step, (xb, yb) in enumerate(batches(x, y, s["batch"], s["steps"], part, parts), 1):
        xb, yb = xb.to(on, non_blocking=True), yb.to(on, non_blocking=True)
        with autocast(s):
            loss = lm_loss(net(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if family == "zero2":  # ZeRO-2: the updated shards are gathered again for the next step
            for unit in units:
                unit.reshard()
            for unit in units:
                unit.unshard()
        if family == "local-sgd" and step % SYNC_EVERY == 0:
            with torch.no_grad():
                flat = torch.cat([p.reshape(-1) for p in net.parameters()])
                dist.all_reduce(flat)
                flat /= world
                torch.nn.utils.vector_to_parameters(flat, net.parameters())
        recent.append(loss.detach())
        STEP_ENDS.append(time.perf_counter())
        if step % LOG_EVERY == 0 or step == s["steps"]:
            logged = log_loss(recent)
    return time.perf_counter() - start, float(logged if logged is not None else float("nan"))


def hand_pipeline(net: Any, x: torch.Tensor, y: torch.Tensor, s: dict[str, Any]) -> tuple[float, float]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank = dist.get_rank()
    half = len(net.blocks) // 2

    class First(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.blocks = net.embed, torch.nn.ModuleList(net.blocks[:half])

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            h = self.embed(idx)
            for b in self.blocks:
                h = b(h)
            return h

    class Last(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks, self.head = torch.nn.ModuleList(net.blocks[half:]), net.head

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                h = b(h)
            return self.head(h)

    stage_mod = First() if rank == 0 else Last()
    stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=lm_loss)
    opt = optimizer(stage_mod.parameters())
    recent: list[torch.Tensor] = []
    logged = float("nan")
    start = time.perf_counter()
    for step, (xb, yb) in enumerate(batches(x, y, s["batch"], s["steps"], 0, 1), 1):
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(xb)
        else:
            schedule.step(target=yb, losses=losses)
            recent.append(torch.stack(losses).mean().detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        STEP_ENDS.append(time.perf_counter())
        if step % LOG_EVERY == 0 or step == s["steps"]:
            mean = torch.stack(recent).mean().reshape(1) if recent else torch.zeros(1)
            recent.clear()
            dist.broadcast(mean, src=1)
            logged = mean.item()
    return time.perf_counter() - start, logged


# ---------------------------------------------------------------- the shardwise side


class StepClock(Callback):
    """Notes the end of every training step (the hand loops note theirs at the same point)."""

    def on_train_step_end(self, trainer: Any, engine: Any, step: int, loss: Any) -> None:
        STEP_ENDS.append(time.perf_counter())


STEP_ENDS: list[float] = []


def step_s() -> float:
    """The median step of the last run (from the ends noted; the first step, with its one-time work, left out)."""
    gaps = [b - a for a, b in zip(STEP_ENDS, STEP_ENDS[1:], strict=False)]
    return statistics.median(gaps)


def ours(family: str, s: dict[str, Any], nproc: int | None = None, quiet: bool = True, start_method: str = "forkserver") -> tuple[float, float]:
    """(seconds of the training loop, last logged loss) of ``shardwise.Trainer`` on the same work
    (``start_method``: the ranks forked from the launcher's zygote, or ``"spawn"``, fresh interpreters)."""
    from torch.utils.data import TensorDataset

    import shardwise

    x, y, vocab = data(s["block"])
    options: dict[str, Any] = {
        "tp": {"tp": 2},
        "pipeline": {"pp": 2, "microbatches": MICROBATCHES, "schedule": "1f1b"},
        "hsdp": {"replicate": 2},
        "local-sgd": {"sync_every": SYNC_EVERY},
    }.get(family, {})
    trainer = shardwise.Trainer(
        strategy=family,
        strategy_options=options,
        global_batch_size=s["batch"],
        max_steps=s["steps"],
        log_every=LOG_EVERY,
        optimizer=optimizer,
        loss_fn=batch_loss,
        progress_bar=False,
        model_summary=False,
        announce_outputs=False,
        callbacks=[StepClock()],
        accelerator=s.get("accelerator", "cpu"),
        precision=s.get("precision", "32"),
        start_method=start_method,
        **({"nproc": nproc} if nproc else {}),
    )
    with contextlib.ExitStack() as stack:
        if quiet:  # the Trainer's own lines would break up the table
            stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
        summary = trainer.fit(model(vocab, s), TensorDataset(x, y))
    return float(summary["train_s"]), float(summary["train_loss"])


def pair(family: str, s: dict[str, Any], repeats: int) -> list[tuple[float, ...]]:
    """Inside each launched rank: (hand s, ours s, hand loss, ours loss) per repeat, alternating the order."""
    torch.set_num_threads(1)
    warm = {**s, "steps": min(s["steps"], 3)}
    control = family == "control"  # the hand loop against itself: how far apart two identical runs land here
    family = "single" if control else family
    hand(family, warm), ours(family, warm)  # first calls (imports, lazy initialisation) out of the timed pairs
    out = []
    for i in range(repeats):
        got: dict[str, tuple[float, float]] = {}
        steps: dict[str, float] = {}
        for side in ("hand", "ours") if i % 2 == 0 else ("ours", "hand"):
            dist.barrier(device_ids=[torch.cuda.current_device()] if s.get("accelerator") == "cuda" else None)
            STEP_ENDS.clear()
            got[side] = hand(family, s) if side == "hand" or control else ours(family, s)
            steps[side] = step_s()
        out.append((got["hand"][0], got["ours"][0], got["hand"][1], got["ours"][1], steps["hand"], steps["ours"]))
    return out


# ---------------------------------------------------------------- whole process


def _spawned(rank: int, world: int, port: int, family: str, s: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    hand(family, s)
    dist.destroy_process_group()


def whole_process(side: str, family: str, s: dict[str, Any]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of it and its children) of a fresh ``python`` that trains ``family``
    on 2 processes and exits: ``ours`` (``Trainer(nproc=N)``, its ranks forked from its zygote),
    ``fresh`` (``Trainer(nproc=N, start_method="spawn")``: a fresh interpreter per rank), ``spawn``
    (the hand loop under ``torch.multiprocessing.spawn``) or ``bare`` (the hand loop in N
    interpreters the script starts itself)."""
    n = RANKS.get(family, 2)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if side == "torchrun":  # the hand loop as a script under torchrun, as most hand-written jobs start
        sizes = [f"--{k.replace('_', '-')}={v}" for k, v in s.items()]
        script = os.path.abspath(__file__)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", script, "--torchrun-worker", family, *sizes]
        return _timed(cmd, root, env, side, family)
    if side in ("ours", "fresh"):
        method = "spawn" if side == "fresh" else "forkserver"
        body = f"import benchmarks.families as b; b.ours({family!r}, {s!r}, nproc={n}, start_method={method!r})"
    elif side == "bare":  # the leanest launcher: N interpreters started by hand, env:// rendezvous
        child = f"import benchmarks.families as b, sys; b._spawned(int(sys.argv[1]), {n}, int(sys.argv[2]), {family!r}, {s!r})"
        body = (
            "import socket, subprocess, sys\n"
            "sock = socket.socket(); sock.bind(('127.0.0.1', 0)); port = sock.getsockname()[1]; sock.close()\n"
            f"procs = [subprocess.Popen([sys.executable, '-c', {child!r}, str(r), str(port)]) for r in range({n})]\n"
            "codes = [p.wait() for p in procs]\n"
            "assert codes == [0] * len(procs), codes"
        )
    else:
        body = (
            "import socket, torch.multiprocessing as mp, benchmarks.families as b\n"
            "sock = socket.socket(); sock.bind(('127.0.0.1', 0)); port = sock.getsockname()[1]; sock.close()\n"
            f"mp.spawn(b._spawned, args=({n}, port, {family!r}, {s!r}), nprocs={n})"
        )
    code = "if __name__ == '__main__':\n" + "".join(f"    {line}\n" for line in body.splitlines())
    return _timed([sys.executable, "-c", code], root, env, side, family)


def _timed(cmd: list[str], root: str, env: dict[str, str], side: str, family: str) -> tuple[float, float]:
    import resource

    def cpu() -> float:
        used = resource.getrusage(resource.RUSAGE_CHILDREN)  # every waited-for descendant: ranks, zygote, agents
        return used.ru_utime + used.ru_stime

    start, cpu_start = time.perf_counter(), cpu()
    done = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"the {side} run of {family} failed:\n{done.stderr}")
    return time.perf_counter() - start, cpu() - cpu_start


def torchrun_worker(family: str, s: dict[str, Any]) -> None:
    """One rank of the hand loop under torchrun (RANK, WORLD_SIZE and the store from its environment)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    hand(family, s)
    dist.destroy_process_group()


def spread(ours_t: list[float], hand_t: list[float]) -> str:
    r = sorted(o / h for o, h in zip(ours_t, hand_t, strict=True))
    return f"pairs: median {statistics.median(r):.3f}x, range {r[0]:.3f}-{r[-1]:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES, help="none (a bare --families): the whole-process table only")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--whole", action="store_true", help="also time the whole process (start to exit)")
    parser.add_argument("--whole-families", nargs="+", default=["ddp", "zero3", "tp", "pipeline"], choices=FAMILIES)
    parser.add_argument(
        "--accelerator", default="cpu", choices=["cpu", "cuda"], help="cuda: each rank on its own GPU, NCCL (a family needing more ranks than GPUs is left out)"
    )
    parser.add_argument("--precision", default="32", choices=["32", "bf16-mixed"], help="bf16-mixed: the hand side runs under torch.autocast(bfloat16)")
    parser.add_argument("--torchrun-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torchrun_worker:
        torchrun_worker(args.torchrun_worker, settings(args))
        return
    import shardwise

    s = settings(args)
    params = sum(p.numel() for p in model(data(args.block)[2], s).parameters())
    on = f"CUDA ({torch.cuda.get_device_name()}), NCCL" if args.accelerator == "cuda" else "gloo, 1 thread per process"
    print(
        f"charlm GPT, {params / 1e6:.2f} M parameters (d_model {args.d_model}, {args.layers} blocks), global batch {args.batch} x "
        f"{args.block} characters, {args.steps} steps, AdamW, precision {args.precision}, {on}, {args.repeats} interleaved pairs\n"
    )
    gpus = torch.cuda.device_count() if args.accelerator == "cuda" else None
    print(f"{'family':10s} {'ranks':>5s} {'step ms':>8s} {'hand ms':>8s} {'step':>7s} {'loop s':>7s} {'hand s':>7s} {'loop':>7s}  loss (shardwise / hand)")
    for family in args.families:
        nproc = RANKS.get(family, 2)
        if gpus is not None and nproc > gpus:
            print(f"{family:10s} {nproc:5d}  left out: needs {nproc} GPUs, this machine has {gpus}", flush=True)
            continue
        results = shardwise.launch(pair, family, s, args.repeats, nproc=nproc, threads_per_proc=1, accelerator=args.accelerator)
        hand_t = [max(r[i][0] for r in results) for i in range(args.repeats)]
        ours_t = [max(r[i][1] for r in results) for i in range(args.repeats)]
        hand_step = [max(r[i][4] for r in results) for i in range(args.repeats)]
        ours_step = [max(r[i][5] for r in results) for i in range(args.repeats)]
        hand_loss, ours_loss = results[0][-1][2], results[0][-1][3]
        step_ratios = sorted(o / h for o, h in zip(ours_step, hand_step, strict=True))
        print(
            f"{family:10s} {nproc:5d} {statistics.median(ours_step) * 1e3:8.1f} {statistics.median(hand_step) * 1e3:8.1f} "
            f"{statistics.median(step_ratios):6.3f}x {statistics.median(ours_t):7.2f} {statistics.median(hand_t):7.2f} "
            f"{statistics.median(ours_t) / statistics.median(hand_t):6.3f}x  {ours_loss:.6f} / {hand_loss:.6f}  "
            f"(step ratio per pair {step_ratios[0]:.3f}-{step_ratios[-1]:.3f}; loop: {spread(ours_t, hand_t)})",
            flush=True,
        )
    if args.whole:
        print(
            f"\nwhole process: a fresh python that trains {args.steps} steps and exits; Trainer(nproc=N) against the hand loop "
            "in N interpreters the script starts itself (bare) and under torch.multiprocessing.spawn\n"
        )
        print(
            f"{'family':10s} {'shardwise s':>12s} {'fresh s':>8s} {'bare s':>8s} {'spawn s':>8s} {'torchrun s':>10s} {'vs bare':>8s}   "
            f"CPU s: {'shardwise':>9s} {'fresh':>6s} {'bare':>6s}"
        )
        for family in args.whole_families:
            times: dict[str, list[float]] = {"ours": [], "fresh": [], "bare": [], "spawn": [], "torchrun": []}
            cpus: dict[str, list[float]] = {k: [] for k in times}
            for i in range(args.repeats):
                order = list(times)
                for side in order[i % len(order) :] + order[: i % len(order)]:  # rotated: each side goes first in turn
                    wall, used = whole_process(side, family, s)
                    times[side].append(wall)
                    cpus[side].append(used)
            extra = sorted(o - h for o, h in zip(times["ours"], times["bare"], strict=True))
            o, f, h, m, t = (statistics.median(times[k]) for k in ("ours", "fresh", "bare", "spawn", "torchrun"))
            co, cf, ch = (statistics.median(cpus[k]) for k in ("ours", "fresh", "bare"))
            print(
                f"{family:10s} {o:12.2f} {f:8.2f} {h:8.2f} {m:8.2f} {t:10.2f} {o - h:+7.2f}s   {co:16.2f} {cf:6.2f} {ch:6.2f}  "
                f"(pairs with bare: median {statistics.median(extra):+.2f}s, range {extra[0]:+.2f} to {extra[-1]:+.2f}s)",
                flush=True,
            )
        ours_t, hand_t = [], []
        for i in range(args.repeats * 2):
            for side in ("hand", "ours") if i % 2 == 0 else ("ours", "hand"):
                (hand_t if side == "hand" else ours_t).append(import_s(IMPORTS[side]))
        extra = sorted(o - h for o, h in zip(ours_t, hand_t, strict=True))
        o, h = statistics.median(ours_t), statistics.median(hand_t)
        print(
            f"{'imports':10s} {o:12.2f} {h:8.2f} {'':8s} {'':10s} {o - h:+7.2f}s  "
            f"({IMPORTS['ours']} against {IMPORTS['hand']}; range {extra[0]:+.2f} to {extra[-1]:+.2f}s)"
        )


IMPORTS = {"ours": "from shardwise import Trainer, Engine, launch", "hand": "import torch"}


def import_s(statement: str) -> float:
    """Seconds ``statement`` takes in a fresh interpreter."""
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


if __name__ == "__main__":
    main()
