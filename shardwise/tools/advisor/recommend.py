"""The recommendation: the guide's rule that applies, and the fastest candidate that fits under it.

The guide (the course's order of resort, each step the cheapest that removes the constraint):

1. the whole training state fits on one device: **DDP** (replicate; only gradients move);
2. parameters and gradients fit but the optimizer state does not: **ZeRO-1/2** (shard the
   optimizer state, then the gradients; same traffic as DDP, Rajbhandari et al. 2020, section 7);
3. the parameters themselves do not fit: **ZeRO-3 / FSDP** (or HSDP across nodes);
4. one layer does not fit, or the batch is too small to give every process a sample:
   **tensor parallelism** (Shoeybi et al. 2019);
5. many layers and slow links (data parallelism's exposed communication above half its step):
   **pipeline parallelism** (point-to-point activations instead of whole-model allreduces);
6. unreliable or slow workers (``--unreliable``): **asynchronous parameter servers or local SGD**.

Before the guide, the course's first lesson: distributed training is not always beneficial, it is a
trade-off. When one process (``single``, with the threads it would run) is predicted faster than every
multi-process candidate that fits, the recommendation is to stay on one (rule ``one-process``), with
both figures and their ratio (`one_or_many`); a candidate on fewer processes than asked is named as such.

The rule picks the family (the strategies whose cost names the step in its ``advised_for``,
`shardwise.strategies.cost.family.StrategyCost`); the candidate is the fastest one of that family that fits. The
numbers behind the rule (bytes per category against the device's memory) are returned with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardwise.strategies.cost.cluster import Cluster
from shardwise.strategies.cost.estimate import Settings
from shardwise.strategies.cost.families import cost_of
from shardwise.strategies.cost.family import ONE_PROCESS, PIPELINE, REFERENCE, REPLICATE, SHARD_ALL, SHARD_STATE, SPLIT_LAYERS, UNRELIABLE
from shardwise.strategies.cost.model_spec import ModelSpec


def _advised(record: dict[str, Any], rule: str | None) -> bool:
    """Whether ``record``'s strategy is recommended under the guide's step ``rule`` (None: any)."""
    return rule is None or rule in cost_of(record["strategy"]).advised_for


def _fastest(records: Sequence[dict[str, Any]], rule: str | None, need: str = "") -> dict[str, Any] | None:
    ok = [r for r in records if r["fits"] and _advised(r, rule) and r["world_size"] > 1]
    if need == "split":  # a mesh that splits each layer
        ok = [r for r in ok if r["mesh"].get("tp", 1) > 1]
    if need == "async":
        ok = [r for r in ok if r["options"].get("mode") != "sync"]
    return min(ok, key=lambda r: r["step_time_s"]) if ok else None


def recommend(records: Sequence[dict[str, Any]], spec: ModelSpec, cluster: Cluster, settings: Settings, unreliable: bool = False) -> dict[str, Any]:
    """``{rule, why, choice, fastest, numbers}`` for ``records`` (the candidates' records)."""
    mem = cluster.device.memory_bytes
    per = settings.per_param
    single = next(r for r in records if _advised(r, REFERENCE))
    state = single["memory_breakdown"]
    gb = 1e9
    numbers = {
        "device_memory_bytes": mem,
        "single_total_bytes": state["total"],
        "params_bytes": state["params"],
        "params_grads_bytes": state["params"] + state["grads"],
        "optimizer_bytes": state["optimizer"],
        "layer_state_bytes": spec.layer_params * (per.params + per.grads + per.optimizer),
        "samples_per_process": settings.global_batch / cluster.nproc,
    }
    ddp = _fastest(records, REPLICATE)
    ddp_ref = next((r for r in records if _advised(r, REPLICATE)), None)  # the replicated layout at this world size
    act = (ddp_ref or single)["memory_breakdown"]["activations"] + (ddp_ref or single)["memory_breakdown"]["buffers"]
    if unreliable:
        rule, why, need = UNRELIABLE, "workers are unreliable or slow: asynchronous parameter servers or local SGD / DiLoCo tolerate them", "async"
    elif numbers["layer_state_bytes"] > mem or numbers["samples_per_process"] < 1:
        rule, need = SPLIT_LAYERS, "split"
        why = (
            f"one layer's state ({numbers['layer_state_bytes'] / gb:.3g} GB) exceeds the device ({mem / gb:.3g} GB)"
            if numbers["layer_state_bytes"] > mem
            else f"the batch gives {numbers['samples_per_process']:.2g} samples per process: split each layer (tensor parallelism)"
        )
    elif ddp_ref is not None and ddp_ref["memory_breakdown"]["total"] <= mem:
        rule, need = REPLICATE, ""
        why = f"the model fits on one device ({ddp_ref['memory_breakdown']['total'] / gb:.3g} GB per rank of {mem / gb:.3g} GB under DDP): replicate it (DDP)"
    elif state["params"] + state["grads"] + act <= mem:
        rule, need = SHARD_STATE, ""
        why = (
            f"parameters, gradients and activations fit ({(numbers['params_grads_bytes'] + act) / gb:.3g} GB) but not with the optimizer state "
            f"({state['optimizer'] / gb:.3g} GB): shard the optimizer state (ZeRO-1/2)"
        )
    elif act <= mem:
        rule, need = SHARD_ALL, ""
        why = (
            f"the parameters and gradients ({numbers['params_grads_bytes'] / gb:.3g} GB) with activations ({act / gb:.3g} GB) "
            f"exceed the device ({mem / gb:.3g} GB): shard them too (ZeRO-3/FSDP)"
        )
    else:
        rule, need = SPLIT_LAYERS, ""
        why = (
            f"a data-parallel rank's activations alone ({act / gb:.3g} GB) exceed the device ({mem / gb:.3g} GB): "
            "split the layers (tensor / pipeline parallelism)"
        )
    if rule in (REPLICATE, SHARD_STATE) and cluster.nodes > 1 and ddp is not None and spec.layers >= 8:
        t = ddp["time_breakdown"]
        if t["exposed_comm_s"] > 0.5 * t["step_s"]:
            rule, need = PIPELINE, ""
            why = f"many layers ({spec.layers}) and slow links: DDP's exposed communication is {t['exposed_comm_s']:.3g} s of its {t['step_s']:.3g} s step"
    choice = _fastest(records, rule, need)
    fastest = _fastest(records, None)
    if choice is None and fastest is not None:
        why += "; no candidate of that family fits here, so the fastest candidate that fits is named instead"
        choice = fastest
    elif choice is None:
        why = f"no candidate fits: {why}. {nothing_fits(records, mem)}"
    alone = [r for r in records if r["world_size"] == 1 and r["fits"] and _advised(r, ONE_PROCESS)]  # single, or with a memory saver
    one = min(alone, key=lambda r: r["step_time_s"]) if alone else single
    versus = one_or_many(one, fastest)
    if versus["stay_on_one_process"]:
        rule, choice, why = ONE_PROCESS, one, versus["why"]
    elif choice is not None and choice["world_size"] < cluster.nproc:
        why += f"; on {choice['world_size']} of the {cluster.nproc} processes: fewer are faster here ({versus['why']})"
    return {
        "rule": rule,
        "why": why,
        "choice": choice["label"] if choice else None,
        "choice_record": choice,
        "fastest": fastest["label"] if fastest else None,
        "processes": choice["world_size"] if choice else None,
        "threads": choice.get("threads") if choice else None,
        **{k: v for k, v in versus.items() if k != "why"},
        "numbers": numbers,
    }


def _brief(r: dict[str, Any] | None) -> dict[str, Any] | None:
    if r is None:
        return None
    keys = ("label", "world_size", "threads", "step_time_s", "samples_per_s", "fits")
    return {k: r.get(k) for k in keys}


def one_or_many(single: dict[str, Any], multi: dict[str, Any] | None) -> dict[str, Any]:
    """One process against the fastest multi-process candidate that fits (``multi``; None: none fits): what
    distributing buys, in numbers. ``speedup`` is single's step over ``multi``'s (above 1: distributing pays);
    ``stay_on_one_process`` when single fits and is predicted faster (or no multi-process candidate fits)."""
    ms = 1e3
    stay = bool(single["fits"]) and (multi is None or single["step_time_s"] < multi["step_time_s"])
    speedup = single["step_time_s"] / multi["step_time_s"] if multi is not None and multi["step_time_s"] > 0 else None
    one = f"{single['label']}: {single['step_time_s'] * ms:.3g} ms a step, {single.get('samples_per_s', 0):.3g} samples/s"
    one += f" with {single.get('threads', 1)} thread(s)"
    if multi is None:
        why = f"{one}; no multi-process candidate fits (or --nproc is 1): one process"
    else:
        other = (
            f"{multi['label']} on {multi['world_size']} processes: {multi['step_time_s'] * ms:.3g} ms, "
            f"{multi.get('samples_per_s', 0):.3g} samples/s with {multi.get('threads', 1)} thread(s) each"
        )
        if stay:
            why = (
                f"one process is predicted faster than every multi-process candidate that fits: {one}, against the fastest of them, {other} "
                f"({multi['step_time_s'] / single['step_time_s']:.2f}x the step): distributing is a trade-off and here it costs more "
                "(communication, per-process work, shared cores) than it saves; stay on one process"
            )
        else:
            why = f"{other} against {one}: {speedup:.2f}x the speed of one process"
    return {"stay_on_one_process": stay, "one_process": _brief(single), "best_multiprocess": _brief(multi), "speedup": speedup, "why": why}


def run_command(record: dict[str, Any], source: str, settings_flags: Sequence[str] = (), cores_here: bool = True) -> str:
    """The ``shardwise train`` command that runs ``record`` as planned: ``source`` (``--recipe NAME`` or ``--model
    MODULE:FACTORY``), the strategy, its options as flags, the processes, ``settings_flags`` (batch, precision, ...), and
    ``--threads k`` where the count it was costed with (``cores_here``: on this machine's cores) is not the one the run
    would take by itself: torch's own count in one process, a user's OMP_NUM_THREADS or the cores shared out when started."""
    import os
    import shlex

    import torch

    from shardwise.launcher.env import user_threads

    parts = ["shardwise train", source, "--strategy", record["strategy"]]
    for key, value in record["options"].items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (str, int, float)):
            parts += [flag, shlex.quote(str(value))]
        else:
            parts += ["--set", shlex.quote(f"trainer.strategy_options.{key}={value!r}")]
    if record.get("activation_checkpointing", "off") != "off":
        parts += ["--activation-checkpointing", str(record["activation_checkpointing"])]
    parts += ["--nproc", str(record["world_size"]), *settings_flags]
    threads = record.get("threads")
    if cores_here and threads:
        auto = torch.get_num_threads() if record.get("in_process") else user_threads() or max(1, (os.cpu_count() or 1) // record["world_size"])
        if threads != auto:
            parts += ["--threads", str(threads)]
    return " ".join(parts)


def nothing_fits(records: Sequence[dict[str, Any]], device_bytes: float) -> str:
    """Why no candidate fits, told by the candidate that needs the least memory per rank: its model state
    alone is too big (more processes to shard over, or a bigger device), or its activations are (smaller
    micro-batches: ``shardwise plan`` then tries more accumulation steps, `commands.fits_with_accumulation`)."""
    gb = 1e9
    sized = [r for r in records if r.get("memory_per_rank_bytes") and r["memory_per_rank_bytes"] > 0 and r["world_size"] > 0]
    if not sized:
        return "Every candidate was refused by its strategy (the reasons are listed above)."
    best = min(sized, key=lambda r: r["memory_per_rank_bytes"])
    m = best["memory_breakdown"]
    head = f"The least memory per rank is {best['label']}'s, {best['memory_per_rank_bytes'] / gb:.3g} GB of the device's {device_bytes / gb:.3g} GB"
    rest = m["total"] - m["activations"]  # model state and buffers: what a smaller micro-batch does not shrink
    if rest >= device_bytes:
        return (
            f"{head}, and its model state alone ({m['model_state'] / gb:.3g} GB) does not fit: more processes (--nproc) "
            "to shard it over, or a device with more memory (--device)"
        )
    return f"{head}; its activations ({m['activations'] / gb:.3g} GB) are what does not fit (they shrink with the micro-batch)"
