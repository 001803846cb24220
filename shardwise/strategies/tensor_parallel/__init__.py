"""``tp``: Megatron tensor parallelism on DTensor, optionally with sequence parallelism and data parallel.

Megatron-LM (Shoeybi et al. 2019) splits each transformer block's two matrix products inside
the layer: the first linear of a pair by output columns (``ColwiseParallel``: every rank holds
``1/tp`` of the output features, for attention whole heads), the second by input rows
(``RowwiseParallel``: every rank computes a partial sum, added across ranks). Between them no
communication is needed; each pair costs Megatron's ``f`` (identity forward, allreduce backward)
before the column-split linears and ``g`` (allreduce forward, identity backward) after the
row-split one. A block (attention + MLP) is therefore exactly 2 allreduces forward and 2
backward (tested). Here ``f`` and ``g`` are DTensor's own: ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel``, and ``PrepareModuleInput`` on a sublayer whose input
feeds several column-split linears (q, k, v), so the three input gradients are summed once.
Sequence parallelism (Korthikanti et al. 2022) shards the activations between the pairs along
the sequence, with the same bytes sent.

The package, by concern:

- ``plan``: which linears split how (`declared_plan`, `auto_plan`, `resolve_plan`, `check_divisible`); no process
  group needed.
- ``roles``: every other module's rule by its place in the block, and the backstop.
- ``styles``: the split styles for Linear and Conv1D, the fused q|k|v permutation, inputs bound by signature.
- ``relayout``: fused weights back in the original layout on save; `check_replicas`.
- ``apply``: `parallelize`, the sequence-parallel region, `synchronize_dropout`.
- ``grads``: `reduce_partial_grads`, `replicate_grads`, `shard_data_parallel`, `clip_grad_norm_`.
- ``counting``: `count_collectives` and the dispatch mode behind it.
- ``rehearse``: the split rehearsed in the parent on one sample batch (meta tensors, a fake process group).
- here: the `TensorParallel` strategy. ``plan`` (in the parent, no process group) settles the tp
  degree, refuses a world size it does not divide and a model the plan does not fit (plan,
  widths and heads, key/value heads included, divisible by tp; blocks for sequence parallelism;
  every module covered by a role). ``check_sample`` (in the parent, given one sample batch by the
  Trainer) rehearses the split on it. ``apply`` (per process) calls the blocks below in a fixed order
  (tensor first, then data parallel) and returns a `TensorParallelRun`.

Building blocks, for compositions with pipeline parallelism (stable signatures):

- `parallelize(module, tp_mesh, plan=None, sequence_parallel=False)`: in place, on a module whose
  submodules keep their original names (a whole model or a pipeline stage).
- `replicate_grads(module, dp_group, recorder=None)`: average every gradient's local tensor over
  the data-parallel group (one coalesced allreduce per dtype): data parallel for DTensor modules.
- `shard_data_parallel(module, dp_mesh, units="auto")`: FSDP2 ``fully_shard`` over the dp mesh
  (2D with tp when ``dp_mesh`` and the tp mesh are slices of one DeviceMesh).
- `clip_grad_norm_(parameters, max_norm, recorder=None)`: the global norm over DTensor (any mesh,
  any placements) and plain gradients.
- `reduce_partial_grads(module, recorder=None)`: after backward under sequence parallelism, the
  norm weights' partial gradients summed over tp (one coalesced allreduce).
- `count_collectives(recorder=None, **groups)`: count (and record) DTensor's and FSDP2's collectives.

Dropout on replicated activations draws the same mask on every tp rank (`synchronize_dropout`).
fp16 with a grad scaler is refused (torch's GradScaler cannot unscale mixed DTensor and plain
gradients); bf16-mixed runs.

Design notes: tensor parallelism
================================

`--strategy tp --tp N [--sequence-parallel] [--dp-strategy ddp|fsdp]`
(package `shardwise/strategies/tensor_parallel/`: `plan.py` the plans and their checks, `roles.py` every other module's rule and the backstop,
`styles.py` the split styles for `nn.Linear` and transformers' `Conv1D` and the fused q|k|v
permutation, `apply.py` `parallelize`, the sequence-parallel region and dropout, `grads.py` the
gradient reductions and clipping, `relayout.py` fused weights back in the original layout on save
and the replica check, `counting.py` the collective counter, `__init__.py` class `TensorParallel`;
options `tp` (default: the world size), `sequence_parallel`, `plan`, `dp_strategy` (`ddp` by
default), `count_collectives` (on by default), `check_replicas` (off by default)). Megatron-LM's split (Shoeybi et al. 2019) on DTensor:
`parallelize_module` with `ColwiseParallel`, `RowwiseParallel`, `SequenceParallel` and
`PrepareModuleInput`, on the tp slice of the run's DeviceMesh (`Mesh.device_mesh("tp")`). The
strategy's `plan()` lays out `{"tp": N}`, so the engine builds `dp = world / N` x
`tp = N`, ranks dp-major, tp fastest: the tp ranks of one replica are neighbours and read the
same batch (the trainer shards data by the dp coordinate).

**The split.** The first linear of each pair is split by output columns (`colwise`: weight and
bias `Shard(0)`; attention q, k, v by whole heads), the second by input rows (`rowwise`: weight
`Shard(1)`, bias replicated). Between them nothing is communicated: attention runs on this rank's
heads (charlm's `Attention` reads its head count from q's output width at run time), the MLP on
this rank's slice of the hidden units. Megatron's `f` (identity forward, allreduce of the input
gradient backward) sits before the colwise linears and `g` (allreduce forward, identity backward)
after the rowwise one. `f` is a forward pre-hook on each sublayer (the parent of colwise linears)
that turns its main input into a replicated DTensor: q, k and v then share one DTensor input,
their three partial input gradients are summed by autograd, and one allreduce reduces the sum
(`ColwiseParallel` alone would allreduce each of the three). The hook binds the call to the
forward's signature (first positional argument, or its keyword: HF layers call
`self_attn(hidden_states=...)`, which torch's positional `PrepareModuleInput` rejects with "module
inputs and input_layouts should have same length"). Attention split by heads runs on this rank's
heads: HF attention reshapes with `-1` heads; a module that stores head counts or widths
(GPT-2's `num_heads`, `split_size`, `embed_dim`; BERT's `num_attention_heads`, `all_head_size`) gets
them set to this rank's values (`plan.LOCAL_ATTRS`, divided by tp). Embedding, final norm and output head
stay replicated: every tp rank computes them whole on the same batch, so their gradients are whole
on every rank (no reduction, no double counting).

**Plans**, in order of preference: a user plan; else the model's declared plan (transformers'
`model._tp_plan`, which carries `config.base_model_tp_plan` under the base model's prefix:
`colwise` and `rowwise` are used, `replicated_with_grad_allreduce` (Qwen3's per-head `q_norm`)
sums that module's gradients over tp, the embedding and head styles (`embedding_rowwise`,
`colwise_gather_output`, ...) are skipped since shardwise keeps them whole, and any other style is
a `ConfigError` naming it); else `auto_plan(module)`: in every module, linear children (`nn.Linear`
or `Conv1D`) named like a pair's first linear are colwise and the one named like its second is
rowwise, when both are present:

| role | colwise names | rowwise names |
| --- | --- | --- |
| attention (a module with any of the q names) | `q k v query key value q_proj k_proj v_proj wq wk wv`, a stacked `c_attn` | `out o_proj proj out_proj wo c_proj` |
| MLP | `fc fc1 c_fc up_proj gate_proj w1 w3` | `proj fc2 down_proj w2 c_proj` |
| BERT family (BERT, RoBERTa, ViT, ...) | `*.{query,key,value}` and `intermediate.dense` | the sibling `output.dense` |

A module with colwise-named children but not exactly one rowwise-named child is left whole.
**Conv1D** (GPT-2's linear with weight `(in, out)`) splits with the dimensions swapped: colwise
`Shard(1)`, rowwise `Shard(0)`. **Fused q|k|v**: a stacked `c_attn` (q, k, v as three equal blocks,
GPT-2 and nanoGPT) is permuted once at the split so that each rank's contiguous shard holds its
heads' q, then k, then v; `state_dict` inverts the permutation (model weights and optimizer state,
by name) and `load_state_dict` re-applies it, so checkpoints, `consolidated_state_dict` and
exports have the original layout (tested: a tp checkpoint exported equals `single` at 1e-9 and
loads into a fresh GPT-2 with `strict=True`; fused + `dp_strategy="fsdp"` is refused). Other fused
names (`qkv`, `Wqkv`, `query_key_value`, `qkv_proj`, `in_proj`) are refused unless the model declares
its plan: their layout (stacked, or interleaved per head as in GPT-NeoX and Falcon) cannot be told
from the weights. An attention that keeps the model width and no head width (nanoGPT's `n_embd`
with `c // n_head`, `c` its input's width) cannot run on 1/tp of its heads: the automatic plan
leaves it whole (replicated) and splits its block's MLP. A model with convolutions and no linear
pair (ResNet) is refused: "tensor parallelism splits linear layers, not convolutions". A plan that
finds nothing else is a `ConfigError` naming the rules and showing a user plan. A user plan
(`tp_plan={...}`, its JSON text, or on the command line a TOML inline table,
`--set 'trainer.strategy_options.tp_plan={"layers.*.ff.lin1" = "colwise", "layers.*.ff.lin2" = "rowwise"}'`)
maps module names or fnmatch patterns (`"blocks.*.attn.[qkv]"`) to `"colwise"`/`"rowwise"`; a key
that matches nothing lists the closest names, a bad style suggests the closest one (in the
constructor, before launch). Checks against `tp` (in the parent before launch, through the
strategy's `plan(model=...)`, and again in `apply`): every split width divides by `tp`, and attention
splits whole heads, for q and for grouped-query k/v alike (Llama's `num_key_value_heads`: "k_proj
has 2 attention heads, which do not split across tp=4 ranks ...").

**The rehearsal before launch** (`rehearse.rehearse`, through `Strategy.check_sample`, which the Trainer
calls in the parent with one sample of the training data after `plan`). The rules above read module
names; whether a model takes the split is decided by the code in its ``forward``. So the parent runs
it: a copy of the model on meta tensors (no memory, no arithmetic), torch's ``fake`` process group of
``tp`` ranks in the parent (collectives that do nothing: shapes and placements are rank 0's, exact),
the same `parallelize` the workers call, one forward of the sample and a backward of its loss. Any
error is a `ConfigError` naming the innermost module running when it was raised (module forward
hooks keep the stack), with the first line of torch's message and what to do: a CNN under the
automatic plan splits ``fc1``/``fc2`` at the root, so the root's input becomes a DTensor and
``conv1 (Conv2d)`` fails with "got mixed torch.Tensor and DTensor"; an attention that reshapes with a
width read from its whole input (``view(b, t, heads, d // heads)``, tests/support/own_models.py's
``PosTransformer``) fails on its 1/tp heads with a shape error, with and without sequence
parallelism; a block that adds its own whole ``(T, d)`` position table to the residual stream fails
only under sequence parallelism (each rank holds T/tp positions). A failure under sequence
parallelism is rehearsed again without it, so the reason given is the one true for the model; and
up to four other linear pairs (consecutive, same parent, widths matching, outside the failing
module) are rehearsed and the first that runs is shown as a ``tp_plan`` to use. Not judged: a model
whose forward does not run on meta tensors even unsplit (``.item()``, a data-dependent branch:
BERT's here), a model with ``training_step``, and a process already in a process group (each rank
checks in ``apply``); the static checks still run. Not seen: wrong values with the right shapes
(a slice of a position table taken with ``x.shape[1]`` inside a sequence-sharded block). torch's
loggers are silenced meanwhile (and the fake-tensor logger in the workers, whose tracebacks repeat
the error the launcher reports). Cost: about 0.1-0.3 s per model here once DTensor is imported.

**Roles and the backstop** (`roles.roles`, run by `plan(model=...)` in the parent). Every module that
owns parameters or buffers gets a rule by its place, not its class: split linears are DTensor
shards; inside a sublayer (between `f` and `g`) only what the model declares
`replicated_with_grad_allreduce` is allowed (its gradient is summed over tp); in a block outside
the sublayers (any norm: `nn.LayerNorm`, `LlamaRMSNorm`, nanoGPT's own `LayerNorm`, BERT's
`output.LayerNorm`) parameters are replicated, and under sequence parallelism their gradients are
summed over tp (they saw a slice of the sequence); a module there holding linears the plan does not
split (nanoGPT's whole attention) runs on the gathered sequence under sequence parallelism; outside
the blocks (embeddings, final norm, head) everything is replicated and computed whole. A parameter
inside a sublayer with no declared rule, or a buffer inside a sequence-sharded block, is a
`ConfigError` naming the module. Blocks are the elements of the block list holding split linears
(`model.layers.3`, `transformer.h.0`, `encoder.layer.1`). **`check_replicas=True`** (a debug option,
on in the matrix tests) hashes every replicated parameter after each step and compares the digests
across the tp group (one all-gather), raising on the first that differs.

**Sequence parallelism** (Korthikanti et al. 2022). With `--sequence-parallel` the activations
between the pairs (the residual stream, layer norms, dropout) are sharded along the sequence
(dim 1, batch-first inputs) inside the blocks only: whatever the model computes outside them
(rotary cos/sin, position ids, attention masks) stays full-length and replicated, and reaches the
attention, which runs on the gathered sequence. The norms (by role, above) keep plain replicated
weights and run on this rank's slice; each sublayer's `f` hook gathers its input (an all-gather
forward and a reduce-scatter of the input gradient backward), and the rowwise linear's output
is `Shard(1)`, a reduce-scatter forward and an all-gather backward (`g`). Shards may be uneven
(`torch.chunk` sizes: ViT's 17 tokens on 2 ranks are 9 and 8): the region records the sequence
length and builds DTensors of the whole sequence; a sequence shorter than `tp` is refused. Each allreduce becomes
an all-gather plus a reduce-scatter of the same total bytes, and the norms and dropout hold `1/tp`
of the activations. The region begins at the first block's input (a local slice: no communication
forward, an all-gather of the gradient backward) and ends after the last block (an all-gather
forward, a slice backward), so a module's own input and output stay whole (a pipeline stage
exchanges whole activations). The norm weights' gradients are partial sums over the sequence shards;
`reduce_partial_grads` allreduces them once per step, coalesced into one buffer (Megatron does the
same for its sequence-parallel norm gradients), in `finish_grads`. The region's boundary hooks
bind the first block's input by signature and accept a block output that is a tensor or a tuple
(HF decoder layers return either, by version). Exact: parity with
`single` at 1e-9 and one step's gradients equal to 1e-12.

**Dropout.** Each rank draws from its own RNG stream, so a dropout on a replicated activation
(charlm's embedding dropout, the MLP's after its rowwise linear) would drop different elements on
each tp rank and the replicas of the residual stream would drift apart silently.
`synchronize_dropout` runs every `nn.Dropout` on a forked RNG seeded from a seed the tp group
shares (broadcast once), the module's index and its call count; inside sequence-sharded blocks the
tp rank is mixed in (each rank drops its own slice of the sequence). Attention's own dropout
(`dropout_p` of `scaled_dot_product_attention`) acts on this rank's heads and keeps the rank's
stream. Tested: with dropout 0.2 the replicated parameters stay bitwise identical across tp ranks
(without the hooks they differ by 5e-2 after 3 steps).

**Compositions (dp x tp).** Applied in a fixed order: tensor first, then data parallel.
`dp_strategy="ddp"`: `replicate_grads` averages every gradient's local tensor (a DTensor's shard
or a plain tensor) over the dp group in one flat buffer per dtype: one allreduce per step,
recorded as `dp/all_reduce` (torch's DDP is not used: its reducer does not take DTensor
parameters). It runs in `finish_grads`, once per backward round, at the end of
`forward_backward`, at the start of `clip_grad_norm` and in an optimizer step pre-hook, so a loop
of one's own on `Engine` (`engine.backward`, `engine.no_sync`, `engine.step`) gets the same
reductions (tested at tp2 with sequence parallelism and at dp2 x tp2); accumulation needs no
`no_sync` under ddp, since the allreduce runs once on the summed gradients. `dp_strategy="fsdp"`: `shard_data_parallel` applies FSDP2 `fully_shard` over
`Mesh.device_mesh("dp")` (one unit per block, as `zero3`); parameters that are tp DTensors become
2D (`_StridedShard(0)` over dp, their tp placement over tp), the others 1D over dp; accumulation
uses `set_requires_gradient_sync(False)`. Degrees that do not multiply to the world size are a
`ConfigError` before launch listing the valid shapes ("tp 3 does not divide the world size 4;
valid shapes: dp4 x tp1, dp2 x tp2, dp1 x tp4"). pp x tp and dp x pp x tp are the pipeline
strategy's, built on the public pieces below.

**Public building blocks** (stable signatures, imported by `strategies/pipeline.py`):

```python
parallelize(module, tp_mesh, plan=None, sequence_parallel=False) -> nn.Module   # in place; original names
replicate_grads(module, dp_group, recorder=None) -> None                        # allreduce-mean over dp
shard_data_parallel(module, dp_mesh, units="auto") -> nn.Module                  # FSDP2 over dp (2D with tp)
clip_grad_norm_(parameters, max_norm, recorder=None) -> Tensor                   # global norm, any placements
reduce_partial_grads(module, recorder=None) -> int                              # norm grads summed by role (call every step)
auto_plan(module) / resolve_plan(module, plan=None, tp=None) -> dict[str, str]  # no process group needed
declared_plan(module) -> (plan, grad_sum patterns) | None                        # transformers' _tp_plan, translated
resolve(module, plan=None, tp=None) -> (plan, grad_sum names, source)           # source: user | declared | auto
roles(module, plan, grad_sum, sequence_parallel) -> {blocks, sublayers, whole, sum}  # the backstop: ConfigError
check_replicas(module, tp_group) -> None                                        # debug: first replica that differs
count_collectives(recorder=None, **groups) -> Counter                           # context manager
```

**Clipping.** `clip_grad_norm_` takes the norm over gradients of any kind: a DTensor's squared
local norm is summed over the mesh dimensions where it is sharded (`Shard`, and FSDP2's
`_StridedShard`, which is not an `is_shard()` placement) and not over those where it is
replicated; plain tensors count once. One scalar allreduce per (mesh, sharded dimensions) kind:
tp alone, one per step; dp x tp under fsdp, three. The parity tests clip (max norm 0.05, active),
which is how the `_StridedShard` case was found.

**Checkpoints.** `state_dict` is `get_model_state_dict` / `get_optimizer_state_dict`: the
original module names, DTensors for split (and FSDP-sharded) parameters, plain tensors for the
replicated ones. The engine sees DTensors and writes model and optimizer with DCP (`dcp/`, each
rank its shards; replicated tensors once). Tested both ways at 1e-9 against an uninterrupted
`single` run: tp (3 steps) resumed under `single` (`read_sharded_full` assembles whole tensors),
and `single` (3 steps, plain checkpoint) resumed under tp with sequence parallelism
(`set_model_state_dict(full_state_dict=True)` keeps each rank's shard; the numbered optimizer state
is first named).

**Collective counts.** A dispatch mode (`count_collectives`) sees every operator below DTensor,
so it sees the functional collectives of DTensor's redistributions in forward and backward and
c10d's own; a collective DTensor issues inside one of its own operators (a norm's allreduce) runs while
the mode is off and is not seen (the sharding family's subclass declines DTensor operators to see
them). It records each on the run's `Recorder` (group `tp` or `dp`, payload, the bandwidth-optimal bytes,
no seconds: the collectives are asynchronous inside DTensor) and counts it by phase: forward
inside the step function, backward after (FSDP's final reduce-scatters included). Exact
assertions (tests, charlm at tp=2):

| per transformer block, per forward+backward | forward | backward |
| --- | --- | --- |
| tp | 2 allreduce | 2 allreduce |
| tp + sequence parallel | 2 all-gather + 2 reduce-scatter | 2 all-gather + 2 reduce-scatter |
| tp + sequence parallel, once per model | + 1 all-gather (leaving the region) | + 1 all-gather (entering it) |

Per step add one scalar allreduce for clipping, under sequence parallelism one allreduce of the
norm gradients, under ddp one dp allreduce of all gradients, under fsdp one all-gather per unit
forward and backward and one reduce-scatter per unit. `summary.json` gets `tp`: `degree`, `dp`,
`dp_strategy`, `sequence_parallel`, `plan` (module -> style, as applied), `collectives_per_step`
(`{"tp/all_reduce": {"forward": 4, "backward": 4}, ...}`, the mean over counted steps) and
`counted_steps`, and `counting` (how many steps ran under the mode and how many replayed);
`comm.by_op` has the bytes. The mode costs one Python call per operator, about 6% of charlm's tp
step, so it runs only on a batch shape's first two steps and every 32nd (`counting.StepCounts`):
the steps between replay the counted list, which is exact whenever the collectives follow from the
code and the input shapes, and a verification that disagrees counts every step from then on
(`count_collectives=False` turns counting off; `benchmarks/families.py` measures the loop against
hand-written `parallelize_module`).

**Cost** (`benchmarks/tensor_parallel.py`, charlm with 2 blocks, 4 heads, block 64, global batch
16, fp32; tp=2 is two processes on gloo, one thread each). Bytes sent per rank on the tp group
equal Megatron's prediction (`4 L x 2(p-1)/p x B T d x 4` bytes per step; sequence parallelism
the same plus the two region boundaries; the remaining 0.1% is the norm gradients' allreduce).
Activation bytes are what autograd saves for backward in one forward (rank 0's local shards,
parameters left out); the logits and the embedding output stay whole, so tp=2 keeps 0.65 of them,
not 0.5, and sequence parallelism 0.59:

| d_model | tp MB sent per step: tp2 / predicted | tp2 + sp / predicted | activation MB: tp1 / tp2 / tp2 + sp |
| --- | --- | --- | --- |
| 64 | 2.097 / 2.097 | 2.361 / 2.359 | 9.00 / 5.83 / 5.29 |
| 128 | 4.194 / 4.194 | 4.723 / 4.719 | 17.91 / 11.60 / 10.54 |
| 256 | 8.389 / 8.389 | 9.445 / 9.437 | 35.73 / 23.13 / 21.02 |

HF `LlamaForCausalLM` (d_model 128, 2 layers, 4 heads / 2 kv heads, its declared plan, its own
loss; same batch and block): tp2 sends 4.194 MB per step (predicted 4.194), tp2 + sequence
parallelism 4.721 (predicted 4.719), activations 0.68 and 0.59 of tp1's 23.0 MB, step time 2.0x and
2.2x tp1's 103 ms (one run, shared two-core machine).

On CPU with gloo, tp=2 is slower per step than one process at these widths (1.2x to 3.6x the
tp=1 step time, measured on a shared two-core machine): DTensor's per-operator dispatch and
gloo's latency dominate matrices this small, and sequence parallelism's 9 collectives per pass
(against 4) cost more again; the gap narrows as d_model grows. Counting collectives costs
5-15% of a step here.

**Real models** (`tests/strategies/tensor_parallel/test_matrix_tp.py`): HF Llama (its declared plan), HF GPT-2 (Conv1D,
permuted `c_attn`, tied embeddings), the nanoGPT-style GPT (whole attention, split MLP, tied
embeddings), BERT and ViT, under tp2, tp2 + sequence parallelism (one 2-process launch) and
dp2 x tp2 (one 4-process launch): parameters within 1e-9 of `single` after 5 float64 steps with a
clip that acts (measured 1e-16 to 2e-13), `check_replicas` on; a tp checkpoint of each model
resumes bit for bit and the consolidated weights load into a fresh model with `strict=True`.

Also measured once by hand (not in the suite, 5 float64 steps, tp2 and tp2 + sequence
parallelism, `check_replicas` on): GPT-NeoX (declared plan, per-head interleaved fused
`query_key_value`), Qwen2, Phi, GPT-J (`fc_in`/`fc_out`) within 1e-16 of `single`; OPT under tp
with its dropout at 0. Refused with a true reason: Falcon's fused `query_key_value` (layout
unknown, no declared plan), T5 (a relative position bias inside the attention, between the split
linears), ResNet (convolutions).

**Limits.** Batch-first activations (`(B, T, ...)`; the sequence is dim 1). A block that flattens
batch and sequence (OPT's decoder layer reshapes to `(B*T, d)`) cannot run sequence parallel: a
clear error at the first forward, in the parent's rehearsal when the Trainer has a sample (else in the workers). Dropout called as a function inside a forward
(`F.dropout`, OPT's) is not synchronized across tp ranks (`synchronize_dropout` hooks `nn.Dropout`
modules only): with such dropout on, replicated parameters drift apart, which `check_replicas`
reports. The sequence-sharded
region follows registration order (first and last block); a model whose forward visits blocks in
another order needs a plan without sequence parallelism. Fused q|k|v linears of unknown layout are
refused unless the model declares a plan; an attention that derives its head width from its input
stays whole. The collective counter is a Python dispatch mode around each step; under
`torch.compile` turn it off (`count_collectives=False`). Embedding and head are not split (vocabulary parallelism and a loss-parallel cross
entropy are not built). Mixed precision with tp has no parity test.
"""  # noqa: E501 - a Markdown table keeps each row on one line

