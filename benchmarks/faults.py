"""Fault trials: kill, crash and corrupt real runs, and check that each one still ends where an
uninterrupted run ends, bit for bit.

Every trial trains the digits recipe with ddp on 2 processes under ``shardwise run`` (torchrun) for
``--steps`` steps, a checkpoint every 10 (rank 1 slowed 10x on purpose, a sleep that changes no
number, so the faults land mid-run), and compares the final checkpoint's weights with a reference run
that nothing touched. Kinds:

- ``kill``: SIGKILL of a random worker at a random step, under ``--max-restarts 3``: torchrun
  restarts the workers, ``--resume auto`` continues from the newest checkpoint.
- ``kill-in-checkpoint``: SIGKILL of rank 0 (the rank that publishes checkpoints) as soon as a
  checkpoint's temporary directory appears, under ``--max-restarts 3`` (a kill that lands after
  the write finished is counted as such).
- ``job-kill``: SIGKILL of the whole job (agent and workers) at a random step, then a new
  ``shardwise run ... --resume auto`` by hand.
- ``corrupt``: a finished run's newest checkpoint damaged three ways in turn (truncated, one byte
  flipped, its state replaced by a pickle that runs code when loaded unsafely, with the manifest
  rewritten to match), then ``--resume auto``: the damaged one must be skipped with a message, the
  previous good one used, nothing but tensors and plain data unpickled.

A trial passes when the job ends with exit 0, the final weights equal the reference's bitwise, the
newest checkpoint verifies and loads ("latest" is never corrupt), and no checkpoint the run should
keep is missing.

    python benchmarks/faults.py [--trials 20] [--kinds kill,kill-in-checkpoint,job-kill,corrupt] [--steps 60]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

KINDS = ("kill", "kill-in-checkpoint", "job-kill", "corrupt")
CORRUPTIONS = ("truncate", "flip", "foreign")


def _train_args(out: Path, steps: int) -> list[str]:
    return [
        "-m", "shardwise", "train", "--recipe", "digits", "--strategy", "ddp", "--max-steps", str(steps),
        "--checkpoint-every", "10", "--log-every", "2", "--straggler", "1:10", "--out", str(out), "--resume", "auto",
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


def start(out: Path, steps: int, restarts: int) -> subprocess.Popen[str]:
    """``shardwise run --nproc-per-node 2 [--max-restarts N] -m shardwise train ...`` in its own session."""
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc-per-node", "2", "--max-restarts", str(restarts), *_train_args(out, steps)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True)


def run(out: Path, steps: int, restarts: int = 0, timeout: float = 300) -> tuple[int, str]:
    proc = start(out, steps, restarts)
    text, _ = proc.communicate(timeout=timeout)
    return proc.returncode, text


def logged_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(int(json.loads(line).get("step", 0)))
        except ValueError:
            pass  # a line being written
    return max(steps, default=0)


def workers(agent: int) -> dict[int, int]:
    """rank -> pid of the training workers below ``agent`` (read from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != agent:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        rank = next((int(v.split(b"=", 1)[1]) for v in env if v.startswith(b"RANK=")), None)
        if rank is not None:
            found[rank] = int(entry.name)
    return found


def final_weights(out: Path) -> dict[str, torch.Tensor] | None:
    import warnings

    from shardwise.checkpoint.files import latest_valid, load_file

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = latest_valid(out / "checkpoints")
    return None if path is None else dict(load_file(path / "state.pt")["model"])


def check(out: Path, reference: dict[str, torch.Tensor], steps: int) -> str | None:
    """None when the run ended as the reference did; else what is wrong."""
    root = out / "checkpoints"
    names = sorted(p.name for p in root.glob("step-*"))
    if not names or names[-1] != f"step-{steps:08d}":
        return f"newest checkpoint is {names[-1] if names else 'missing'}, expected step-{steps:08d}"
    weights = final_weights(out)
    if weights is None:
        return "no checkpoint verifies"
    if weights.keys() != reference.keys() or not all(torch.equal(weights[k], reference[k]) for k in reference):
        return "final weights differ from the uninterrupted run"
    return None


def _wait_for(predicate: Any, proc: subprocess.Popen[str], timeout: float = 240) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if predicate():
            return True
        time.sleep(0.002)
    return False


def trial_kill(out: Path, steps: int, rng: random.Random) -> str:
    at = rng.randrange(4, steps - 8)
    proc = start(out, steps, restarts=3)
    if not _wait_for(lambda: logged_step(out) >= at, proc):
        proc.communicate(timeout=300)
        return f"ended before step {at}"
    ranks = workers(proc.pid)
    victim = rng.choice(sorted(ranks)) if ranks else None
    if victim is not None:
        os.kill(ranks[victim], signal.SIGKILL)
    text, _ = proc.communicate(timeout=300)
    return f"rank {victim} killed after step {at}" + ("" if proc.returncode == 0 else f"; exit {proc.returncode}: {text[-800:]}")


def trial_kill_in_checkpoint(out: Path, steps: int, rng: random.Random) -> str:
    proc = start(out, steps, restarts=3)
    root = out / "checkpoints"
    skip = rng.randrange(0, max(1, steps // 10 - 1))  # which checkpoint write to hit
    seen: set[str] = set()

    def writing() -> bool:
        if not root.is_dir():
            return False
        for p in root.iterdir():
            if p.name.startswith(".tmp-") and p.name not in seen:
                seen.add(p.name)
                return len(seen) > skip
        return False

    landed = "no write caught"
    if _wait_for(writing, proc):
        ranks = workers(proc.pid)
        if 0 in ranks:
            os.kill(ranks[0], signal.SIGKILL)
            landed = "inside a write" if any(p.name.startswith(".tmp-") for p in root.iterdir()) else "just after a write"
    text, _ = proc.communicate(timeout=300)
    return f"rank 0 killed {landed}" + ("" if proc.returncode == 0 else f"; exit {proc.returncode}: {text[-800:]}")


def trial_job_kill(out: Path, steps: int, rng: random.Random) -> str:
    at = rng.randrange(4, steps - 8)
    proc = start(out, steps, restarts=0)
    if _wait_for(lambda: logged_step(out) >= at, proc):
        os.killpg(proc.pid, signal.SIGKILL)  # the agent and every worker at once
    proc.communicate(timeout=60)
    code, text = run(out, steps)
    return f"job killed after step {at}, resumed by hand" + ("" if code == 0 else f"; exit {code}: {text[-800:]}")


def _foreign(state: Path) -> None:
    """Replace ``state`` with a pickle whose loading runs code (a file next to it) unless loaded weights-only."""

    class Payload:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {state.parent / 'PWNED'}",))

    torch.save({"model": Payload()}, state)
    manifest = json.loads((state.parent / "manifest.json").read_text())
    data = state.read_bytes()
    manifest["files"][state.name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (state.parent / "manifest.json").write_text(json.dumps(manifest))


def trial_corrupt(out: Path, steps: int, rng: random.Random, how: str) -> str:
    code, text = run(out, steps)
    if code != 0:
        return f"first run failed: {text[-800:]}"
    newest = sorted((out / "checkpoints").glob("step-*"))[-1]
    state = newest / "state.pt"
    if how == "truncate":
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    elif how == "flip":
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0xFF
        state.write_bytes(bytes(data))
    else:
        _foreign(state)
    code, text = run(out, steps)
    problems = []
    if code != 0:
        problems.append(f"exit {code}: {text[-800:]}")
    if "skipping damaged checkpoint" not in text:
        problems.append("no message about the damaged checkpoint")
    if (newest / "PWNED").exists() or any(out.rglob("PWNED")):
        problems.append("the foreign pickle ran code")
    return f"newest checkpoint {how}" + ("; " + "; ".join(problems) if problems else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    for kind in kinds:
        if kind not in KINDS:
            raise SystemExit(f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="shardwise-faults-"))
    try:
        code, text = run(work / "reference", args.steps)
        if code != 0:
            raise SystemExit(f"the reference run failed:\n{text[-3000:]}")
        reference = final_weights(work / "reference")
        assert reference is not None
        table = []
        for kind in kinds:
            passed = 0
            for i in range(args.trials):
                out = work / f"{kind}-{i}"
                if kind == "kill":
                    what = trial_kill(out, args.steps, rng)
                elif kind == "kill-in-checkpoint":
                    what = trial_kill_in_checkpoint(out, args.steps, rng)
                elif kind == "job-kill":
                    what = trial_job_kill(out, args.steps, rng)
                else:
                    what = trial_corrupt(out, args.steps, rng, CORRUPTIONS[i % len(CORRUPTIONS)])
                wrong = check(out, reference, args.steps)
                ok = wrong is None and "exit" not in what and "no message" not in what and "ran code" not in what
                passed += ok
                print(f"{kind:20s} trial {i + 1:2d}: {'pass' if ok else 'FAIL'}  ({what}{'' if wrong is None else '; ' + wrong})", flush=True)
                shutil.rmtree(out, ignore_errors=True)
            table.append((kind, passed))
        print(f"\n{args.steps} steps, digits, ddp on 2 processes under shardwise run, seed {args.seed}\n")
        print(f"{'fault':20s} trials passed")
        for kind, passed in table:
            print(f"{kind:20s} {passed} / {args.trials}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
