"""Deliberate bugs as a tool (``make mutants``): apply each bug to a temporary copy of the
repository, run the tests that should catch it, and print caught / not caught with the test.

Not part of ``make test``: each mutant reruns a few test files (a few minutes in all). A mutant
whose text no longer matches the code is reported as "stale" so the list keeps up with edits.

    python scripts/mutants.py            # every mutant
    python scripts/mutants.py diloco     # those whose name contains "diloco"
    python scripts/mutants.py --owned    # those in ddp, common, data, checkpoint, engine, trainer, precision
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


SINGLE = "tests/strategies/data_parallel/test_maths_single.py"
REPLICAS = "tests/strategies/replicas/test_maths_replicas.py"
DDP = "tests/strategies/data_parallel/test_ddp.py"
DDP_BYTES = "tests/strategies/data_parallel/test_ddp_bytes.py"
RESUME = "tests/checkpoint/test_resume.py"
CLAIMS = "tests/readme/test_readme_claims.py"
RUN_TOOLS = "tests/tools/test_run_tools_dist.py"
RUN_TOOLS_UNIT = "tests/tools/test_run_tools.py"
DATA_DRAWS = "tests/data/test_data_workers.py::test_augmentation_draws_anew_each_epoch_and_the_same_again_on_a_resume_or_in_a_worker"
HANG_REPORT_UNIT = "tests/launcher/test_hang_report.py::test_the_report_names_only_the_ranks_behind_the_collective"
HANG_REPORT_3 = "tests/launcher/test_hang_report.py::test_a_rank_that_returned_without_the_collective_is_named"
ZYGOTE_FALLBACK = "tests/launcher/test_zygote.py::test_a_rank_started_fresh_after_the_zygote_refused_follows_the_launcher"
PLAN_INTERLEAVED = "tests/strategies/cost/test_estimate.py::test_interleaved_activations_are_the_peak_counted_from_the_schedule"
HSDP_SHAPES = "tests/strategies/sharded/test_sharding.py::test_hsdp_replicates_over_one_mesh_dimension_and_shards_over_the_other"
AC_UNIT = "tests/strategies/test_activation_checkpointing.py"
AC_SINGLE = "tests/strategies/test_activation_checkpointing_models.py::test_single_trains_the_same_weights_with_activation_checkpointing"

# Which family each mutant belongs to; `--owned` picks the ones in files whose tests are quick to
# rerun (ddp, common, data, checkpoint, engine, trainer, precision).
OWNED = ("shardwise/strategies/data_parallel/ddp.py", "shardwise/strategies/common.py", "shardwise/data/__init__.py", "shardwise/checkpoint/files.py",
         "shardwise/engine/", "shardwise/trainer/", "shardwise/strategies/precision.py")

MUTANTS = [
    # -- the five bugs of issue 20's table --------------------------------------------------------
    Mutant("ddp never syncs the last parameter", "shardwise/strategies/data_parallel/ddp.py",
           "    ddp = DistributedDataParallel(model, device_ids",
           "    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [list(dict(model.named_parameters()))[-1]])\n"
           "    ddp = DistributedDataParallel(model, device_ids", (DDP,)),
    Mutant("accumulation drops the last micro-batch", "shardwise/strategies/common.py",
           "for i, batch in enumerate(microbatches):", "for i, batch in enumerate(microbatches[:-1]):", (SINGLE,)),
    Mutant("accumulation backpropagates the sum of micro-batch losses", "shardwise/strategies/common.py",
           "precision.backward(loss / count)", "precision.backward(loss)", (SINGLE,)),
    Mutant("DiLoCo's outer optimizer ignores momentum", "shardwise/strategies/replicas/diloco.py",
           "torch.optim.SGD(self.theta, lr=lr, momentum=momentum, nesterov=momentum > 0)",
           "torch.optim.SGD(self.theta, lr=lr)", (REPLICAS,)),
    # (On torch 2.13 get_total_norm of FSDP2's gradients is already a Replicate DTensor, so swapping
    # full_tensor() for to_local() after it changes nothing: the bug is a norm of the local shards.)
    Mutant("zero2/zero3 clip by the local shard's norm", "shardwise/strategies/sharded/fsdp.py",
           "total = torch.nn.utils.get_total_norm(grads, foreach=True)",
           "total = torch.nn.utils.get_total_norm([g.to_local() for g in grads], foreach=True)", ("tests/strategies/sharded/test_sharding.py",)),
    # -- single, the trainer, the engine, precision, data, checkpoints ------------------------------
    Mutant("clipping computes the norm but never clips", "shardwise/strategies/common.py",
           "return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)",
           "return torch.nn.utils.get_total_norm([p.grad for p in params])", (SINGLE,)),
    Mutant("the trainer never steps the LR scheduler", "shardwise/trainer/fit.py",
           "            scheduler.step()", "            pass", (SINGLE,)),
    Mutant("the trainer never zeroes the gradients (a stale gradient adds into every later step)", "shardwise/trainer/fit.py",
           "        optimizer.zero_grad(set_to_none=True)\n        if scheduler",
           "        pass\n        if scheduler", (SINGLE,)),
    Mutant("evaluation ignores the module's validation_step", "shardwise/trainer/loop.py",
           'validation_step = getattr(module, "validation_step", None)', "validation_step = None", (SINGLE,)),
    Mutant("bf16-mixed runs without autocast", "shardwise/strategies/precision.py",
           "return torch.autocast(self.device.type, dtype=torch.bfloat16)", "return contextlib.nullcontext()", (SINGLE,)),
    Mutant("16-mixed clips the scaled gradients (no unscale before the clip: a wrong scale)", "shardwise/engine/engine.py",
           "        self.precision.unscale(optimizer)\n        return self._run(model).clip_grad_norm(max_norm)",
           "        return self._run(model).clip_grad_norm(max_norm)", (SINGLE,)),
    Mutant("the sampler takes one sample short (off by one)", "shardwise/data/__init__.py",
           "mine = perm[start : start + self.micro * self.accumulate].tolist()",
           "mine = perm[start : start + self.micro * self.accumulate - 1].tolist()", (SINGLE,)),
    Mutant("consecutive global batches overlap by one sample (off by one)", "shardwise/data/__init__.py",
           "start = step * self.global_batch + self.rank", "start = step * (self.global_batch - 1) + self.rank", (SINGLE,)),
    Mutant("engine.print prints on every rank", "shardwise/engine/engine.py",
           "        if self.is_rank_zero:\n            print(*args, **kwargs, flush=True)", "        print(*args, **kwargs, flush=True)", (REPLICAS,)),
    Mutant("a checkpoint's optimizer state is not restored", "shardwise/engine/checkpoints.py",
           '                sub["optimizer"] = shared[optim_key]', "                pass", (RESUME,)),
    Mutant("a resume does not restore the random number generator (dropout draws differ)", "shardwise/checkpoint/files.py",
           '    torch.set_rng_state(state["torch"])\n', "    pass\n", (RESUME,)),
    Mutant("keep_last prunes nothing", "shardwise/trainer/loop.py",
           "ckpt.prune(root, self.config.keep_last, getattr(self, \"_run_id\", None))", "None",
           (f"{CLAIMS}::test_keep_last_prunes_older_checkpoints_of_the_run",)),
    # -- callbacks, loops, profiler (issue 14) ---------------------------------------------------------
    Mutant("early stopping decides on each rank's own value (no agreement)", "shardwise/trainer/callbacks.py",
           "        return agree(engine, value)", "        return value", (f"{RUN_TOOLS}::test_early_stopping_stops_every_rank_after_the_same_step",)),
    Mutant("early stopping counts an improvement smaller than min_delta", "shardwise/trainer/callbacks.py",
           "return value < than - self.min_delta if", "return value < than if", (f"{RUN_TOOLS_UNIT}::test_early_stopping_stops_where_the_hand_count_does",)),
    Mutant("callback state is not restored on resume", "shardwise/trainer/callbacks.py",
           "            cb.load_state_dict(dict(states[key]))", "            pass", (f"{RUN_TOOLS_UNIT}::test_early_stopping_state_resumes_exactly",)),
    Mutant("ModelCheckpoint keeps the worst instead of the best", "shardwise/trainer/callbacks.py",
           "key = score if self.mode == \"min\" else -score", "key = -score if self.mode == \"min\" else score",
           (f"{RUN_TOOLS_UNIT}::test_model_checkpoint_keeps_the_k_best_apart_from_keep_last",)),
    Mutant("prediction: every rank of a replica writes its rows (pipeline rows counted twice)", "shardwise/trainer/evaluate.py",
           "writes = all(engine.mesh.coordinate(d) == 0 for d in engine.mesh.degrees if d != DATA_DIM)", "writes = True",
           (f"{RUN_TOOLS}::test_validate_test_and_predict_are_exact_at_world_size_2",)),
    Mutant("evaluation averages batch means (the short last batch weighs as much as a full one)", "shardwise/trainer/evaluate.py",
           "            count += n\n            for k, v in values.items():\n                totals[k] = totals.get(k, 0.0) + float(v) * n",
           "            count += 1\n            for k, v in values.items():\n                totals[k] = totals.get(k, 0.0) + float(v)",
           (f"{RUN_TOOLS}::test_validate_test_and_predict_are_exact_at_world_size_2",)),
    Mutant("the profile counts exposed communication inside backward twice", "shardwise/trainer/profile.py",
           "\"backward\": length(subtract(intersect(intersect(fb, backward), span), exposed)),",
           "\"backward\": length(intersect(intersect(fb, backward), span)),",
           (f"{RUN_TOOLS_UNIT}::test_the_breakdown_partitions_a_hand_made_trace", f"{RUN_TOOLS}::test_the_profile_breakdown_sums_to_the_measured_step")),
    Mutant("the straggler sleeps on every rank, not the one named", "shardwise/trainer/straggler.py",
           "if engine.rank == self.rank and self.fastest < float(\"inf\"):", "if self.fastest < float(\"inf\"):",
           (f"{CLAIMS}::test_the_straggler_rank_alone_is_slowed_by_its_factor",)),
    # -- ddp ------------------------------------------------------------------------------------
    Mutant("ddp skips the bucket reduce (a skipped reduce)", "shardwise/strategies/data_parallel/ddp.py",
           "    buf.div_(state.group.size)\n    return all_reduce_async(buf, \"sum\", group=state.group, recorder=state.recorder, timed=state.timed)",
           "    fut = torch.futures.Future()\n    fut.set_result(buf)\n    return fut", (DDP,)),
    Mutant("ddp sums the replicas' gradients instead of averaging (a wrong scale)", "shardwise/strategies/data_parallel/ddp.py",
           "    buf.div_(state.group.size)\n", "", (DDP,)),
    Mutant("ddp's bucket reductions miss the run's recorder (bytes sent but not counted)", "shardwise/strategies/data_parallel/ddp.py",
           "_HookState(group, recorder, timed=record_buckets)", "_HookState(group, Recorder(), timed=record_buckets)", (DDP_BYTES,)),
    # -- one per other strategy family (their text may go stale as those files change) ------------
    Mutant("DiLoCo's outer step is heavy-ball, not Nesterov", "shardwise/strategies/replicas/diloco.py",
           "nesterov=momentum > 0)", "nesterov=False)", (REPLICAS,)),
    Mutant("DiLoCo skips the reduce of the pseudo-gradient", "shardwise/strategies/replicas/diloco.py",
           '                all_reduce(delta, "mean", group=group, recorder=recorder)', "                pass", (REPLICAS,)),
    Mutant("local SGD sums the replicas instead of averaging (wrong scale)", "shardwise/strategies/replicas/local_sgd.py",
           'all_reduce(flat, "mean", group=group, recorder=recorder)', 'all_reduce(flat, "sum", group=group, recorder=recorder)', (REPLICAS,)),
    Mutant("local SGD leaves the last parameter stale (not averaged)", "shardwise/strategies/replicas/base.py",
           "return [p.data for p in model.parameters()] +", "return [p.data for p in model.parameters()][:-1] +", (REPLICAS,)),
    Mutant("gossip divides by the neighbours alone (a wrong scale)", "shardwise/strategies/replicas/gossip.py",
           "unflatten_into(total.div_(len(peers_of) + 1), tensors)", "unflatten_into(total.div_(len(peers_of)), tensors)",
           ("tests/strategies/replicas/test_local_sgd.py",)),
    Mutant("the parameter server ignores the worker's learning rate", "shardwise/strategies/param_server/server.py",
           'group["lr"] = lr  # the worker', "pass  # the worker", (REPLICAS,)),
    Mutant("a ps worker keeps its stale parameters (the pull is ignored)", "shardwise/strategies/param_server/client.py",
           "                )\n            self.versions[s] = int(unpack_header(reply)[VERSION])\n"
           "            self._unflatten(s, payload_of(reply, self.params[0].dtype, self.numels[s]))",
           "                )\n            self.versions[s] = int(unpack_header(reply)[VERSION])", ("tests/strategies/param_server/test_ps.py",)),
    Mutant("a zero1 checkpoint drops the optimizer state", "shardwise/strategies/sharded/zero1.py",
           'state["optimizer"] = self.optimizer.state_dict() if dist.get_rank() == 0 else {}',
           'state["optimizer"] = {k: v for k, v in self.optimizer.state_dict().items() if k != "state"} if dist.get_rank() == 0 else {}',
           (f"{CLAIMS}::test_zero1_resumes_bit_for_bit",)),
    Mutant("a sharded (zero2/zero3/hsdp) checkpoint drops the optimizer state", "shardwise/checkpoint/sharded.py",
           '        state["optimizer"] = get_optimizer_state_dict(model, optimizer)', "        pass",
           ("tests/strategies/sharded/test_sharding_resume.py",)),
    Mutant("tp skips the sum of sequence-parallel norm gradients (a skipped reduce)", "shardwise/strategies/tensor_parallel/grads.py",
           '        all_reduce(flat, "sum", group=group, recorder=recorder)\n',  # the role sum over tp (sequence-parallel norms)
           "        pass\n", ("tests/strategies/tensor_parallel/test_tensor_parallel.py",)),
    Mutant("tp/pipeline data parallelism sums gradients over dp instead of averaging (a wrong scale)",
           "shardwise/strategies/tensor_parallel/grads.py",
           'all_reduce(flat, "mean", group=group, recorder=recorder)  # a sum, then a division by the group size',
           'all_reduce(flat, "sum", group=group, recorder=recorder)',
           ("tests/strategies/tensor_parallel/test_tensor_parallel.py",)),
    Mutant("the pipeline schedule sums micro-batch gradients (a wrong scale)", "shardwise/strategies/pipeline/run.py",
           "                    p.grad.div_(m)", "                    pass", ("tests/strategies/pipeline/test_pipeline.py",)),
    # -- tune and plot --------------------------------------------------------------------------------
    Mutant("the range test suggests the lowest loss's rate, not the steepest descent", "shardwise/trainer/lr_find.py",
           "    return min(range(start, lowest + 1), key=lambda i: grads[i])", "    return lowest", ("tests/trainer/test_lr_find.py",)),
    Mutant("the range test's moving average has no bias correction", "shardwise/trainer/lr_find.py",
           "        out.append(avg / (1 - beta**t))", "        out.append(avg)", ("tests/trainer/test_lr_find.py",)),
    Mutant("the range test leaves the swept weights in the model", "shardwise/trainer/lr_find.py",
           "            snapshot.restore(model)", "            pass", ("tests/trainer/test_lr_find.py",)),
    Mutant("the range test records the next step's rate against this step's loss", "shardwise/trainer/lr_find.py",
           "        used, self._lr = self._lr, self._sweep(trainer).current_lr()", "        used = self._lr = self._sweep(trainer).current_lr()",
           ("tests/trainer/test_lr_find.py",)),
    Mutant("the batch-size finder reads the current resident memory, not the peak", "shardwise/tools/tune/batch_size.py",
           '            if line.startswith("VmHWM:"):', '            if line.startswith("VmRSS:"):', ("tests/tools/test_tuners.py",)),
    Mutant("the batch-size finder forgets the data-parallel split of the global batch", "shardwise/tools/tune/batch_size.py",
           "    per_micro = layout.data_parallel * cfg.accumulate", "    per_micro = cfg.accumulate", ("tests/tools/test_tuners.py",)),
    Mutant("the hyperparameter search never stops a trial its pruner condemns", "shardwise/tools/tune/trial.py",
           "                    record.pruned_at = step", "                    pass",
           ("tests/tools/test_tune_hparams.py::test_a_clearly_worse_trial_is_pruned_and_its_process_ends",)),
    Mutant("the hyperparameter search's trials run without their sampled settings", "shardwise/tools/tune/target.py",
           '        return [a for k, v in params.items() if not k.startswith("param.") for a in ("--set", f"{k}={format_value(v)}")]',
           "        return []", ("tests/tools/test_tune_hparams.py::test_each_trial_is_a_run_of_its_own_and_two_ran_at_once",)),
    Mutant("the hyperparameter search's sampler is reseeded for each parallel trial", "shardwise/tools/tune/hparams.py",
           '{"reseed_rng": lambda self: None}', "{}", ("tests/tools/test_tune_hparams.py::test_the_seed_gives_the_same_values_at_any_parallel",)),
    Mutant("plot divides traffic by calls instead of steps", "shardwise/tools/plot/runs.py",
           'out[name] = {"sent": t.get("sent_bytes", 0) / steps', 'out[name] = {"sent": t.get("sent_bytes", 0) / max(t.get("count", 1), 1)',
           ("tests/tools/test_plot.py",)),
    Mutant("plot's throughput clock counts one step per logging interval", "shardwise/tools/plot/runs.py",
           '        t += steps * batch / r["samples_per_s"]', '        t += batch / r["samples_per_s"]', ("tests/tools/test_plot.py",)),
    # -- issue 36 item 8: bugs written without looking at this list (params servers, PowerSGD, data, planner, hang report, zygote)
    Mutant("planner: interleaved 1F1B activations drop the (p-1)/(pv) term", "shardwise/strategies/pipeline/cost.py",
           "in_flight = pp * (1 + (pp - 1) / (pp * shape.virtual))", "in_flight = pp * 1", (PLAN_INTERLEAVED,)),
    Mutant("planner: interleaved 1F1B activations drop the 1 (only the extra warm-up)", "shardwise/strategies/pipeline/cost.py",
           "in_flight = pp * (1 + (pp - 1) / (pp * shape.virtual))", "in_flight = pp * ((pp - 1) / (pp * shape.virtual))", (PLAN_INTERLEAVED,)),
    Mutant("planner: interleaved 1F1B activations drop the leading p (one micro-batch a stage)", "shardwise/strategies/pipeline/cost.py",
           "in_flight = pp * (1 + (pp - 1) / (pp * shape.virtual))", "in_flight = 1 + (pp - 1) / (pp * shape.virtual)", (PLAN_INTERLEAVED,)),
    Mutant("planner: interleaved 1F1B activations drop the chunks v", "shardwise/strategies/pipeline/cost.py",
           "in_flight = pp * (1 + (pp - 1) / (pp * shape.virtual))", "in_flight = pp * (1 + (pp - 1) / pp)", (PLAN_INTERLEAVED,)),
    Mutant("planner: interleaved 1F1B activations drop the -1 of p - 1", "shardwise/strategies/pipeline/cost.py",
           "in_flight = pp * (1 + (pp - 1) / (pp * shape.virtual))", "in_flight = pp * (1 + pp / (pp * shape.virtual))", (PLAN_INTERLEAVED,)),
    Mutant("planner: interleaved 1F1B activations drop the p of p v", "shardwise/strategies/pipeline/cost.py",
           "in_flight = pp * (1 + (pp - 1) / (pp * shape.virtual))", "in_flight = pp * (1 + (pp - 1) / shape.virtual)", (PLAN_INTERLEAVED,)),
    Mutant("per-sample randomness repeats every epoch (the epoch left out of the sample's seed)", "shardwise/data/__init__.py",
           "return (seed * 1_000_003 + epoch) * 2_147_483_647 + index * 7_919 + 1", "return seed * 1_000_003 * 2_147_483_647 + index * 7_919 + 1",
           (DATA_DRAWS,)),
    Mutant("per-sample randomness in the main process repeats epoch 0's", "shardwise/data/__init__.py",
           "return seeded_fetch(self.dataset, indices, self.collate_fn, self.seed, epoch)",
           "return seeded_fetch(self.dataset, indices, self.collate_fn, self.seed, 0)", (DATA_DRAWS,)),
    Mutant("per-sample randomness in data-loading workers repeats epoch 0's", "shardwise/data/__init__.py",
           "return seeded_fetch(self.dataset, indices, self.collate, self.seed, epoch)",
           "return seeded_fetch(self.dataset, indices, self.collate, self.seed, 0)", (DATA_DRAWS,)),
    Mutant("the worker loader ignores prefetch_factor (torch's default 2 in flight)", "shardwise/data/__init__.py",
           "                prefetch_factor=self.prefetch_factor,\n", "                prefetch_factor=None,\n",
           ("tests/data/test_data_pin_prefetch.py",)),
    Mutant("the Trainer's prefetch_factor never reaches the loader", "shardwise/trainer/fit.py",
           "            prefetch_factor=cfg.prefetch_factor or dl_prefetch,", "            prefetch_factor=dl_prefetch,",
           ("tests/trainer/test_data_path.py",)),
    Mutant("pin_memory without CUDA is ignored silently (the note never said)", "shardwise/trainer/fit.py",
           '            engine.print(f"shardwise: {self.pin_note}")', "            pass",
           ("tests/trainer/test_data_path.py",)),
    Mutant("the hang report says 'never reached' of a rank inside the collective (<= for <)", "shardwise/comm/ledger.py",
           "            if reached < mine.seq:", "            if reached <= mine.seq:", (HANG_REPORT_UNIT, HANG_REPORT_3)),
    Mutant("the hang report counts a collective as reached only once left (a rank waiting in it 'never reached' it)", "shardwise/comm/ledger.py",
           "            reached = pos.counts.get(mine.group, 0) if pos is not None else 0",
           "            reached = pos.counts.get(mine.group, 0) - (pos.inside and pos.group == mine.group) if pos is not None else 0",
           (HANG_REPORT_UNIT, HANG_REPORT_3)),
    Mutant("a rank started fresh after the zygote refused still follows the zygote's pid", "shardwise/launcher/spawn.py",
           '                    zygote = None\n                    child_env["SHARDWISE_PARENT_PID"] = str(os.getpid())\n',
           "                    zygote = None\n", (ZYGOTE_FALLBACK,)),
    Mutant("PowerSGD without error feedback", "shardwise/comm/hooks.py",
           "            use_error_feedback=True,", "            use_error_feedback=False,", ("tests/strategies/data_parallel/test_ddp_comm.py",)),
    Mutant("a parameter-server resume at more servers loses the later servers' optimizer state", "shardwise/strategies/param_server/server.py",
           'self.optimizer.load_state_dict({"state": state, "param_groups": [group]})',
           'self.optimizer.load_state_dict({"state": state if self.index < int(first["servers"]) else {}, "param_groups": [group]})',
           ("tests/strategies/param_server/test_ps_resume.py",)),
    Mutant("a parameter-server resume at another count restores the first server's optimizer state only", "shardwise/strategies/param_server/server.py",
           'for j, g in enumerate(self.param_ids) if where[g][1] in where[g][0]["optimizer"]["state"]',
           'for j, g in enumerate(self.param_ids) if where[g][0] is first and where[g][1] in where[g][0]["optimizer"]["state"]',
           ("tests/strategies/param_server/test_ps_resume.py",)),
    # -- end of issue 36 item 8 (M)
    # issue 36 item 8 (T): caught by the tests named in each entry
    Mutant("GPT-2's fused c_attn bias optimizer state saved in tp's per-rank head layout (a tp checkpoint resumed under single gets scrambled moments)",
           "shardwise/strategies/tensor_parallel/relayout.py",
           "            entry = osd[\"state\"].get(name)\n            if isinstance(entry, dict):",
           "            entry = osd[\"state\"].get(name)\n            if isinstance(entry, dict) and not name.endswith(\".bias\"):",
           ("tests/strategies/tensor_parallel/test_matrix_tp.py::test_gpt2_fused_optimizer_state_is_saved_in_the_original_layout_and_resumes_under_single",)),
    Mutant("hsdp with its mesh dimensions swapped (the DeviceMesh built shard x replicate)", "shardwise/strategies/sharded/units.py",
           "init_device_mesh(mesh.device.type, (replicate, dp // replicate), mesh_dim_names=(\"replicate\", \"shard\"))",
           "init_device_mesh(mesh.device.type, (dp // replicate, replicate), mesh_dim_names=(\"replicate\", \"shard\"))",
           (HSDP_SHAPES,)),
    Mutant("hsdp with its (replicate, shard) pair swapped", "shardwise/strategies/sharded/fsdp.py",
           "        replicate, shard = self.shape(mesh.size(\"dp\"))", "        shard, replicate = self.shape(mesh.size(\"dp\"))", (HSDP_SHAPES,)),
    Mutant("the start-of-run broadcast of a weight tied across pipeline stages lands in a copy", "shardwise/strategies/pipeline/ties.py",
           "            buf = p.data if p is not None else", "            buf = p.data.clone() if p is not None else",
           ("tests/strategies/pipeline/test_own_models.py::test_a_weight_tied_across_stages_starts_from_the_first_owners_values",)),
    Mutant("launch sends only what plain pickle can (no cloudpickle for lambdas and closures)", "shardwise/launcher/payload.py",
           "    try:\n        return _dumps((fn, args, kwargs), pickler)", "    try:\n        raise pickle.PicklingError(\"mutant\")",
           ("tests/launcher/test_payload.py",)),
    Mutant("a script's lambda sent with copies of the parent's globals (not the worker's __main__)", "shardwise/launcher/payload.py",
           "                reduced = _in_workers_main(reduced, self)", "                pass", ("tests/launcher/test_payload.py",)),
    Mutant("an unpicklable object named by its argument only, not its path inside", "shardwise/launcher/payload.py",
           "    for _ in range(_MAX_DEPTH):", "    for _ in range(0):", ("tests/launcher/test_payload.py",)),
    Mutant("shardwise train --model takes what the factory returns without checking it is a module", "shardwise/cli.py",
           "    if not isinstance(model, nn.Module):\n        raise", "    if False:\n        raise", ("tests/trainer/test_train_own_model.py",)),
    Mutant("plan prints a bare recommendation when nothing fits", "shardwise/tools/advisor/commands.py",
           "        advice[\"why\"] += \". \" + fits_with_accumulation(model, cluster, settings)", "        pass", ("tests/tools/advisor/test_plan_cli.py",)),
    Mutant("naive-mp runs the top-level children of a forward that does more (the pipeline's silent skip, again)",
           "shardwise/strategies/pipeline/naive_mp.py", "    check_forward_is_its_layers(model)\n    runs", "    runs", ("tests/strategies/pipeline/test_split.py",)),
    Mutant("the non-finite check accumulates gradient norms in float32 (a diverging but finite run is stopped)", "shardwise/trainer/nonfinite.py",
           "torch._foreach_norm(grads, 2, dtype=torch.float64)", "torch._foreach_norm(grads)", ("tests/trainer/test_nonfinite.py",)),
    Mutant("the non-finite verdict is not agreed across ranks", "shardwise/trainer/nonfinite.py",
           "        if self.size > 1:\n            total = all_reduce(", "        if False:\n            total = all_reduce(",
           ("tests/trainer/test_nonfinite_dist.py",)),
    Mutant("local SGD's replicas agree on a non-finite verdict every step (a collective inside every step)", "shardwise/trainer/fit.py",
           "agree=engine.steps_together", "agree=True",
           ("tests/launcher/test_hang_report.py::test_the_step_barrier_of_debug_collectives_names_the_rank_that_did_not_come",)),
    Mutant("pruning deletes the newest finite checkpoint", "shardwise/checkpoint/files.py",
           "    keep = next((p for p in reversed(ours) if is_finite(p)), None)", "    keep = None", ("tests/trainer/test_nonfinite.py",)),
    Mutant("resume='auto' takes a checkpoint saved after non-finite steps", "shardwise/trainer/resume.py",
           "latest_valid(Path(cfg.out) / \"checkpoints\", finite=True)", "latest_valid(Path(cfg.out) / \"checkpoints\", finite=False)",
           ("tests/trainer/test_nonfinite.py",)),
    # -- activation checkpointing (issue 37) ------------------------------------------------------
    Mutant("activation checkpointing is applied to no block", "shardwise/strategies/checkpointing.py",
           "    for i in policy.chosen(len(blocks)):", "    for i in policy.chosen(0):", (AC_UNIT, AC_SINGLE)),
    Mutant("the Engine never applies activation checkpointing", "shardwise/engine/engine.py",
           "        checkpointing.apply(model, self.activation_checkpointing)\n", "", (AC_SINGLE,)),
    Mutant("a recomputed block draws new dropout masks", "shardwise/strategies/checkpointing.py",
           "checkpoint(self._forward, *args, use_reentrant=False, context_fn=context, **kwargs)",
           "checkpoint(self._forward, *args, use_reentrant=False, preserve_rng_state=False, context_fn=context, **kwargs)", (AC_SINGLE,)),
    Mutant("a checkpointed block keeps a key/value cache passed by position (GPT-2's), written again by the recompute",
           "shardwise/strategies/checkpointing.py",
           "        if any(i < len(args) and args[i] is not None for i in self.cache_at):", "        if False:", (AC_SINGLE,)),
    Mutant("selective checkpointing keeps no matmul output", "shardwise/strategies/checkpointing.py",
           "    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE",
           "    return CheckpointPolicy.PREFER_RECOMPUTE", (AC_UNIT,)),
    Mutant("the planner counts a checkpointed block's whole activations", "shardwise/strategies/cost/estimate.py",
           "    kept_layer = spec.kept_layer_bytes(micro, tp, shape.sequence_parallel)", "    kept_layer = full_layer", (AC_UNIT,)),
    Mutant("the planner's recompute costs nothing", "shardwise/strategies/cost/estimate.py",
           "    recompute = compute / 3 * mem.recomputed / mem.layers if mem.recomputed else 0.0", "    recompute = 0.0", (AC_UNIT,)),
    Mutant("plan proposes activation checkpointing and offload for layouts that fit without them", "shardwise/tools/advisor/candidates.py",
           "        if record[\"fits\"] or record[\"refused_by_plan\"]:", "        if record[\"refused_by_plan\"]:", (AC_UNIT,)),
    Mutant("plan recommends distributing even where one process is predicted faster (issue 39)", "shardwise/tools/advisor/recommend.py",
           "single[\"step_time_s\"] < multi[\"step_time_s\"])", "single[\"step_time_s\"] > multi[\"step_time_s\"])",
           ("tests/tools/advisor/test_one_process.py",)),
    Mutant("the planner costs every process with the one-thread timing (issue 39)", "shardwise/strategies/cost/estimate.py",
           "    timed = spec.fit_for(s.cluster.threads_per_process) if dev.local else None", "    timed = spec.step_fit if dev.local else None",
           ("tests/tools/advisor/test_one_process.py",)),
    Mutant("the planner ignores the machine's load (issue 39)", "shardwise/strategies/cost/cluster.py",
           "        run = max(1.0, (self.per_node * self.threads_per_process + self.load) / cores)",
           "        run = max(1.0, self.per_node * self.threads_per_process / cores)", ("tests/tools/advisor/test_one_process.py",)),
    Mutant("the launched ranks ignore the Trainer's threads setting (issue 39)", "shardwise/trainer/loop.py",
           "            threads_per_proc=threads,\n", "            threads_per_proc=None,\n", ("tests/trainer/test_threads.py",)),
    Mutant("an in-process run ignores the threads setting (issue 39)", "shardwise/trainer/loop.py",
           "        if threads is not None:\n            torch.set_num_threads(threads)", "        if False:\n            torch.set_num_threads(threads)",
           ("tests/trainer/test_threads.py",)),
    Mutant("the launcher overrides a user's OMP_NUM_THREADS with cores // nproc (issue 39)", "shardwise/launcher/spawn.py",
           "    return user_threads() or max(1,", "    return max(1,", ("tests/trainer/test_threads.py",)),
    Mutant("the plan's run-it command never names --threads (issue 39)", "shardwise/tools/advisor/recommend.py",
           "        if threads != auto:", "        if False:", ("tests/tools/advisor/test_one_process.py",)),
    Mutant("a meta-built model's replay skips the draws of initializers whose values are overwritten", "shardwise/strategies/materialize/fill.py",
           "                    if op.seeded:  # overwritten later", "                    if False:  # overwritten later", ("tests/strategies/test_meta_init.py",)),
    Mutant("materialization unties a tied weight", "shardwise/strategies/materialize/fill.py",
           "        for m, name in group[1:]:\n            m._parameters[name] = first", "        for m, name in group[1:]:\n            pass", ("tests/strategies/test_meta_init.py",)),
    Mutant("tp's fused q|k|v is filled unpermuted on a meta-built model", "shardwise/strategies/tensor_parallel/__init__.py",
           "materialize.fill_share(model, [model], mesh.device, fused_layout(model))", "materialize.fill_share(model, [model], mesh.device, None)",
           ("tests/strategies/test_meta_init.py",)),
    Mutant("fit's fingerprint of the model ignores its values (a trained model looks fresh to the workers)", "shardwise/trainer/handoff.py",
           "        if not t.is_meta and t.numel():", "        if False and not t.is_meta and t.numel():", ("tests/trainer/test_handoff.py",)),
    Mutant("a pipeline checkpoint's parts merged without the model's key order", "shardwise/checkpoint/parts.py",
           "    if order is not None:\n        known = set(order)", "    if False:\n        known = set(order)", ("tests/checkpoint/test_parts.py", "tests/strategies/pipeline/test_nested.py")),
    Mutant("the config machine gives a number field's flag no type (its value stays a string)", "shardwise/config.py",
           "        if base in (int, float):\n            kw[\"type\"] = base", "        pass", ("tests/test_config.py",)),
    Mutant("mpirun's ranks inside a Slurm allocation read as Slurm's (the SLURM_* of mpirun's own step)", "shardwise/launcher/env.py",
           "    mpi = mpi_env(env)\n", "    mpi = None if \"SLURM_PROCID\" in env else mpi_env(env)\n", ("tests/launcher/test_env.py",)),
    Mutant("mpirun's variables ignored (each process trains alone)", "shardwise/launcher/env.py",
           "    if family is None:\n        return None\n", "    if True:\n        return None\n",
           ("tests/launcher/test_mpi.py::test_two_shardwise_train_processes_started_with_openmpis_variables_train_one_job",)),
    Mutant("hierarchical allreduce's leaders average over their node only (avg divided by the node size)", "shardwise/comm/hierarchical.py",
           "        flat.div_(levels.node_size * levels.nodes)", "        flat.div_(levels.node_size)", ("tests/comm/test_hierarchical.py",)),
    Mutant("a gather's root is recorded receiving every piece, its own included", "shardwise/comm/recorder.py",
           "        root, other = (p - 1) * payload // p, payload // p", "        root, other = payload, payload // p", ("tests/engine/test_collectives.py",)),
    Mutant("engine.reduce returns the (unspecified) tensor on ranks other than dst", "shardwise/engine/collectives.py",
           "        reduce(tensor.clone(), dst, op, group=self.group, recorder=self.recorder)\n        return None",
           "        return reduce(tensor, dst, op, group=self.group, recorder=self.recorder) or tensor", ("tests/engine/test_collectives.py",)),
    Mutant("engine.gather/reduce send unequal shapes without checking the headers (gloo aborts a rank)", "shardwise/engine/collectives.py",
           "        if all(h == seen[0] for h in seen) and seen[0][0] >= 0", "        if True or all(h == seen[0] for h in seen) and seen[0][0] >= 0",
           ("tests/engine/test_collectives.py",)),
    Mutant("ddp hierarchical on one node says nothing", "shardwise/comm/hooks.py",
           "        if state.levels.nodes == 1 and group.size > 1 and group.rank == 0:", "        if False:", ("tests/engine/test_collectives.py",)),
    Mutant("bench scaling: a row's speed-up against its own strategy's one-process run, not its baseline's (single's for ps)",
           "shardwise/tools/bench/scaling.py", 'base = by_key.get((r["baseline"], 1))', 'base = by_key.get((r["strategy"], 1))',
           ("tests/tools/test_bench_scaling.py",)),
    Mutant("bench scaling: the warm-up intervals are counted in the throughput", "shardwise/tools/bench/scaling.py",
           'r.get("step", 0) > warmup', 'r.get("step", 0) >= 0', ("tests/tools/test_bench_scaling.py",)),
    Mutant("a preempted Flyte task returns its half-trained outputs (Flyte never retries it)", "shardwise/integrations/flyte.py",
           '    if summary is not None and summary.get("preempted"):\n', '    if False:\n',
           ("tests/integrations/test_orchestrators.py::test_a_preempted_flyte_gpu_task_is_retried_and_resumes_to_the_uninterrupted_result",)),
    Mutant("standalone_env keeps Slurm's task variables: a bench/tune child inside srun joins the parent's job", "shardwise/launcher/env.py",
           '*("SLURM_PROCID", "SLURM_NTASKS", ', '*(', ("tests/launcher/test_env.py",)),
    Mutant("plan costs a module:factory on a datasheet GPU by FLOPs alone (3.2e-05 ms a step for a tiny MLP)", "shardwise/tools/advisor/commands.py",
           "here = args.model in available() or factory or", "here = args.model in available() or",
           ("tests/tools/advisor/test_forecast.py::test_plan_of_a_tiny_hand_written_factory_predicts_a_step_of_the_order_it_measures",)),
    # -- issue 40 (pipeline): per-layer patterns, a training_step calling self(x, y) ---------------------
    Mutant("pipeline: a nested stage's block list holds only its own blocks (the loop's index picks block 0's layer type)",
           "shardwise/strategies/pipeline/nested.py",
           'own._modules = {k: m if k in mine or m is None else _Elsewhere(self._holder, m, f"{layout.blocks}.{k}") for k, m in blocks._modules.items()}',
           "own._modules = {k: m for k, m in blocks._modules.items() if k in mine}",
           ("tests/strategies/pipeline/test_own_step_and_patterns.py",)),
    Mutant("pipeline: the targets of a training_step's self(x, y) never reach the stages", "shardwise/strategies/pipeline/run.py",
           "            kwargs = self._call.stage_kwargs(batch) if self._call is not None else batch_kwargs(call_args, call_kwargs)",
           "            kwargs = batch_kwargs(call_args, call_kwargs)",
           ("tests/strategies/pipeline/test_own_step_and_patterns.py",)),
    Mutant("pipeline: a transformers model's block-list split is never proven on the sample (Gemma3n not refused before launch)",
           "shardwise/strategies/pipeline/__init__.py",
           "            if check and sample is not None and provable(model):", "            if False:",
           ("tests/strategies/pipeline/test_own_step_and_patterns.py::test_per_layer_input_embeddings_are_refused_before_launch_by_the_proof",)),
    Mutant("context parallel: a block from an earlier cp rank is attended whole (its second chunk lies in the future)",
           "shardwise/strategies/context_parallel/ring.py",
           "        return slice(0, n), slice(0, half), False",
           "        return slice(0, n), slice(0, n), False",
           ("tests/strategies/context_parallel/test_context_parallel.py::test_cp2_matches_single_and_bytes_match_the_formulas",)),
    Mutant("context parallel: labels split without the shift by one (each chunk's last token scored against its own)",
           "shardwise/strategies/context_parallel/zigzag.py",
           "    return torch.cat([labels[:, 1:], pad], dim=1)",
           "    return labels",
           ("tests/strategies/context_parallel/test_context_parallel.py::test_the_model_s_own_loss_is_the_loss_of_all_tokens",)),
    Mutant("ep: expert gradients divided by ep instead of dp (right only when dp_outer is 1)", "shardwise/strategies/expert_parallel/apply.py",
           "        flat.div_(self.dp)\n", "        flat.div_(self.ep)\n",
           ("tests/strategies/expert_parallel/test_matrix_ep.py::test_ep_inside_dp_on_four_ranks_matches_single",)),
    Mutant("ep: the clip's norm counts only this rank's expert slices", "shardwise/strategies/expert_parallel/apply.py",
           "        all_reduce(exp, \"sum\", group=self.group, recorder=self.recorder)\n", "",
           ("tests/strategies/expert_parallel/test_matrix_ep.py::test_ep2_on_two_ranks_matches_single",)),
    Mutant("tp: packed gate|up experts split without the permutation (one rank gets all of gate, the other all of up)",
           "shardwise/strategies/tensor_parallel/experts.py", "        if parts > 1:\n", "        if parts > 99:\n",
           ("tests/strategies/tensor_parallel/test_styles.py::test_declared_styles_train_like_single_under_tp2",)),
    Mutant("tp: latent attention's shared rotary key without its gradient summed over tp", "shardwise/strategies/tensor_parallel/apply.py",
           "        key = DTensor.from_local(key, tp_mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))\n",
           "        key = key + 0.0\n",
           ("tests/strategies/tensor_parallel/test_styles.py::test_declared_styles_train_like_single_under_tp2",)),
    Mutant("tp: a plan pattern's * matches across dots", "shardwise/strategies/tensor_parallel/checks.py",
           '            out.append("[^.]*")\n', '            out.append(".*")\n',
           ("tests/strategies/tensor_parallel/test_styles.py::test_a_pattern_star_matches_one_path_segment",)),
    Mutant("zoo: a declared style (embedding_rowwise) left to the catch-all refusal", "shardwise/strategies/tensor_parallel/plan.py",
           '        "embedding_rowwise",\n', "",
           ("tests/strategies/test_zoo_styles.py",)),
    Mutant("zoo: refusals of declared styles all worded as the unknown style's", "shardwise/strategies/tensor_parallel/plan.py",
           '_HF_REFUSED.get(style, "a style shardwise does not know")', '"a style shardwise does not know"',
           ("tests/strategies/test_zoo_styles.py",)),
    Mutant("tp: Gemma 3n's activation-sparsity MLP split by columns (its statistic over 1/tp of the hidden units)",
           "shardwise/strategies/tensor_parallel/checks.py", "        if isinstance(sparsity, (int, float)) and sparsity > 0:\n",
           "        if isinstance(sparsity, (int, float)) and sparsity > 1:\n",
           ("tests/strategies/tensor_parallel/test_styles.py::test_declared_styles_train_like_single_under_tp2",)),
    Mutant("tp: scalar parameters inside a sublayer (XIELU's alphas) without their gradients summed over tp",
           "shardwise/strategies/tensor_parallel/roles.py",
           "            summed += [_join(name, n) for n in own_params]  # scalars",
           "            summed += []  # scalars",
           ("tests/strategies/tensor_parallel/test_styles.py::test_declared_styles_train_like_single_under_tp2",)),
    Mutant("tp: attention sinks (one per head) whole instead of split with their heads",
           "shardwise/strategies/tensor_parallel/apply.py",
           "        experts.split_heads(module.get_submodule(name), heads, tp_mesh)",
           "        pass",
           ("tests/strategies/tensor_parallel/test_styles.py::test_declared_styles_train_like_single_under_tp2",)),
    Mutant("zoo: a NaN cell counted exact", "benchmarks/zoo.py",
           '    return "exact" if diff <= tol else "WRONG"\n', '    return "WRONG" if diff > tol else "exact"\n',
           ("tests/strategies/test_zoo_sweep.py::test_a_cell_off_single_is_wrong_and_counted",)),
    Mutant("tp: an undeclared per-head norm (Lfm2's q_layernorm) left out of the gradient sum",
           "shardwise/strategies/tensor_parallel/roles.py",
           "        if in_sub and own_params and (all(m.get_parameter(n).numel() == 1 for n in own_params) or _per_head_norm(module, in_sub[0], m, own_params)):",
           "        if in_sub and own_params and all(m.get_parameter(n).numel() == 1 for n in own_params):",
           ("tests/strategies/tensor_parallel/test_styles.py::test_undeclared_per_head_norms_and_scalars_inside_a_sublayer_have_their_gradients_summed",)),
    Mutant("context parallel: the parent's emulated-rank check skipped (a rotary model built from arange(t) trains silently wrong)",
           "shardwise/strategies/context_parallel/__init__.py",
           "    check_ranks(model, args, kwargs, cp, strategy)", "    pass",
           ("tests/strategies/context_parallel/test_emulate.py::test_refuses_rotary_positions_built_from_arange_inside_forward",)),
    Mutant("context parallel: a position embedding fed arange(t) keeps the local positions (nanoGPT's wpe), caught in the parent",
           "shardwise/strategies/context_parallel/hooks.py",
           "            return (pos.expand_as(idx),)", "            return None",
           ("tests/strategies/context_parallel/test_emulate.py::test_the_exact_families_pass",)),
    Mutant("an uneven evaluation skips the padding forward once the keys are known", "shardwise/trainer/evaluate.py",
           "            padded = list(eval_fn(", "            padded = [] if keys else list(eval_fn(",
           ("tests/tools/test_run_tools_dist.py::test_an_uneven_evaluation_runs_the_padding_forward_under_zero3",)),
    Mutant("plan: ep's experts also counted in what the strategy replicates or shards (not taken out of psi)",
           "shardwise/strategies/expert_parallel/cost.py",
           "        return psi - spec.expert_params", "        return psi",
           ("tests/strategies/cost/test_option_costs.py::test_ep_candidates_divide_the_experts_and_send_the_all_to_all_s_bytes",)),
    Mutant("plan: cp's logits split over the cp ranks like the blocks' activations (they are gathered whole)",
           "shardwise/strategies/context_parallel/cost.py",
           '        memory["activations"] += _logits(s.spec, s.micro) * (s.shape.cp - 1)', '        memory["activations"] += 0.0',
           ("tests/strategies/cost/test_option_costs.py::test_cp_candidates_hold_half_the_activations_and_send_the_ring_s_bytes",)),
    Mutant("cp: the Trainer's call of training_step drops an instance's own forward (cp's): inputs not split",
           "shardwise/engine/engine.py", "    def redirect(*a: Any, **k: Any) -> Any:\n        put_back()",
           "    def redirect(*a: Any, **k: Any) -> Any:\n        module.__dict__.pop(\"forward\", None)",
           ("tests/strategies/context_parallel/test_context_parallel.py::test_a_training_step_keeps_cp_s_forward_and_workers_train_the_parent_s_class",
            "tests/strategies/context_parallel/test_context_parallel.py::test_a_model_s_training_step_goes_through_cp")),
    Mutant("cp: the parent's checks skipped for a model with a training_step (a 14-token sequence trains under cp=2)",
           "shardwise/trainer/plan.py", '    own_cp = has_step and layout.degrees.get("cp", 1) > 1', "    own_cp = False",
           ("tests/strategies/context_parallel/test_context_parallel.py::test_a_training_step_model_is_checked_before_launch",)),
    Mutant("handoff: a worker's own model of the same weights but another class taken for the parent's",
           "shardwise/trainer/handoff.py", "    h.update(type(model).__qualname__.encode())", "    pass",
           ("tests/strategies/context_parallel/test_context_parallel.py::test_a_training_step_keeps_cp_s_forward_and_workers_train_the_parent_s_class",)),
    Mutant("ep memory table: the experts kept whole per ep rank predicted as sharded by FSDP (trial 40 F6: 1.7x low)",
           "shardwise/strategies/sharded/zero1.py",
           "model_state_bytes(stage, self.psi - self.whole, self.shard_degree", "model_state_bytes(stage, self.psi, self.shard_degree",
           ("tests/strategies/expert_parallel/test_ep_memory.py",)),
    Mutant("ep: experts matched by argument names only (forward(hidden, ...) refused; trial 40 F2)",
           "shardwise/strategies/expert_parallel/detect.py",
           "    return rest_optional and all(", "    return False and all(",
           ("tests/strategies/expert_parallel/test_ep_refusals.py::test_three_positional_arguments_are_taken_under_any_names_and_their_shapes_checked",)),
    Mutant("context parallel: an output that is not per token (a sequence classifier's) passes the parent's check",
           "shardwise/strategies/context_parallel/emulate.py",
           "    worst = max(ranks, key=lambda r: _rel(r, whole))", "    worst = whole",
           ("tests/strategies/context_parallel/test_emulate.py::test_refuses_an_output_that_is_not_per_token",)),
    Mutant("tp: a declared colwise on a fused q|k|v of a layout shardwise cannot tell (CodeGen) split by plain columns",
           "shardwise/strategies/tensor_parallel/plan.py",
           "        resolved = gather_unknown_fused(module, resolved)", "        pass",
           ("tests/strategies/tensor_parallel/test_styles.py::test_declared_styles_train_like_single_under_tp2",)),
    Mutant("zero3: a submodule whose weight the root's forward reads (a functional tied head) made a unit of its own",
           "shardwise/strategies/sharded/units.py",
           "    return _read_inside(model, _auto_units(model, min_fraction))", "    return _auto_units(model, min_fraction)",
           ("tests/strategies/sharded/test_units_reads.py::test_zero3_trains_the_functional_head_model_exactly_as_single",)),
    Mutant("context parallel: a model's own loss reported as the sum over cp ranks, not the mean over all tokens",
           "shardwise/strategies/context_parallel/apply.py",
           'all_reduce(mean, "mean", group=state.group', 'all_reduce(mean, "sum", group=state.group',
           ("tests/strategies/context_parallel/test_context_parallel.py::test_the_model_s_own_loss_is_the_loss_of_all_tokens",)),
    Mutant("streams: every rank keeps the stride of rank 0 (i % W == 0): ranks train the same samples, some never",
           "shardwise/data/stream.py", "    mine = pairs[spec.rank :: spec.world_size]", "    mine = pairs[0 :: spec.world_size]",
           ("tests/data/test_stream.py::test_each_step_is_the_next_global_batch_by_stride_at_any_world_size",)),
    Mutant("streams: the saved position one global batch behind (a resume trains a step twice)",
           "shardwise/data/stream.py", '            "consumed": self.consumed,', '            "consumed": self.consumed - self.global_batch,',
           ("tests/trainer/test_stream_fit.py::test_a_stream_resumes_bitwise_replayed_or_from_its_state_and_at_another_world_size",)),
    Mutant("streams: a source that splits itself over a DataLoader's workers is not read whole in each worker",
           "shardwise/data/stream.py", "    worker._worker_info = None\n", "    worker._worker_info = saved\n",
           ("tests/data/test_stream.py::test_two_workers_give_the_batches_of_none_bit_for_bit_resume_included",)),
    Mutant("streams: a Hugging Face stream read in a loader worker as HF hands it out there (some shards per worker), not whole",
           "shardwise/data/stream.py", "    worker._worker_info = None\n", "    worker._worker_info = saved\n",
           ("tests/integrations/test_hf_datasets.py::test_a_parquet_stream_or_two_loader_workers_train_as_the_json_lines_stream_without",)),
    Mutant("token shards: the shuffle window's seed ignores the epoch (every epoch permutes a window alike)",
           "shardwise/data/order.py", "_rng(self.seed, self.epoch, w, 1)", "_rng(self.seed, 0, w, 1)",
           ("tests/data/test_files.py::test_each_epoch_visits_every_block_once_and_seed_and_epoch_change_the_order",)),
    Mutant("token shards: a block read one token late (off by one in the block's byte offset)",
           "shardwise/data/files.py", "at = self._offsets[k] + start * dt.itemsize", "at = self._offsets[k] + (start + 1) * dt.itemsize",
           ("tests/data/test_files.py::test_a_small_corpus_packs_into_the_blocks_written_out_by_hand",)),
    Mutant("token shards: the loader ignores the dataset's epoch_order (a full randperm instead)",
           "shardwise/data/__init__.py", '    own = getattr(dataset, "epoch_order", None)', "    own = None",
           ("tests/data/test_files.py::test_the_loader_trains_the_datasets_own_order_at_any_world_size",)),
    Mutant("token shards: the document mask lets a token see the earlier documents of its block",
           "shardwise/data/files.py", "mask = (doc[:, None] == doc[None, :]) & (t[:, None] >= t[None, :])", "mask = t[:, None] >= t[None, :]",
           ("tests/data/test_files_docmask.py",)),
    Mutant("token shards: a subclass that augments inherits the skip of per-sample seeding (its draws then depend on the worker)",
           "shardwise/data/__init__.py", 'return vars(klass).get("draws_no_randomness") is True', 'return getattr(dataset, "draws_no_randomness", False) is True',
           ("tests/data/test_files.py::test_only_the_class_that_reads_the_blocks_skips_the_per_sample_seeding",)),
    Mutant("streams: validation over a stream skips the padding forward (zero3's gathers unpaired: the ranks hang)",
           "shardwise/trainer/streams.py", "        for _ in range(calls - done):", "        for _ in range(0):",
           ("tests/trainer/test_stream_fit.py::test_validating_a_stream_under_zero3_pads_the_uneven_rank_and_counts_each_sample_once",)),
    Mutant("streams: the last smaller global batch's micro-batches all weighted 1 (the step is not the mean over its samples)",
           "shardwise/data/stream.py", "    return out, [size * parts / len(pairs) for size in sizes]", "    return out, [1.0 for size in sizes]",
           ("tests/trainer/test_stream_fit.py::test_the_last_smaller_batch_of_a_stream_trains_as_a_hand_loop",)),
    Mutant("streams: a Hugging Face stream shuffled with a buffer resumed by its own state (which lacks the buffer)",
           "shardwise/data/stream.py",
           'return self.resume == "auto" and stateful(self.source) and not state_loses_samples(self.source)',
           'return self.resume == "auto" and stateful(self.source)',
           ("tests/integrations/test_hf_shuffle_resume.py",)),
    Mutant("data: a bool document mask given to eager attention (adds it: masks nothing) not refused",
           "shardwise/data/batches.py", "    check_mask_kind(model, batch)\n", "    pass\n",
           ("tests/data/test_files_mask_kind.py",)),
    Mutant("streams: draws_no_randomness read from any class of the source, so an augmenting subclass is not seeded",
           "shardwise/data/stream.py", 'seeded = not draws_no_randomness(spec.source, "__iter__")',
           'seeded = not getattr(spec.source, "draws_no_randomness", False)',
           ("tests/data/test_stream.py::test_a_stream_that_says_it_draws_no_randomness_is_not_seeded_a_subclass_that_augments_is",)),
    Mutant("streams: every sample of a step read with the step's first seed (a Hugging Face .map drawing random numbers gives a step's rows one draw)",
           "shardwise/data/stream.py", "_seed_all(sample_seed(seed, epoch, start + t))", "_seed_all(sample_seed(seed, epoch, start))",
           ("tests/integrations/test_hf_datasets.py::test_an_augmenting_map_draws_the_same_at_any_world_size_and_on_a_replay",)),
    Mutant("handoff: the model's fingerprint leaves out plain settings (a sweep's second fit trains the first model)",
           "shardwise/trainer/handoff.py",
           '        h.update(f"{name}:{type(module).__qualname__}:{_settings(module)}".encode())', "        pass",
           ("tests/trainer/test_handoff.py",)),
    Mutant("streams: a stream that reads differently per process (sharded by rank, unseeded filter) trains on",
           "shardwise/trainer/fit.py",
           "        streams.agree_on_first_batch(engine, self.loader)  # a stream that reads differently per process: refused, not trained",
           "        pass",
           ("tests/trainer/test_stream_fit.py::test_a_stream_that_reads_differently_per_process_is_refused_at_the_start",)),
    Mutant("token shards: a resume with another shuffle window (another order) accepted",
           "shardwise/data/__init__.py",
           '        if "order_key" in state and isinstance(key, str) and state["order_key"] != key:', "        if False:",
           ("tests/data/test_files.py::test_a_resume_whose_order_would_differ_is_refused",)),
    Mutant("streams: a stream whose __len__ is wrong trains epochs cut by it, nothing said",
           "shardwise/data/stream.py", "    if spec.length is not None and read != spec.length:", "    if False:",
           ("tests/data/test_stream.py::test_limit_epochs_and_the_callers_generators",)),
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
    owned = "--owned" in argv
    words = [a for a in argv if a != "--owned"]
    chosen = [m for m in MUTANTS if (not words or any(a.lower() in m.name.lower() for a in words))
              and (not owned or m.path.startswith(OWNED))]
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