from __future__ import annotations

import contextlib
import difflib
import json
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm.collectives import Group
from shardwise.comm.mesh import Mesh
from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.strategies import materialize
from shardwise.strategies.common import accumulate_backward
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Parallel, Placement, StepFn, Strategy, plan_layout
from shardwise.strategies.precision import Precision
from shardwise.strategies.tensor_parallel.apply import parallelize, synchronize_dropout, tp_info
from shardwise.strategies.tensor_parallel.counting import (
    StepCounts,
    _collective_counter_mode,
    batch_signature,
    count_collectives,
    group_names,
    ns_is_input_shard,
)
from shardwise.strategies.tensor_parallel.grads import clip_grad_norm_, reduce_partial_grads, replicate_grads, shard_data_parallel
from shardwise.strategies.tensor_parallel.plan import (
    ATTN_COLWISE,
    ATTN_ROWWISE,
    FUSED,
    MLP_COLWISE,
    MLP_ROWWISE,
    STYLES,
    _sequence_blocks,
    auto_plan,
    check_divisible,
    declared_plan,
    fused_parts,
    resolve,
    resolve_plan,
)
from shardwise.strategies.tensor_parallel.rehearse import rehearse
from shardwise.strategies.tensor_parallel.relayout import check_replicas, fused_layout, to_original, to_run
from shardwise.strategies.tensor_parallel.roles import roles

