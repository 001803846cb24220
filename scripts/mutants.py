"""Deliberate bugs as a tool (``make mutants``): apply each bug to a temporary copy of the
repository, run the tests that should catch it, and print caught / not caught with the test.

Not part of ``make test``: each mutant reruns a few test files (a few minutes in all). A mutant
whose text no longer matches the code is reported as "stale" so the list keeps up with edits.

    python scripts/mutants.py            # every mutant
    python scripts/mutants.py diloco     # those whose name contains "diloco"
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


SINGLE = "tests/unit/test_maths_single.py"
REPLICAS = "tests/dist/test_maths_replicas.py"

MUTANTS = [
    Mutant("accumulation backpropagates the sum of micro-batch losses", "shardwise/strategies/common.py",
           "precision.backward(loss / count)", "precision.backward(loss)", (SINGLE,)),
    Mutant("accumulation drops the last micro-batch", "shardwise/strategies/common.py",
           "for i, batch in enumerate(microbatches):", "for i, batch in enumerate(microbatches[:-1]):", (SINGLE,)),
    Mutant("clipping computes the norm but never clips", "shardwise/strategies/common.py",
           "return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)",
           "return torch.nn.utils.get_total_norm([p.grad for p in params])", (SINGLE,)),
    Mutant("the trainer never steps the LR scheduler", "shardwise/trainer/loop.py",
           "                    scheduler.step()", "                    pass", (SINGLE,)),
    Mutant("bf16-mixed runs without autocast", "shardwise/precision.py",
           "return torch.autocast(self.device.type, dtype=torch.bfloat16)", "return contextlib.nullcontext()", (SINGLE,)),
    Mutant("the sampler takes one sample short (off by one)", "shardwise/data.py",
           "mine = perm[start : start + self.micro * self.accumulate].tolist()",
           "mine = perm[start : start + self.micro * self.accumulate - 1].tolist()", (SINGLE,)),
    Mutant("consecutive global batches overlap by one sample", "shardwise/data.py",
           "start = step * self.global_batch + self.rank", "start = step * (self.global_batch - 1) + self.rank", (SINGLE,)),
    Mutant("evaluation ignores the module's validation_step", "shardwise/trainer/loop.py",
           'validation_step = getattr(module, "validation_step", None)', "validation_step = None", (SINGLE,)),
    Mutant("engine.print prints on every rank", "shardwise/engine.py",
           "        if self.is_rank_zero:\n            print(*args, **kwargs, flush=True)", "        print(*args, **kwargs, flush=True)", (REPLICAS,)),
    Mutant("DiLoCo's outer optimizer ignores momentum", "shardwise/strategies/replicas/diloco.py",
           "torch.optim.SGD(self.theta, lr=lr, momentum=momentum, nesterov=momentum > 0)",
           "torch.optim.SGD(self.theta, lr=lr)", (REPLICAS,)),
    Mutant("DiLoCo's outer step is heavy-ball, not Nesterov", "shardwise/strategies/replicas/diloco.py",
           "nesterov=momentum > 0)", "nesterov=False)", (REPLICAS,)),
    Mutant("DiLoCo skips the reduce of the pseudo-gradient", "shardwise/strategies/replicas/diloco.py",
           '                all_reduce(delta, "mean", group=group, recorder=recorder)', "                pass", (REPLICAS,)),
    Mutant("local SGD sums the replicas instead of averaging (wrong scale)", "shardwise/strategies/replicas/local_sgd.py",
           'all_reduce(flat, "mean", group=group, recorder=recorder)', 'all_reduce(flat, "sum", group=group, recorder=recorder)', (REPLICAS,)),
    Mutant("local SGD leaves the last parameter stale (not averaged)", "shardwise/strategies/replicas/base.py",
           "return [p.data for p in model.parameters()] +", "return [p.data for p in model.parameters()][:-1] +", (REPLICAS,)),
    Mutant("the parameter server ignores the worker's learning rate", "shardwise/strategies/param_server/server.py",
           'group["lr"] = lr  # the worker', "pass  # the worker", (REPLICAS,)),
    Mutant("ddp never syncs the last parameter", "shardwise/strategies/ddp.py",
           "    ddp = DistributedDataParallel(model, device_ids",
           "    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [list(dict(model.named_parameters()))[-1]])\n"
           "    ddp = DistributedDataParallel(model, device_ids", ("tests/dist/test_ddp.py",)),
    Mutant("zero2/zero3 clip by the local shard's norm", "shardwise/strategies/fsdp.py",
           "total = total.full_tensor()", "total = total.to_local()", ("tests/dist/test_sharding.py",)),
    Mutant("a checkpoint's optimizer state is not restored", "shardwise/engine.py",
           '                    sub["optimizer"] = shared[optim_key]', "                    pass", ("tests/dist/test_resume.py",)),
]


def copy_tree(dest: Path) -> None:
    """The tracked and untracked-but-not-ignored files of the working tree (no virtualenv, no runs)."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    for rel in files:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_mutant(m: Mutant, work: Path) -> tuple[str, str]:
    target = work / m.path
    original = target.read_text()
    if original.count(m.old) != 1:
        return "stale", f"{m.old!r} found {original.count(m.old)} times in {m.path}"
    target.write_text(original.replace(m.old, m.new))
    try:
        env = {**os.environ, "PYTHONPATH": str(work)}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
                              cwd=work, capture_output=True, text=True, env=env, timeout=900)
    finally:
        target.write_text(original)
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, flags=re.M) or re.findall(r"^ERROR (\S+)", proc.stdout, flags=re.M)
    if proc.returncode == 0:
        return "NOT CAUGHT", ", ".join(m.tests)
    return "caught", failed[0] if failed else f"pytest exit {proc.returncode}"


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTANTS if not argv or any(a.lower() in m.name.lower() for a in argv)]
    with tempfile.TemporaryDirectory(prefix="shardwise-mutants-") as tmp:
        work = Path(tmp)
        copy_tree(work)
        missed = 0
        for m in chosen:
            verdict, detail = run_mutant(m, work)
            missed += verdict != "caught"
            print(f"{verdict:10s}  {m.name}  ->  {detail}", flush=True)
    print(f"{len(chosen) - missed}/{len(chosen)} caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