__all__ = [
    "ATTN_COLWISE",
    "ATTN_ROWWISE",
    "FUSED",
    "MLP_COLWISE",
    "MLP_ROWWISE",
    "STYLES",
    "TensorParallel",
    "TensorParallelRun",
    "auto_plan",
    "check_divisible",
    "check_model_fits",
    "check_replicas",
    "clip_grad_norm_",
    "count_collectives",
    "declared_plan",
    "group_names",
    "ns_is_input_shard",
    "parallelize",
    "reduce_partial_grads",
    "replicate_grads",
    "resolve",
    "resolve_plan",
    "roles",
    "shard_data_parallel",
    "synchronize_dropout",
]


# -- the strategy ------------------------------------------------------------------------------

DP_STRATEGIES = ("ddp", "fsdp")
"""How the data-parallel dimension of a dp x tp mesh may stay in sync (the choices of ``dp_strategy``)."""


def check_model_fits(model: nn.Module, plan: dict[str, str] | None, tp: int, sequence_parallel: bool, dp_strategy: str) -> dict[str, str]:
    """Refuse a model ``plan`` does not fit at degree ``tp``, with the `ConfigError` a user reads:
    the plan itself (styles, names, linears), widths and heads (key/value heads included) divisible
    by ``tp``, blocks for sequence parallelism, a role for every module (the backstop), and a fused
    q|k|v split by heads only with ``dp_strategy`` ``"ddp"``. Needs no process group: `TensorParallel.plan`
    runs it in the parent, `TensorParallel.apply` again on each rank at the mesh's degree.
    Returns the resolved plan (``{linear name: style}``)."""
    resolved, grad_sum, _ = resolve(model, plan, tp)
    if sequence_parallel:
        _sequence_blocks(model, resolved)
    roles(model, resolved, grad_sum, sequence_parallel)  # the backstop: a module no rule covers
    if dp_strategy == "fsdp" and any(fused_parts(model, n) for n, st in resolved.items() if st == "colwise"):
        raise ConfigError(
            "a fused q|k|v projection split by heads (permuted per rank) runs with dp_strategy 'ddp' only; got dp_strategy 'fsdp'. Use dp_strategy='ddp'"
        )
    return resolved


@dataclass(frozen=True, init=False)
class TensorParallel(Strategy):
    """Megatron tensor parallelism over ``tp`` ranks, data parallel (ddp or fsdp) over the rest.

    The plan option is ``tp_plan`` (the pipeline strategy's name for the same thing): ``plan`` is
    the contract's method. The constructor still takes ``plan=`` (its name before the contract),
    so ``TensorParallel(plan={...})`` and ``strategy_options.plan`` keep working.
    """

    name: ClassVar[str] = "tp"
    shards_meta: ClassVar[bool] = True  # split on the meta model, then each rank fills its shards
    smaller_last_batch: ClassVar[bool] = True

    tp: int | None = None
    """Tensor-parallel degree: how many ranks split each linear pair (default: the mesh's tp, else the world size)."""
    sequence_parallel: bool = False
    """Shard the activations between the split pairs (norms, dropout, residual) along the sequence."""
    tp_plan: dict[str, str] | None = None
    """Module name or pattern -> 'colwise' | 'rowwise', or its JSON text (default: the model's declared plan, else automatic)."""
    dp_strategy: Literal["ddp", "fsdp"] = "ddp"
    """Data parallel over the rest: ddp (one gradient allreduce per step) or fsdp (FSDP2 over the dp dimension)."""
    count_collectives: bool = True
    """Count and record DTensor's collectives: a dispatch mode on a batch shape's first steps and every 32nd, replayed in between."""
    check_replicas: bool = False
    """After every step, compare the replicated parameters across the tp ranks bit for bit (a debug check)."""

    def __init__(
        self,
        tp: int | None = None,
        sequence_parallel: bool = False,
        tp_plan: dict[str, str] | str | None = None,
        dp_strategy: Literal["ddp", "fsdp"] = "ddp",
        count_collectives: bool = True,
        check_replicas: bool = False,
        *,
        plan: dict[str, str] | str | None = None,
    ) -> None:
        if plan is not None and tp_plan is not None:
            raise ConfigError("the tensor-parallel plan was given twice, as tp_plan and as plan (its old name); give tp_plan only")
        values = dict(
            tp=tp,
            sequence_parallel=sequence_parallel,
            tp_plan=tp_plan if plan is None else plan,
            dp_strategy=dp_strategy,
            count_collectives=count_collectives,
            check_replicas=check_replicas,
        )
        for key, value in values.items():
            object.__setattr__(self, key, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        tp = self.tp
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise ConfigError(f"tp must be a whole number >= 1; got {tp!r}")
        if self.dp_strategy not in DP_STRATEGIES:
            close = difflib.get_close_matches(str(self.dp_strategy), DP_STRATEGIES, n=1)
            raise ConfigError(f"dp_strategy must be 'ddp' or 'fsdp'; got {self.dp_strategy!r}" + (f". Did you mean {close[0]!r}?" if close else ""))
        plan: Any = self.tp_plan
        if isinstance(plan, str):  # JSON text (a TOML inline table from --set arrives as a dict already)
            try:
                plan = json.loads(plan)
            except ValueError:
                raise ConfigError(f"tp_plan must be a dict of module name (or pattern) -> 'colwise'|'rowwise', or its JSON text; got {plan!r}") from None
        if plan is not None:
            if not isinstance(plan, dict) or not plan:
                raise ConfigError(f"tp_plan must be a non-empty dict of module name (or pattern) -> 'colwise'|'rowwise'; got {plan!r}")
            for key, style in plan.items():
                if style not in STYLES:
                    close = difflib.get_close_matches(str(style), STYLES, n=1)
                    raise ConfigError(
                        f"tp_plan[{key!r}] = {style!r} is not a style." + (f" Did you mean {close[0]!r}?" if close else "") + " Styles: 'colwise', 'rowwise'"
                    )
            plan = dict(plan)
        object.__setattr__(self, "tp_plan", plan)
        object.__setattr__(self, "sequence_parallel", bool(self.sequence_parallel))
        object.__setattr__(self, "check_replicas", bool(self.check_replicas))

    def tp_degree(self, world_size: int, mesh: Mapping[str, int] | None = None) -> int:
        """The tp degree for ``world_size`` processes: ``tp``, else the mesh settings' ``tp``, else the world size."""
        return self.tp or int((mesh or {}).get("tp") or 0) or world_size

    def check_precision(self, precision: str, layout: Layout) -> None:
        if precision == "16-mixed" and not (layout.degrees.get("dp", 1) > 1 and self.dp_strategy == "fsdp"):
            # torch's GradScaler unscales all gradients in one foreach call, which refuses a mix of
            # DTensor (split linears) and plain tensors (embedding, head).
            raise ConfigError(
                "strategy 'tp' does not run with precision '16-mixed' (torch's GradScaler cannot unscale a mix of "
                "DTensor and plain gradients); use precision 'bf16-mixed', which needs no scaler, or '32'"
            )

    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        pp = int((mesh or {}).get("pp", 1))
        if pp != 1:
            raise ConfigError(f"strategy 'tp' runs on a dp x tp mesh; got pp={pp}. Use strategy 'pipeline' with --tp for pp x tp")
        tp = self.tp_degree(world_size, mesh)
        if isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1 and world_size % tp:
            shapes = ", ".join(f"dp{world_size // d} x tp{d}" for d in range(1, world_size + 1) if world_size % d == 0)
            raise ConfigError(f"tp {tp} does not divide the world size {world_size}; valid shapes: {shapes} (set --tp to one of the tp degrees)")
        layout = plan_layout(self.name, world_size, batch=batch, mesh=mesh, own={"tp": tp})
        if model is not None:
            resolved = check_model_fits(model, self.tp_plan, tp, self.sequence_parallel, self.dp_strategy)
            layout = replace(layout, units=tuple(resolved))
        return layout

    def check_sample(self, model: nn.Module, batch: Any, layout: Layout) -> None:
        """Rehearse the split on one sample batch in the parent (`rehearse.rehearse`: meta tensors, a fake
        process group): a module the split would leave mixed or misshapen is a `ConfigError` naming it."""
        rehearse(model, batch, self.tp_plan, int(layout.degrees.get("tp", 1)), self.sequence_parallel)

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> TensorParallelRun:
        if not dist.is_initialized():
            raise ConfigError("strategy 'tp' needs a process group; start the run through shardwise (Trainer, launch, or shardwise run)")
        if mesh.size("pp") != 1:
            raise ConfigError(f"strategy 'tp' runs on a dp x tp mesh; got pp={mesh.size('pp')}. Use strategy 'pipeline' with --tp for pp x tp")
        degree, dp = mesh.size("tp"), mesh.size("dp")
        check_model_fits(model, self.tp_plan, degree, self.sequence_parallel, self.dp_strategy)  # on every rank, before any group is built
        model = materialize.to_device(model, mesh.device)
        tp_mesh = mesh.device_mesh("tp")  # the run's mesh is dp-major, tp fastest
        parallelize(model, tp_mesh, self.tp_plan, self.sequence_parallel, recorder=recorder)
        names = group_names(tp=tp_mesh.get_group())
        dp_group: Group | None = None
        if dp > 1:
            dp_mesh = mesh.device_mesh("dp")
            names.update(group_names(dp=dp_mesh.get_group()))
            dp_group = Group("dp", dp_mesh.get_group())
            if self.dp_strategy == "fsdp":
                shard_data_parallel(model, dp_mesh)
        materialize.fill_share(model, [model], mesh.device, fused_layout(model))  # a meta-built model: this rank's shards only
        params = list(model.parameters())
        return TensorParallelRun(model, make_optimizer(params), self, Group("tp", tp_mesh.get_group()), dp_group, names, recorder)


class TensorParallelRun(Parallel):
    """One rank's share of a dp x tp run: the model split in place by `parallelize` (its module
    names are the user's), FSDP2 over dp or the dp gradient allreduce, and the step's collective counts.

    Gradients are finished (sequence-parallel partial sums reduced, dp replicas averaged) before
    clipping and before the optimizer step, however backward was called: through
    `forward_backward`, or ``engine.backward`` in a loop of the user's own (a forward hook marks a
    backward round; an optimizer step pre-hook finishes it).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: TensorParallel,
        tp_group: Group,
        dp_group: Group | None,
        names: dict[str, tuple[str, int]],
        recorder: Recorder,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.placement = Placement()  # every rank trains; tp ranks of one dp coordinate read the same data shard
        self._strategy, self._recorder = strategy, recorder
        self._tp_group, self._dp_group, self._names = tp_group, dp_group, names
        self.degree, self.dp = tp_group.size, dp_group.size if dp_group is not None else 1
        info = tp_info(model)
        if info is None:
            raise ValueError(f"{type(model).__name__} was not split by parallelize(): the tp run has no plan to report")
        self.applied: dict[str, str] = dict(info["plan"])
        self.roles: dict[str, Any] = {
            "plan_source": info["source"],
            "grad_summed": list(info["sum"]),
            "whole": list(info["whole"]),
            "fused": sorted(info["fused"]),
        }
        self.params = list(model.parameters())
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self._sampler = StepCounts()
        self.steps = 0
        self._dirty = False
        self._report: dict[str, Any] | None = None
        model.register_forward_pre_hook(self._mark_dirty)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.finish_grads())

    def _mark_dirty(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._dirty = True

    def _fsdp(self) -> bool:
        return self.dp > 1 and self._strategy.dp_strategy == "fsdp"

    def finish_grads(self) -> None:
        """Reduce sequence-parallel partial gradients and (ddp) average over dp, once per backward round.

        Called after forward_backward, by clip_grad_norm and before every optimizer step; a no-op
        when nothing ran forward with gradients since the last call. Under ddp, accumulation
        needs no ``no_sync``: the one allreduce runs on the summed gradients before the step.
        """
        if not self._dirty:
            return
        self._dirty = False
        reduce_partial_grads(self.model, self._recorder)  # sequence-parallel norms, declared per-head norms
        if self.dp > 1 and self._strategy.dp_strategy == "ddp" and self._dp_group is not None:
            replicate_grads(self.model, self._dp_group, self._recorder)

    def module(self) -> nn.Module:
        return self.model  # parallelize_module and fully_shard change the module in place; names stay the user's

    def forward_backward(self, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        mode = None
        if self._strategy.count_collectives:
            signature = batch_signature(microbatches)
            if self._sampler.must_count(signature):
                mode = _collective_counter_mode()(self._recorder, self._names)
            else:
                self._sampler.replay(signature, self._recorder, self.counts)
        if mode is not None:
            inner = step_fn

            def step_fn(model: nn.Module, batch: Any) -> torch.Tensor:  # forward; the rest is backward (FSDP's final callbacks included)
                mode.phase = "forward"
                try:
                    return inner(model, batch)
                finally:
                    mode.phase = "backward"

        with mode if mode is not None else contextlib.nullcontext():
            loss = accumulate_backward(self.model, microbatches, step_fn, precision, no_sync=self.no_sync)
        if mode is not None:
            self.counts.update(mode.counts)
            self._sampler.counted_step(signature, mode.log)
        self.steps += 1
        self.finish_grads()
        return loss

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        # ddp: nothing to skip (the dp allreduce runs once, in finish_grads); fsdp: accumulate
        # unsharded gradients and reduce-scatter their sum on the last micro-batch.
        fsdp = self._fsdp()
        if fsdp:
            self.model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            if fsdp:
                self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        self.finish_grads()
        return clip_grad_norm_(self.params, max_norm, self._recorder)

    def state_dict(self, optimizer: bool) -> dict[str, Any]:
        from shardwise.checkpoint import dtensor_state_dict

        return to_original(self.model, dtensor_state_dict(self.model, self.optimizer if optimizer else None))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Sharded state (DTensors, from a tp/fsdp checkpoint) or whole tensors (from single/ddp);
        the optimizer loads when ``state`` holds one."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        from shardwise.checkpoint import has_dtensor, optimizer_state_by_name, parameter_names

        full = not has_dtensor(state["model"])
        state = to_run(self.model, state)
        options = StateDictOptions(full_state_dict=full, broadcast_from_rank0=False)
        set_model_state_dict(self.model, state["model"], options=options)
        if "optimizer" in state:
            osd = state["optimizer"]
            if any(isinstance(k, int) for k in osd.get("state", {})) or any(isinstance(i, int) for g in osd["param_groups"] for i in g["params"]):
                osd = optimizer_state_by_name(osd, parameter_names(self.model, self.optimizer))
            set_optimizer_state_dict(self.model, self.optimizer, osd, options=options)

    def after_step(self, step: int) -> None:
        """With ``check_replicas``: the replicated parameters must be equal bit for bit across the tp
        ranks after every step (`relayout.check_replicas` names the first that differs)."""
        if self._strategy.check_replicas:
            check_replicas(self.model, self._tp_group, recorder=self._recorder)

    def save_extra_state(self, directory: Path) -> None:
        return None  # the model's and optimizer's DTensors hold everything (fused weights saved in the original layout)

    def load_extra_state(self, path: Path) -> None:
        return None

    def finish(self) -> None:
        return None  # nothing to gather or stop: each rank counted its own collectives as they ran

    def summary(self) -> dict[str, Any]:
        s = self._strategy
        steps = max(self.steps, 1)
        per_step: dict[str, dict[str, float]] = {}
        for (group, kind, phase), n in sorted(self.counts.items()):
            per_step.setdefault(f"{group}/{kind}", {})[phase] = n / steps
        return {
            "tp": {
                "degree": self.degree,
                "dp": self.dp,
                "dp_strategy": s.dp_strategy if self.dp > 1 else None,
                "sequence_parallel": s.sequence_parallel,
                "plan": self.applied,
                **self.roles,
                "collectives_per_step": per_step if s.count_collectives else None,
                "counted_steps": self.steps if s.count_collectives else 0,
                "counting": self._sampler.summary() if s.count_collectives else None,
            }
        }
