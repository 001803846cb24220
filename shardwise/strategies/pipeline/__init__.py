"""``pipeline``: split the model by layers into stages, one group of stages per rank, and run
micro-batches through them on a schedule (GPipe, 1F1B, interleaved 1F1B).

Built on ``torch.distributed.pipelining`` (``PipelineStage`` and its schedules). How a model
is cut (`Pipeline.route`): transformers' models by their block list (``nested``); any other model
by its **traced forward** (``traced``: ``torch.fx`` with the top-level children and their list
items as the layers), so the code in ``forward`` between and around the layers runs on its
stage; a forward that is just its layers in order by the plain sequence of children (``split``).
A forward the tracer cannot take is split by its block list or its children only where the
stages, run one after another on a float64 copy on the Trainer's first sample, give the model's
output exactly (`check_sample`, in the parent, and again in ``apply``); otherwise it is refused.

Stages are contiguous runs of layers, balanced by parameter count (the split that minimises
the largest stage), or starting at the layers named in ``split_points``. A stage module keeps
the **original names** (a stage holding ``blocks.2`` has ``blocks.2.attn.q.weight``), so
checkpoints move between ``pipeline`` and every other strategy.

The loss: the Trainer's ``step_fn`` is ``loss_fn(model(*inputs), batch)``. The last stage calls
it once per micro-batch with a stand-in model that returns that micro-batch's pipeline output
(`_Replay`), so the user's own loss runs unchanged; the schedule is given ``target =
arange(m)``, which it chunks into one index per micro-batch. Gradients are those of the mean
loss (the schedule divides by ``m``); the step's mean loss reaches every rank.

Composition, in torchtitan's order: tensor parallel inside each stage (when
``shardwise.strategies.tensor_parallel`` exists), then the pipeline, then data parallel over
the mesh's ``dp`` dimension: with ``dp_strategy="ddp"`` the stage's gradients are averaged in
one flat allreduce after the schedule's backward (torch's DDP reducer fails to rebuild its
buckets under the schedule), or FSDP2 with ``dp_strategy="fsdp"``.

The strategy follows the plan/apply contract: `Pipeline` holds the options; its ``plan`` (pure,
in the parent) sets ``pp`` and ``tp`` on the mesh and refuses, before any process starts, a
batch per rank that does not cut into ``microbatches`` and a model it cannot split (`split`);
``apply`` builds this rank's stages and returns a `PipelineRun`. Every byte our code sends
goes through `shardwise.comm`, and the activations and gradients torch's schedule sends between
stages are recorded as ``pp/send`` and ``pp/recv`` (`observe.record_stage_traffic`).

The package, by concern: ``split`` (layers, balance, stage modules; shared with ``naive_mp``),
``schedule`` (what a schedule can run, micro-batches, the loss stand-in), ``evaluate`` (the
no-grad forward over point-to-point), ``compose`` (tensor and data parallel, the gradient norm),
``state`` (whole-model checkpoints), ``exchange`` (gathering each rank's part as tensors),
``observe`` (timing, traffic, bubble, timeline); here, the strategy and its run.

Design notes: pipeline parallelism
==================================

`--strategy pipeline --pp N --microbatches M --schedule gpipe|1f1b|interleaved`
(`shardwise.strategies.pipeline`, on `torch.distributed.pipelining`). Options (all in
`strategy_options`): `pp` (stages, default 2), `microbatches` (per step, default `pp`),
`schedule` (default `1f1b`), `virtual_stages` (model chunks per rank, interleaved only,
default 2), `split_points` (layer names that start stages 1, 2, ...), `tp` (tensor-parallel
degree inside each stage, default 1), `sequence_parallel`, `tp_plan`, `dp_strategy` (`ddp`
or `fsdp` over what is left of the world), `timeline` (a PNG path), `warmup_steps` (steps
left out of the measured bubble, default 1). `plan()` lays out `pp` and `tp`;
`dp` is the world size over `pp x tp`.

The package `shardwise/strategies/pipeline/`, by concern: `split.py` (the layers, the balanced
split, `StageModule`; `naive_mp` splits with it too), `schedule.py` (what a schedule can run,
micro-batches, the loss stand-in `_Replay`), `evaluate.py` (`PipelineModule` and its no-grad
forward over point-to-point), `compose.py` (tensor and data parallel around the stages, the
gradient norm), `state.py` (whole-model checkpoints), `observe.py` (action timing, the bubble,
the timeline), and `__init__.py` (the `Pipeline` strategy, re-exporting the public names).

**What a model must be.** Anything whose forward `torch.fx` traces with the layers (top-level
children, `nn.ModuleList`/`nn.ModuleDict` items) as leaves (`traced.py`): functional ops, pooling,
reshapes, residual adds, a bare `nn.Parameter` read in `forward`, a skip across several layers
(each stage in between passes it on: a stage takes and sends a tuple of tensors in graph order;
integer tensors and tensors without gradient cross too), a module called twice. Layers are
ordered by their first call and cut by the same balance; a layer's call runs on its stage (or
later, where its input is), other nodes on the latest stage among their tensor inputs; values
that are not tensors (sizes from `x.shape`) and nodes without tensor inputs (`get_attr`,
`torch.arange`) are recomputed on each stage that uses them, never sent. Which node is a tensor
comes from one run of the graph on the sample (without one, from the ops). A module or parameter
held by stages of two ranks is a weight tied across stages (`ties.py`, below); on one rank it is
one `Parameter`, and gradients are divided by the micro-batch count once per parameter after the
schedule (torch's per-stage `scale_grads` divided a module held by two local stages twice). A
forward that is exactly its layers in registration order, each output the next one's only input
(charlm's `CharGPT`, an `nn.Sequential`), runs as a `StageModule`, as before. Untraceable forwards
(nanoGPT's `assert t <= block_size`, a branch on a tensor's value): the block-list or sequence split,
proven on the sample in float64 (`traced.check_composition`); the refusal names the line the
tracer stopped at and the first layer whose output differs between the model and the stages (or
the stage that raised). A model the block-list split takes (`layers=`, tied weights, a block list)
keeps it where the sample proves it, and is traced otherwise. An `Engine` given no sample gets
the traced split or that refusal (`check_sample` on the strategy object gives it one).
Tested: `tests/strategies/pipeline/test_own_models.py` (one 2-process launch, about 15 s): seven
hand-written models at 2 stages and at 4 (pp 2 x 2 interleaved chunks) within 1e-9 of `single`
(about 1e-16), the zero-scaled MLP at ln 2, tied weights started from the first owner's values
when rank 1 builds them differently, checkpoints resumed under `single`.

**Nested models** (`nested.py`, `ties.py`): transformers' models, a nanoGPT-style GPT (a
`ModuleDict`), any model whose forward runs a list of repeated blocks somewhere inside it, are
split by that list instead. `is_nested` picks this path when `layers=` is given, when the model
has a pipeline plan, ties weights, or is a transformers model (`config`) with a block list.
- *The block list*: the model's own plan (transformers' `_pp_plan`, then `config.base_model_pp_plan`
  under `base_model_prefix`: `model.layers`), else `layers="model.layers"` (CLI `--layers`, TOML
  `strategy_options.layers`), else the largest `nn.ModuleList` of same-class modules
  (`transformer.h`, `bert.encoder.layer`, `vit.layers`, `gpt_neox.layers`, `model.decoder.layers`).
  Runs of blocks are balanced by parameter count (or start at `split_points`, block names).
- *Prelude and postlude*: along the path to the list, every sibling module with parameters
  runs before the blocks (the first stage owns it: embeddings) or after them (the last stage
  owns it: final norm, pooler, head). Which one is read from the source of the nearest forward
  that uses both (`runs_after`: the first call of `self.<name>` against the first use of the
  blocks' branch; nanoGPT's root runs `self.transformer.ln_f`, a `ModuleDict` has no forward),
  because declaration order is not execution order: OPT declares `final_layer_norm` before
  `layers`. Where the source cannot tell, declaration order; modules without parameters (rotary
  embeddings, dropout) stay on every stage.
- *Every stage runs the model's own forward* on a pruned shallow copy (`NestedStage`): its own
  blocks under their original keys, stand-ins for what it does not own. A later stage's first
  block takes the received activation in place of whatever the stand-ins computed (a pre-hook);
  a stage before the last stops after its last block (a forward hook raising a private
  exception, registered again after tensor parallelism's hooks, so a sequence-parallel stage sends
  the gathered sequence) and returns the hidden states. A stand-in for a prelude module that is
  called after the blocks raises a `ConfigError` instead of skipping the layer; the hooks act only
  inside a stage's forward (the blocks are the user's model's too).
- *What crosses a boundary*: one tensor, the hidden states. Everything else a layer needs
  (position ids, rotary cos/sin, causal and padding masks from `attention_mask`, ViT's patch
  count) is **recomputed on every stage** by the model's own forward from the micro-batch, which
  every stage receives as keywords (a tuple batch's inputs as `_arg0..`); only the first stage
  reads the inputs. So the masks cost one recomputation per stage, and no metadata travels.
- *The loss*: the last stage returns the output's `logits` (a plain tensor for the schedule) and
  keeps the whole `ModelOutput`. With a `loss_fn`, it runs on the logits through `_Replay` (which
  accepts keyword calls); with none, the batch's `labels` went into the last stage's forward, so
  the loss is the model's own (`model.loss_function` on the head's logits, computed there, not by
  re-running the model) and `_Replay` returns that output. transformers computes it in float32
  even for float64 logits; the float64 parity tests pass the same loss as a `loss_fn`.
- *Refused in the parent*: a `layers=` path that is not a module list (the lists are named), a
  list with parameters beside it on the path, fewer blocks than `pp x v`, BatchNorm with more
  than one micro-batch (each micro-batch would be normalized alone; ResNet trains exactly with
  `microbatches=1`), tied weights with `dp_strategy="fsdp"`.
- *Tied weights* (found by identity; transformers' tied keys are shared parameters too): on one
  rank they stay one `Parameter` (the optimizer gets it once). Across ranks each owner holds a
  copy of one logical weight: broadcast from the owner of the first name at setup, gradients
  summed over the owners after the schedule (one allreduce per tie over the pp group, before
  clipping), the norm counts it on the first owner only, the optimizer state is saved once under
  the first name and loaded into every copy. The checkpoint holds the weight under every name, as
  `single`'s `state_dict` does, so it loads into `single` and into the transformers class with
  `strict=True` and ties intact.
- *Shape inference*: torch's `PipelineStage` runs micro-batch 0 once more on the first step to
  learn shapes; `keep_buffers_through_inference` copies the stage's buffers before that forward
  and puts them back after torch frees it, so BatchNorm's statistics and counter see five steps
  in five steps.
- *pp x tp*: the stage (original names) goes through `parallelize`; GPT-2's fused `c_attn`,
  permuted per tp rank in the run, is saved in the model's layout and put back in the run's on
  load (`state._relayout`), and tp's partial and role-marked gradients are summed every step
  whenever `tp > 1` (a declared plan can mark per-head norms without sequence parallelism).

Tested: `tests/strategies/pipeline/test_matrix_pipeline.py` (Llama, GPT-2 tied, nanoGPT tied, BERT, ViT
under gpipe, 1f1b and interleaved (pp 2, v 2, 4 layers) within 1e-9 of `single` after 5 clipped
float64 steps, about 1e-16 in practice, ViT 2e-13; the model's own loss; a tied checkpoint
resumed bit for bit; evaluation; refusals). `test_pipeline_nested.py` (one 2-process launch,
about 25 s): Mistral, Qwen2 (tied), GPT-NeoX, Phi and OPT under 1f1b; ResNet with one
micro-batch, buffers included; `layers=`/`split_points=` from the user; nanoGPT resumed bit for
bit; tied checkpoints with `single`'s keys that load tied and export to a file
`from_pretrained` loads tied. `test_matrix_pipeline_tp.py` (one 4-process launch, about 50 s):
the five models under pp2 x tp2 (Llama, nanoGPT, ViT with
sequence parallelism), GPT-2's checkpoint in the original layout, resumed bit for bit.

**The split.** Layers are cut into `pp x v` contiguous stages (`v` = virtual stages, 1 unless
interleaved), balanced by parameter count: the cut that minimises the largest stage, then the
sum of squared stage sizes; on a tie a layer without parameters (an activation) stays with
the layer before it. `split_points=["blocks.2"]` names where stages start instead (in model
order, `pp x v - 1` of them, or `pp x v` including the first layer). Fewer layers with
parameters than stages, a stage without trainable parameters, an unknown name (the error
lists the layers) are `ConfigError`s, raised by the Trainer through `plan(model=...)` in the parent
before any process starts, and again by `apply` on every rank (an `Engine` loop of one's own).
Stage `s` runs on pipeline rank `s mod pp` (torch's loop placement: rank 0 holds stages 0 and
`pp` under interleaving).

**Names.** A stage module (`StageModule`) registers its layers under their original dotted
names (`blocks.2` becomes key `2` of a `ModuleDict` named `blocks`), so its `state_dict` keys
are the whole model's (`blocks.2.attn.q.weight`) and its tensors are the model's own (no
copy). The module `apply` returns (`PipelineModule`) holds every local layer the same way:
`named_parameters()`, the optimizer's names and the checkpoint helpers see original names.

**Schedules.** `gpipe` (all forwards, then all backwards: `m` micro-batches' activations
alive), `1f1b` (after a warm-up of `p - 1 - rank` forwards, one forward then one backward:
at most `p` micro-batches alive; same bubble), `interleaved` (torch's
`ScheduleInterleaved1F1B`: `v` chunks per rank, bubble divided by `v`, `v` times more
point-to-point messages). Refused up front, in the strategy's constructor or `plan`, so
one clear line and exit code 2 from the command: an unknown schedule (closest match named),
1F1B with `m < p` (torch raises only on construction, inside the workers), interleaved with
`v < 2` or `m` not a multiple of `max(1, m // p)` (torch's rounds), `virtual_stages` with a
schedule other than interleaved, `pp x tp` not dividing the world (valid shapes listed), and,
through `plan(batch=...)`, a per-rank batch (`micro-batch x accumulate`) that does not split into
`m` equal micro-batches. torch lets that last one through until the last stage raises while
the others wait forever; `forward_backward` checks it again on every rank before the schedule
runs (same data on every rank of a replica, so every rank raises), for bring-your-own-loop users.

**The loss.** The Trainer stays generic: its `step_fn` is `loss_fn(model(*inputs), batch)`.
`forward_backward` concatenates the step's `accumulate` loader micro-batches, cuts the batch
into `m` micro-batches exactly as the schedule cuts its input (`torch.tensor_split` on dim 0),
and gives the schedule `target = arange(m)`, which it chunks into one index per micro-batch.
The schedule's loss function on the last stage calls the user's `step_fn` with a stand-in
model (`_Replay`) that returns that micro-batch's pipeline output, so the user's loss runs
unchanged on `(output, micro-batch)`; the stand-in checks it was called with the
micro-batch's inputs, so a `training_step` that calls the whole model is a `ConfigError`
(pass `loss_fn=`). Losses are kept by micro-batch index (torch's shape inference runs
micro-batch 0 an extra time on the first step). Gradients are divided by `m` once per parameter
after the schedule (not by torch's per-stage `scale_grads`, which divides a module two local stages
hold twice), so they are the gradient of the mean loss over the step's batch. Under
fp16 the loss handed to the schedule is the grad scaler's scaled loss. One `all_gather` of
five float64 numbers over the pp group per step carries the mean loss (and its dtype) from the
last stage to every rank, with every stage's timing; the returned loss is detached.

**Evaluation and sampling.** `PipelineModule.forward(*inputs)`, under `torch.no_grad()`, runs
stage after stage: the owner of stage `s` receives the activation from the owner of `s - 1`
(a 10-number header: dtype, rank, shape; then the tensor), runs it, sends it on, and the last
stage's output is broadcast over the pp group, so `module(x)` returns the whole output on every
pipeline rank for any batch size (the schedule's shapes are fixed at its first step; this path
has none). Every rank of the group must call it, which the Trainer's evaluation guarantees
(equal forward counts per rank, see *Data*); all pp ranks of a replica get the same samples
(the loader shards by the dp coordinate). With gradients enabled it refuses (gradients do not
cross stages on this path). The Trainer divides its evaluation sums by the ranks that see each
shard (`copies_per_shard`: world / dp), so `val_samples` counts each sample once. After
`Trainer.fit` the parent process holds the whole trained model (`state_dict` gathers it), which
is what charlm samples from.

**Checkpoints.** `state_dict` gathers (`all_gather_object` over the pp group, CPU tensors,
DTensors made whole with `full_tensor()`) every stage's model state in stage order, which is
the model's own `state_dict` order, and the optimizer state by parameter name, renumbered in
the whole model's parameter order: exactly what `single` writes, on every pipeline rank (the
engine's `load` checks the template's names on every rank). `load_state_dict` takes such a
whole state, from any plain checkpoint, and keeps this rank's layers and their optimizer
entries (by name; through torch's `set_model_state_dict`/`set_optimizer_state_dict` when the
stage holds DTensors). Tested: a pipeline checkpoint resumes under `single`, a `single` one
under `pipeline`, both equal to an uninterrupted run within 1e-9.

**Compositions** (torchtitan's order: tensor, then pipeline, then data). With `tp > 1`, each
stage module goes through `tensor_parallel.parallelize(stage, mesh.device_mesh("tp"), plan,
sequence_parallel)` before it becomes a `PipelineStage` (stage boundaries stay whole tensors).
Over `dp > 1`: `dp_strategy="ddp"` keeps the stage module as it is and, after the schedule,
averages every gradient across the dp group in one flat allreduce (`dp/all_reduce`, once per
step; with tp, `tensor_parallel.replicate_grads`); `fsdp` applies FSDP2's `fully_shard` to each
stage module (with tp, `tensor_parallel.shard_data_parallel(..., units="root")`), which torch's
pipeline stage drives itself (no resharding between micro-batches, one reduce-scatter after the
last backward). torch's `DistributedDataParallel` is not used: fed one backward per micro-batch
by the schedule, its reducer fails to rebuild its buckets after the first step (torch 2.13,
gloo). The cost is that the dp allreduce does not overlap the backward. `clip_grad_norm`
counts each gradient's square once: summed over the mesh dimensions that hold shards of it
(tp, and dp under fsdp, including the `_StridedShard` placement FSDP2 gives over tp), then over
the pp ranks, never over replicas; same coefficient as torch (`max_norm / (norm + 1e-6)`, at
most 1). Tested within 1e-9 of `single` at world size 4: pp2 x dp2 (ddp with 1F1B and
interleaved, fsdp with GPipe), pp2 x tp2 with and without sequence parallelism; dp2 x pp2 x
tp2 at world size 8 (ddp and fsdp) was checked by hand (parameters within 3e-14).

**Bubble.** `shardwise.strategies.cost.bubble`: predicted `(p - 1)/(m + p - 1)` for GPipe and 1F1B and
`(p - 1)/(v m + p - 1)` interleaved, the idle share of a step with equal stage times
(Narayanan et al. 2021, section 2.2, which states it as idle over busy: `(p - 1)/m` and
`(1/v)(p - 1)/m`). Measured: each `PipelineStage`'s `forward_one_chunk` and
`backward_one_chunk` are wrapped and timed (waiting for activations and gradients happens
outside them, in the schedule's receive actions); a step's wall time runs from the earliest
rank's start to the latest rank's end, on `perf_counter` clocks aligned at setup (barrier,
then an all-gather of each rank's time); a stage's bubble is `1 - busy / wall`.
`summary()['pipeline']`: `schedule`, `pp`, `microbatches`, `virtual_stages`, `stages`,
`stage_layers`, `bubble_measured` (mean over stages and over steps after `warmup_steps`),
`bubble_measured_median_step`, `bubble_predicted`, `bubble_formula`, `bubble_source`,
`steps_measured`, `step_wall_s`, `per_stage` (rank, its stages, bubble, busy seconds). The
timing travels in the per-step all-gather, so `summary()` is local, except with `timeline`
set: then it gathers the last step's events (`(stage, micro-batch, F|B, start, end)`) to rank
0, which writes them as `<timeline>.json` and draws the PNG (one row per rank, forward light,
backward dark, a colour per model chunk; matplotlib is imported only there, the `plot` extra,
and a missing matplotlib is a `ConfigError` after the JSON is written).

`benchmarks/pipeline.py` measures it for p in {2, 4}, m in {2, 4, 8, 16} and each schedule on
equal stages (identical `Linear + tanh` blocks, no embedding or head, the input requiring a
gradient so the first stage's backward costs what the others' do). The formula has no
communication in it: gloo's point-to-point latency and the scheduling of the processes (which
rise on a loaded machine) show up as extra idle time, most visibly at large `m` where the
predicted bubble is small; p = 4 on a 2-core machine runs two processes per core. Measured
here (2 cores shared with other work, load average 4 to 8; width 2048, 128 rows per
micro-batch, 4 blocks per rank, 3 steps after a warm-up; ratio = measured / predicted):

| p | schedule | m=2 | m=4 | m=8 | m=16 |
| --- | --- | --- | --- | --- | --- |
| 2 | gpipe | 0.280 / 0.333 (0.84) | 0.168 / 0.200 (0.84) | 0.100 / 0.111 (0.90) | 0.083 / 0.059 (1.42) |
| 2 | 1f1b | 0.300 / 0.333 (0.90) | 0.218 / 0.200 (1.09) | 0.119 / 0.111 (1.07) | 0.110 / 0.059 (1.88) |
| 2 | interleaved (v=2) | 0.203 / 0.200 (1.02) | 0.154 / 0.111 (1.38) | 0.111 / 0.059 (1.89) | 0.091 / 0.030 (3.01) |
| 4* | gpipe | 0.597 / 0.600 (0.99) | 0.473 / 0.429 (1.10) | 0.297 / 0.273 (1.09) | 0.216 / 0.158 (1.37) |
| 4* | 1f1b | refused (m < p) | 0.391 / 0.429 (0.91) | 0.371 / 0.273 (1.36) | 0.271 / 0.158 (1.72) |
| 4* | interleaved (v=2) | 0.624 / 0.429 (1.46) | 0.366 / 0.273 (1.34) | 0.292 / 0.158 (1.85) | 0.239 / 0.086 (2.79) |

* four processes on two cores (oversubscribed): per-stage numbers spread widely (0.16 to 0.69).

Where an action is long next to the per-message cost the measurement follows the formula
(within 10% for 1F1B at m = 4, 8 and interleaved at m = 2; GPipe at m = 8); as `m` grows the
predicted bubble shrinks towards the fixed cost of a few milliseconds per message (gloo's
transport threads wait for a core while both ranks compute), and interleaving, with twice the
messages and half-size actions, pays it twice. Below 1 (GPipe at m = 2, 4) is contention too:
when both ranks compute at once on a shared machine their actions run slower than when one
runs alone in the fill and drain, so busy time grows in the steady state. The bubble is a
property of the schedule; on a machine with a core per rank and fast links the extra idle
time shrinks with the message cost.

`--model hf-llama` runs the same table on transformers' `LlamaForCausalLM` (8 layers of width
256, vocab 2048, 4 sequences of 128 tokens per micro-batch, float32, its own loss from `labels`;
`single s` is the unsplit model on the same global batch in one process, measured in the same
run). Its end stages are heavier (embedding; norm and head), which the formula does not count.
Measured here (2 cores shared with other helpers' test runs, so step times are noisy):

| p | schedule | m | measured / predicted (ratio) | step s | single s |
| --- | --- | --- | --- | --- | --- |
| 2 | gpipe | 2 | 0.327 / 0.333 (0.98) | 2.41 | 1.98 |
| 2 | gpipe | 4 | 0.224 / 0.200 (1.12) | 3.01 | 3.98 |
| 2 | gpipe | 8 | 0.155 / 0.111 (1.39) | 4.89 | 7.78 |
| 2 | 1f1b | 2 | 0.283 / 0.333 (0.85) | 2.05 | 1.99 |
| 2 | 1f1b | 4 | 0.172 / 0.200 (0.86) | 4.36 | 3.78 |
| 2 | 1f1b | 8 | 0.115 / 0.111 (1.03) | 8.36 | 7.57 |
| 2 | interleaved (v=2) | 2 | 0.190 / 0.200 (0.95) | 2.15 | 1.89 |
| 2 | interleaved (v=2) | 4 | 0.130 / 0.111 (1.17) | 3.20 | 3.65 |
| 2 | interleaved (v=2) | 8 | 0.065 / 0.059 (1.11) | 8.11 | 7.66 |

The bubble follows the formula within 17% at m = 2 and 4 for every schedule; per stage, the
first stage idles more than the last (0.34 against 0.31 at GPipe m = 2, 0.21 against 0.10 at
m = 8), the head's cost on the last stage. Two processes on two cores should beat one; they do
only where the machine was quiet during the row (GPipe m = 4, 8: 1.3x and 1.6x), the other rows
ran while other work held a core.

**Naive placement** (`naive-mp`, `shardwise.strategies.pipeline.naive_mp`): one process, the same split
over the visible CUDA devices (`devices=` to choose), activations moved from device to device
and the output back to the first (where the loader puts labels): the lectures' `ToyMpModel`,
no overlap. It runs the top-level children in order, so a forward that does more (checked on its
`torch.fx` trace: `naive_mp.check_forward_is_its_layers`) or that fx cannot read is refused, pointing
to `pipeline`. Without two GPUs `plan` says so and suggests `pipeline`. The placement is
tested on `["cpu", "cpu"]`.

**Limits.** Every rank builds the whole model before the split (the layers a rank does not
keep stay in the caller's object; building on the meta device is not supported yet). A traced
split: takes positional inputs (a tuple batch), not a dict; evaluation through `PipelineModule`
carries several tensors across a boundary but needs one tensor as the model's output; fx fixes
Python-side values at trace time (`self.training` read in `forward`, a random op outside a layer
is recomputed on each stage that uses it); pp x tp is refused for it (tp inside stages works on
the plain sequence and the block-list split); the float64 check costs a copy of the model in the
parent and on every rank. A nested model whose forward uses a prelude module through a
helper method the source reading does not see falls back to declaration order (a wrong guess
raises when the stand-in runs, it does not train wrong); encoder-decoder models (T5, BART: two
block lists) and models whose blocks need another block's output (cross-layer caches) are not
split. `state_dict` gathers the whole model on every pipeline rank (CPU
memory of the whole model). A sharded (DCP) checkpoint loads through the engine's
whole-tensor path; it was not tested under `pipeline`. The timeline shows the last step only.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm import Recorder, all_gather
from shardwise.comm.mesh import Mesh
from shardwise.errors import ConfigError
from shardwise.strategies import materialize
from shardwise.strategies.compose import _tensor_parallel, apply_data_parallel, average_grads, clip_grad_norm
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Parallel, Placement, StepFn, Strategy, plan_layout
from shardwise.strategies.pipeline import traced
from shardwise.strategies.pipeline.evaluate import _DTYPES, PipelineModule
from shardwise.strategies.pipeline.nested import (
    NestedLayout,
    NestedStage,
    _plan_blocks,
    batch_kwargs,
    check_layers,
    check_nested,
    is_nested,
    nested_layout,
    split_blocks,
    tied_aliases,
)
from shardwise.strategies.pipeline.observe import _Clock, bubble_section, gather_events, mean, record_stage_traffic, write_timeline
from shardwise.strategies.pipeline.schedule import (
    _Replay,
    _schedule_class,
    batch_rows,
    check_rows,
    check_schedule,
    concat_batches,
    keep_buffers_through_inference,
    split_batch,
)
from shardwise.strategies.pipeline.split import StageModule, balance, sequence_layers, split_layers
from shardwise.strategies.pipeline.split import _register as _register  # importable from here, as before the split
from shardwise.strategies.pipeline.state import gather_state, load_local_state, local_part
from shardwise.strategies.pipeline.ties import Tie, _cross_stage_ties, _find_param, sync_tied
from shardwise.strategies.precision import Precision

__all__ = [
    "Pipeline",
    "PipelineModule",
    "PipelineRun",
    "StageModule",
    "balance",
    "batch_rows",
    "check_rows",
    "check_schedule",
    "concat_batches",
    "mean",
    "sequence_layers",
    "split_batch",
    "split_layers",
    "write_timeline",
]


# -- how a model is split ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """How a model is cut into stages: ``nested`` (its block list, `nested`), ``traced`` (its traced
    forward, `traced`) or ``sequence`` (its top-level children in order, `split`)."""

    kind: Literal["nested", "traced", "sequence"]
    names: list[list[str]]
    """The layers (blocks) each stage owns."""
    layout: NestedLayout | None = None
    block_runs: list[list[str]] | None = None
    plan: traced.TracedPlan | None = None
    stage_mods: dict[int, nn.Module] | None = None
    """A traced split's stage modules (over the model's own tensors), built once here and used by ``apply``."""
    ties: list[Tie] | None = None
    """A traced split's weights held by stages of two pipeline ranks."""


def _is_transformers(model: nn.Module) -> bool:
    """A transformers model (any class of its hierarchy defined in the transformers package)."""
    return any(c.__module__.split(".")[0] == "transformers" for c in type(model).__mro__)


def _types(gm: Any, args: tuple[Any, ...], model64: nn.Module) -> dict[str, bool]:
    """Each node's kind (tensor or not) from one run on the sample; in eval mode where training mode
    cannot take one sample (BatchNorm on one row)."""
    try:
        return traced.node_types(gm, args)
    except Exception:
        model64.eval()
        try:
            return traced.node_types(gm, args)
        except Exception as exc:
            raise ConfigError(f"{type(model64).__name__}'s traced forward raises on a sample batch: {type(exc).__name__}: {exc}") from None
        finally:
            model64.train()


def _needs_sample(model: nn.Module, why: str, where: str) -> ConfigError:
    return ConfigError(
        f"cannot split {type(model).__name__} into pipeline stages: {why}, and splitting it by {where} "
        "is only done once a sample batch proves the stages equal the model's forward; train through the "
        "Trainer (which passes its first sample), build the strategy object, call its check_sample(model, batch, layout) "
        "and give it to Engine(strategy=...), or make the forward traceable (no Python control flow on tensor values or sizes)"
    )


def _prove(model: nn.Module, r: Route, sample: Any, where: str) -> None:
    """The stages of ``r``, on a float64 copy of ``model`` run one after another on ``sample``, give
    the model's own output exactly (`traced.check_composition`), or a `ConfigError` naming where not."""
    from shardwise.data.batches import model_args

    if materialize.has_meta(model):
        raise ConfigError(
            f"{type(model).__name__} was built on the meta device, and the pipeline splits it by {where}: a split the "
            "tracer did not give is used only after its stages, run in float64 on the first training sample, give the "
            "model's output exactly, which needs the model's weights. Build this model eagerly for the pipeline, or make "
            "its forward traceable by torch.fx (no assert or branch on a tensor's size or value), or use another strategy"
        )

    model64 = traced.float64_copy(model)
    args, kwargs = model_args(sample)
    args64, kwargs64 = traced.to_float64(tuple(args)), traced.to_float64(dict(kwargs))
    stage_of: dict[str, int] = {}
    if r.kind == "nested":
        assert r.layout is not None and r.block_runs is not None
        layout, n = r.layout, len(r.block_runs)
        stages: list[nn.Module] = [NestedStage(model64, layout, r.block_runs[s], s == 0, s == n - 1) for s in range(n)]
        stage_of = {name: s for s, run in enumerate(r.names) for name in run} | {p: 0 for p in layout.prelude} | {p: n - 1 for p in layout.postlude}
        order = list(layout.prelude) + [name for run in r.names for name in run] + list(layout.postlude)

        def run() -> Any:
            traced.run_in_turn(stages, (), batch_kwargs(args64, kwargs64), True)
            return stages[-1].output

    else:
        if kwargs:
            raise ConfigError(
                f"{type(model).__name__} is split by its top-level children, which take positional inputs; the batch is a dict ({sorted(kwargs)})"
            )
        runs = split_layers(sequence_layers(model64), len(r.names), [run[0] for run in r.names[1:]])
        stages = [StageModule(run) for run in runs]
        stage_of = {name: s for s, run in enumerate(r.names) for name in run}
        order = [name for run in r.names for name in run]

        def run() -> Any:
            return traced.run_in_turn(stages, args64, {}, False)

    traced.check_composition(model64, args64, kwargs64, stages, run, order, stage_of, where)


# -- the strategy: options and plan ----------------------------------------------------------------


@dataclass(frozen=True)
class Pipeline(Strategy):
    """Pipeline parallelism over the mesh's ``pp`` dimension (tensor parallel inside, data parallel outside).

    Every stage's timing reaches every rank with the step's loss (one small all-gather per step),
    so the run's ``summary()`` is local; with ``timeline`` set, ``finish()`` gathers the last
    step's events to rank 0 (every rank calls it; the Trainer does).

    >>> Pipeline(pp=4, microbatches=8, schedule="interleaved").num_stages
    8
    """

    name: ClassVar[str] = "pipeline"
    shards_meta: ClassVar[bool] = True  # split on the meta model, then each rank fills its own stages

    pp: int = 2
    """Pipeline stages, one per rank along the mesh's pp dimension."""
    microbatches: int | None = None
    """Micro-batches each rank's batch is cut into per step (default: pp)."""
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    """Order of the micro-batches' forwards and backwards: gpipe, 1f1b, or interleaved (1F1B over virtual stages)."""
    virtual_stages: int | None = None
    """Model chunks per rank, interleaved only (default 2 there, 1 otherwise)."""
    split_points: tuple[str, ...] | None = None
    """Layer (or block) names that start stages 1, 2, ... (default: stages balanced by parameter count)."""
    tp: int = 1
    """Tensor-parallel degree inside each stage."""
    dp_strategy: Literal["ddp", "fsdp"] = "ddp"
    """How each stage's data-parallel replicas stay in sync: ddp (one gradient allreduce per step) or fsdp (FSDP2)."""
    timeline: str | None = None
    """A PNG path: the last step's forward and backward actions, one row per rank (events as JSON next to it)."""
    warmup_steps: int = 1
    """Steps left out of the measured bubble."""
    sequence_parallel: bool = False
    """With tp > 1: shard norms and dropout along the sequence."""
    tp_plan: dict[str, str] | None = None
    """With tp > 1: module-name pattern -> split style, instead of the model's own or the automatic plan."""
    layers: str | None = None
    """Dotted path of a nested model's block list (model.layers); found by itself when not given."""

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.virtual_stages is None:
            put("virtual_stages", 2 if self.schedule == "interleaved" else 1)
        if self.microbatches is None:
            put("microbatches", self.pp)
        check_schedule(self.schedule, self.pp, self.microbatches, self.virtual_stages)  # type: ignore[arg-type]
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ConfigError(f"tp must be a whole number >= 1; got {self.tp!r}")
        if self.dp_strategy not in ("ddp", "fsdp"):
            raise ConfigError(f"dp_strategy must be 'ddp' or 'fsdp'; got {self.dp_strategy!r}")
        points = self.split_points
        if isinstance(points, str):
            points = [s for s in points.split(",") if s]
        if points is not None and not all(isinstance(p, str) for p in points):
            raise ConfigError(f"split_points must be layer names (e.g. ['blocks.2'] or 'blocks.2,blocks.4'); got {self.split_points!r}")
        put("split_points", tuple(points) if points else None)
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"sequence_parallel must be true or false; got {self.sequence_parallel!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel needs tp > 1 (it shards activations across the tensor-parallel ranks)")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be a whole number >= 0; got {self.warmup_steps!r}")
        if self.tp_plan is not None and not isinstance(self.tp_plan, Mapping):
            raise ConfigError(f"tp_plan must map module-name patterns to split styles (e.g. {{'blocks.*.attn.q': 'colwise'}}); got {self.tp_plan!r}")
        put("timeline", self.timeline or None)
        put("layers", self.layers or None)

    @property
    def num_stages(self) -> int:
        """Stages over all ranks: ``pp x virtual_stages``."""
        return self.pp * int(self.virtual_stages or 1)

    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        """``pp`` and ``tp`` on the mesh (``dp``: what the world leaves); refuses a batch per rank that
        does not cut into ``microbatches`` and a model `split` refuses. Pure."""
        if self.tp > 1:
            _tensor_parallel()  # a clear error when the tensor-parallel package is not available
        layout = plan_layout(self.name, world_size, batch=batch, mesh=mesh, own={"pp": self.pp, "tp": self.tp})
        if batch is not None and layout.micro_batch is not None:
            micro = layout.micro_batch
            check_rows(micro * batch.accumulate, int(self.microbatches or 1), f"micro-batch {micro} x accumulate {batch.accumulate}")
        if model is not None:
            self.route(model, check=False)  # the proof of a split the tracer did not give waits for check_sample's batch
            if self.tp > 1:
                layout = replace(layout, units=self._tp_linears(model))
        return layout

    def _tp_linears(self, model: nn.Module) -> tuple[str, ...] | None:
        """The linears tensor parallelism splits across the stages (the plan resolved on the whole
        model, as each stage resolves its share): what the planner counts for tp's per-linear cost and
        allreduces, each repeated per micro-batch. None when the whole model does not resolve (the
        stages are checked one by one in `apply`)."""
        try:
            return tuple(_tensor_parallel().check_model_fits(model, self.tp_plan, self.tp, self.sequence_parallel, self.dp_strategy))
        except ConfigError:
            return None

    def split(self, model: nn.Module, sample: Any = None) -> list[list[str]]:
        """The layer (or block) names of each of the ``pp x virtual_stages`` stages, as ``apply`` will
        cut ``model``; a `ConfigError` for a model this pipeline cannot split: a forward the tracer
        cannot take and whose other split is not proven equal to it on ``sample`` (see `route`),
        fewer layers (blocks) than stages, ``split_points`` that do not name them in order, an
        encoder-decoder model, BatchNorm with more than one micro-batch, weights tied across stages
        under ``dp_strategy="fsdp"``. Pure."""
        return self.route(model, sample).names

    def check_sample(self, model: nn.Module, batch: Any, layout: Layout) -> None:
        """Prove the split on one sample of the training data (in the parent, before launch): the
        stages, run one after another on a float64 copy, equal the model's forward exactly. The
        sample travels with the strategy to the workers, whose `apply` proves it again."""
        self.route(model, batch)
        object.__setattr__(self, "_sample", batch)  # not an option: the sample `apply` checks again

    def route(self, model: nn.Module, sample: Any = None, *, check: bool = True) -> Route:
        """How ``model`` is split (`Route`), checked; ``sample`` (a batch as the loader gives it)
        proves a split the tracer did not give. ``check=False`` (``plan``, which has no sample) leaves
        that proof to `check_sample`.

        transformers' models (and models with a pipeline plan) are split by their block list, as
        they always were. A model the block-list split would take (``layers=``, tied weights, a
        list of repeated blocks) keeps it where the stages, run on ``sample`` in float64, give the
        model's output exactly. Otherwise the forward is traced (`traced`): a forward that is its
        layers in order is the plain sequence, any other is cut as traced. A forward the tracer
        cannot take is split by its top-level children only when ``sample`` proves it; without a
        sample (an `Engine` given none), or when the proof fails, it is refused, naming why."""
        if _is_transformers(model) or _plan_blocks(model) is not None:
            return self._nested_route(model)
        if self.layers:
            check_layers(model, self.layers)  # a wrong path is the user's mistake, said as such, never traced around
        gm: Any = None
        why = ""
        refused: ConfigError | None = None
        try:
            gm = traced.trace(model)
        except traced.TraceFailure as failure:
            why = f"torch.fx cannot trace its forward ({failure})"
        if self.layers or is_nested(model, None):
            where = f"layers={self.layers!r}" if self.layers else "its block list"
            try:
                r = self._nested_route(model)
                if not check:
                    return r
                if sample is not None:
                    _prove(model, r, sample, where + (f" ({why})" if why else ""))
                    return r
            except ConfigError as exc:
                if gm is None:
                    raise ConfigError(f"{exc} ({why})") from None
                refused = exc
            if gm is None:
                raise _needs_sample(model, why, where)
        if gm is not None:
            try:
                return self._traced_route(model, gm, sample, check)
            except ConfigError:
                if refused is not None:
                    raise refused from None  # neither split: the block list's reason is the one to read
                raise
        where = "its top-level children in order"
        try:
            r = self._sequence_route(model)
        except ConfigError as exc:
            raise ConfigError(f"{exc} ({why})") from None
        if not check:
            return r
        if sample is None:
            raise _needs_sample(model, why, where)
        _prove(model, r, sample, f"{where} ({why})")
        return r

    def _nested_route(self, model: nn.Module) -> Route:
        layout = nested_layout(model, self.layers)
        check_nested(model, layout, self.num_stages, int(self.microbatches or 1))
        runs = split_blocks(model, layout, self.num_stages, self.split_points)
        if layout.aliases and self.dp_strategy == "fsdp":
            raise ConfigError(
                f"{type(model).__name__} ties {', '.join(f'{a} to {c}' for a, c in layout.aliases.items())}; with the "
                "tied ends on different pipeline stages shardwise sums their gradients itself, which it does for "
                "dp_strategy='ddp' but not under FSDP's sharded gradients; use dp_strategy='ddp'"
            )
        return Route("nested", [[f"{layout.blocks}.{k}" for k in run] for run in runs], layout=layout, block_runs=runs)

    def _sequence_route(self, model: nn.Module) -> Route:
        runs = split_layers(sequence_layers(model), self.num_stages, self.split_points)
        return Route("sequence", [[n for n, _ in run] for run in runs])

    def _traced_route(self, model: nn.Module, gm: Any, sample: Any, check: bool) -> Route:
        if traced.is_chain(gm) and not any(True for _ in model.named_parameters(recurse=False)) and not any(True for _ in model.named_buffers(recurse=False)):
            return self._sequence_route(model)  # the forward is its layers in order: nothing between them
        if self.tp > 1:
            raise ConfigError(
                f"pipeline with tp={self.tp}: {type(model).__name__}'s forward has code between its layers, so its stages are "
                "cut from the traced forward, and tensor parallelism inside such stages is not supported; use tp=1, or "
                "a model whose forward applies its layers in order (or a transformers model)"
            )
        from shardwise.data.batches import model_args

        if sample is not None:
            args, kwargs = model_args(sample)
            if kwargs:
                raise ConfigError(
                    f"{type(model).__name__} is split by its traced forward, whose stages take positional inputs; the batch "
                    f"is a dict ({sorted(kwargs)}): use a tuple batch (inputs..., target)"
                )
            model64 = traced.float64_copy(model)
            gm64 = traced.trace(model64)
            args64 = traced.to_float64(tuple(args))
            plan = traced.plan_stages(gm64, self.num_stages, self.split_points, _types(gm64, args64, model64))
        else:
            plan = traced.plan_stages(gm, self.num_stages, self.split_points, traced.static_types(gm))
        mods: dict[int, nn.Module] = {s: traced.stage_module(gm, plan, s) for s in range(self.num_stages)}  # no copies: the model's own tensors
        ties = traced.cross_stage_ties(model, mods, self.pp)
        r = Route("traced", plan.runs, plan=plan, stage_mods=mods, ties=ties)
        if self.dp_strategy == "fsdp" and ties:
            raise ConfigError(
                f"{type(model).__name__} uses {', '.join(t.name for t in ties)} on stages of different "
                "pipeline ranks; shardwise sums such a weight's gradients itself, which it does for dp_strategy='ddp' but not "
                "under FSDP's sharded gradients; use dp_strategy='ddp'"
            )
        if sample is not None and check and not materialize.has_meta(model):  # on meta tensors there are no values to compare
            stages = [traced.stage_module(gm64, plan, s) for s in range(self.num_stages)]
            order = [n for run in plan.runs for n in run]
            stage_of = {n: s for s, run in enumerate(plan.runs) for n in run}
            traced.check_composition(model64, args64, {}, stages, lambda: traced.run_in_turn(stages, args64, {}, False), order, stage_of, "its traced forward")
        return r

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> PipelineRun:
        if not dist.is_initialized():
            raise ConfigError("strategy 'pipeline' needs a process group; start the run with nproc >= pp through shardwise (Trainer, launch, or shardwise run)")
        if mesh.size("pp") != self.pp or mesh.size("tp") != self.tp:
            raise ConfigError(f"the mesh has pp={mesh.size('pp')} x tp={mesh.size('tp')} but the pipeline was asked for pp={self.pp} x tp={self.tp}")
        return PipelineRun(self, model, make_optimizer, mesh, recorder)


# -- one run: the stages on this rank, the schedule, the step ----------------------------------------


class PipelineRun(Parallel):
    """This rank's stages (``stage_index % pp == pp coordinate``), their schedule, and the reports.

    ``model`` is a `PipelineModule`: this rank's share of the model under the original names,
    whose no-grad forward runs every stage over point-to-point (evaluation); training goes through
    the schedule in ``forward_backward``."""

    def __init__(self, options: Pipeline, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.options, self.mesh, self.recorder = options, mesh, recorder
        self.placement = Placement()
        self.pp, self.tp, self.dp = mesh.size("pp"), mesh.size("tp"), mesh.size("dp")
        self.num_stages = options.num_stages
        self._clock = _Clock()
        self._steps: list[list[tuple[float, float, float]]] = []  # per step: each pp rank's (busy, start, end)
        self._last_events: list[tuple[int, int, str, float, float]] = []
        self._timeline: str | None = None
        self._finished = False
        self._all_names = [n for n, _ in model.named_parameters()]
        self._aliases: dict[str, str] = {}
        self._tied: list[Tie] = []  # weights tied across pipeline ranks
        # the checks of plan(), again (an Engine may not have been given the model), and the proof
        # of a split the tracer did not give, on the sample the Trainer's check_sample left
        route = options.route(model, options.__dict__.get("_sample"))
        self._nested = route.kind == "nested"
        self.stage_layers = route.names
        """The layer (block) names of each stage, over all ranks."""
        if route.kind == "nested":
            assert route.layout is not None and route.block_runs is not None
            layout, block_runs = route.layout, route.block_runs
            self._aliases = layout.aliases
            make_stage: Any = lambda s: NestedStage(model, layout, block_runs[s], s == 0, s == self.num_stages - 1)  # noqa: E731
            self._tied = _cross_stage_ties(model, layout, block_runs, self.pp)
        elif route.kind == "traced":
            assert route.stage_mods is not None and route.ties is not None
            self._aliases = tied_aliases(model)
            self._tied = route.ties
            make_stage = route.stage_mods.__getitem__
        else:
            runs = split_layers(sequence_layers(model), self.num_stages, options.split_points)
            make_stage = lambda s: StageModule(runs[s])  # noqa: E731
        self._state_order = list(model.state_dict().keys())
        self._group = group = mesh.group("pp")
        me = mesh.coordinate("pp")
        stages: dict[int, nn.Module] = {}
        runners: dict[int, nn.Module] = {}
        self.stages: list[Any] = []
        for s in range(me, self.num_stages, self.pp):
            stage_mod = materialize.to_device(make_stage(s), mesh.device)
            if self.tp > 1:
                # Tensor parallel first, inside the stage (original names: the plan matches as on the whole model).
                _tensor_parallel().parallelize(stage_mod, mesh.device_mesh("tp"), plan=options.tp_plan, sequence_parallel=options.sequence_parallel)
                if isinstance(stage_mod, NestedStage):
                    stage_mod.stop_after_other_hooks()  # the stage ends on the gathered sequence
            stages[s] = stage_mod
        # A meta-built model: this rank's stages get storage and their values (the initializers run over the whole model).
        fused = _tensor_parallel().relayout.fused_layout(*stages.values()) if self.tp > 1 else None
        materialize.fill_share(model, [stages[s] for s in sorted(stages)], mesh.device, fused)
        for s in sorted(stages):
            stage_mod = stages[s]
            runners[s] = apply_data_parallel(stage_mod, mesh, options.dp_strategy, self.tp)
            stage = PipelineStage(runners[s], s, self.num_stages, mesh.device, group=group.pg)
            self._clock.instrument(stage)
            record_stage_traffic(stage, group, recorder)
            keep_buffers_through_inference(stage, stage_mod)
            self.stages.append(stage)
        self._tie_params = {t.name: _find_param(stages, t.name, self._aliases) for t in self._tied}
        self._skip_norm = {id(p) for t in self._tied if (p := self._tie_params[t.name]) is not None and me != t.first}
        sync_tied(self._tied, self._tie_params, group, me, grads=False, device=mesh.device, recorder=recorder)  # one logical weight: start equal
        self._clock.align(group, recorder, mesh.device)
        cls = _schedule_class(options.schedule)
        target = self.stages if options.schedule == "interleaved" else self.stages[0]
        # Gradients of the mean loss: divided by m once per parameter after the schedule (`forward_backward`), not by
        # torch per stage (scale_grads), which divides a module held by two of this rank's stages twice (a traced
        # model's module used twice, under interleaving), once partway through the other stage's backwards.
        self.schedule = cls(target, n_microbatches=options.microbatches, loss_fn=self._loss, scale_grads=False)
        self._step_kwargs = {"return_outputs": False} if "return_outputs" in inspect.signature(self.schedule.step).parameters else {}
        self.holds_first = 0 in stages
        self.holds_last = (self.num_stages - 1) in stages
        self.model = PipelineModule(stages, runners, self.num_stages, group, mesh.device, recorder)
        params = list({id(p): p for s in sorted(stages) for p in stages[s].parameters()}.values())  # a tie on one rank: once
        self._last_stage = stages.get(self.num_stages - 1)
        self._params = params
        self.optimizer = make_optimizer(params)
        self._chunks: list[Any] = []
        self._losses: dict[int, torch.Tensor] = {}
        self._step_fn: StepFn | None = None
        self._precision: Precision | None = None

    def module(self) -> nn.Module:
        return self.model  # this rank's share of the model, under the original names

    # -- one step -----------------------------------------------------------------------------
    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss on the last stage: the user's step function on micro-batch ``target``."""
        i = int(target.reshape(-1)[0])
        batch = self._chunks[i]
        full = getattr(self._last_stage, "output", None) if self._nested else None
        assert self._step_fn is not None
        loss = self._step_fn(_Replay(output, batch, full), batch)  # type: ignore[arg-type]
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ConfigError(f"the pipeline's step function must return a scalar loss tensor; got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
        self._losses[i] = loss.detach()  # by index: torch's shape inference may run micro-batch 0 once more
        scaler = self._precision.scaler if self._precision is not None else None
        return scaler.scale(loss) if scaler is not None else loss

    def forward_backward(self, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        if len(microbatches) == 0:
            raise ValueError("a step needs at least one micro-batch")
        m = int(self.options.microbatches or 1)
        batch = concat_batches(microbatches)
        check_rows(batch_rows(batch), m, "pipeline forward_backward")  # every rank, before any send
        from shardwise.data.batches import model_args

        self._chunks = split_batch(batch, m)
        self._step_fn, self._precision = step_fn, precision
        self._losses = {}
        self._clock.events = []
        call_args, call_kwargs = model_args(batch)
        if self._nested:
            # every stage gets the micro-batch as keywords (masks, positions); only the first reads the inputs
            args: tuple[Any, ...] = ()
            kwargs = batch_kwargs(call_args, call_kwargs)
        else:
            if call_kwargs:
                raise ConfigError(
                    "a dict batch needs a model the pipeline splits by its block list (a transformers model, or "
                    "layers='path.to.blocks'); this model is split by its top-level children, which take one tensor"
                )
            args, kwargs = (call_args if self.holds_first else ()), {}
        target = torch.arange(m) if self.holds_last else None
        start = time.perf_counter()
        with precision.autocast():
            self.schedule.step(*args, target=target, **kwargs, **self._step_kwargs)
        end = time.perf_counter()
        self._chunks = []
        if m > 1:
            for p in self._params:
                if p.grad is not None:
                    p.grad.div_(m)
        sync_tied(self._tied, self._tie_params, self._group, self.mesh.coordinate("pp"), grads=True, device=self.mesh.device, recorder=self.recorder)
        average_grads(
            self.model, self.mesh, dp_strategy=self.options.dp_strategy, tp=self.tp, sequence_parallel=self.options.sequence_parallel, recorder=self.recorder
        )
        busy = sum(e - s for _, _, _, s, e in self._clock.events)
        loss = torch.stack([self._losses[i] for i in sorted(self._losses)]).double().mean() if self.holds_last else torch.zeros((), dtype=torch.float64)
        # One small all_gather per step: the loss (from the last stage) and every stage's timing.
        dtype_code = _DTYPES.index(next(iter(self._losses.values())).dtype) if self._losses else -1
        mine = torch.tensor([float(loss), busy, start - self._clock.offset, end - self._clock.offset, dtype_code], dtype=torch.float64, device=self.mesh.device)
        rows = [r.cpu() for r in all_gather(mine, group=self._group, recorder=self.recorder)]
        self._steps.append([(float(r[1]), float(r[2]), float(r[3])) for r in rows])
        self._last_events = [(st, mb, kind, s - self._clock.offset, e - self._clock.offset) for st, mb, kind, s, e in self._clock.events]
        last_rank = (self.num_stages - 1) % self.pp
        dtype = _DTYPES[int(rows[last_rank][4])]  # the last stage's loss dtype, on every rank
        return rows[last_rank][0].to(device=self.mesh.device, dtype=dtype)

    def no_sync(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # the schedule accumulates over micro-batches; gradients sync once, after it

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm, each gradient's square counted once (see `compose.clip_grad_norm`)."""
        return clip_grad_norm(self.model, max_norm, self.mesh.device, self._group if self.pp > 1 else None, skip=self._skip_norm, recorder=self.recorder)

    def after_step(self, step: int) -> None:
        return None  # gradients were synchronized in forward_backward, before the step

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self, optimizer: bool) -> dict[str, Any]:
        """The whole model (and optimizer, numbered as the whole model's optimizer numbers its
        parameters), gathered from every pipeline rank to every rank of the group."""
        return gather_state(
            self.model,
            self.optimizer if optimizer else None,
            self._group,
            self._all_names,
            self._aliases,
            device=self.mesh.device,
            recorder=self.recorder,
            order=self._state_order,
        )

    def state_part(self, optimizer: bool) -> dict[str, Any] | None:
        """Checkpoints in parts: each pipeline rank writes its own stages' state (dp 0, tp 0 of each pipeline
        rank; the whole tensors of a tp split gathered first, collectively), so no rank holds the whole model
        to save it (`shardwise.checkpoint.parts`; read back whole, under any strategy)."""
        part = local_part(self.model, self.optimizer if optimizer else None, self._aliases)
        writes = self.mesh.coordinate("dp") == 0 and self.mesh.coordinate("tp") == 0
        return {"part": part if writes else None, "ranks": [p * self.tp for p in range(self.pp)], "names": self._all_names, "order": self._state_order}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep this rank's part of a whole-model state (from any strategy's ``state_dict``)."""
        load_local_state(self.model, self.optimizer, state, self._all_names, self._aliases)

    def save_extra_state(self, directory: Path) -> None:
        return None  # the gathered state_dict holds every stage's model and optimizer

    def load_extra_state(self, path: Path) -> None:
        return None

    # -- observability ------------------------------------------------------------------------
    def finish(self) -> None:
        """With ``timeline`` set, the last step's events of every pipeline rank gathered (tensors, over
        the pp group) and drawn by global rank 0. Every rank calls it once; again, it does nothing."""
        if self._finished:
            return
        self._finished = True
        if self.options.timeline:
            events = gather_events(self._last_events, self._group, self.recorder, self.mesh.device)
            if self.mesh.rank == 0:
                self._timeline = write_timeline(self.options.timeline, events, self.pp, self.options.schedule)

    def summary(self) -> dict[str, Any]:
        """The ``pipeline`` section: the schedule, the mesh (pp, tp, dp), the split, the bubble measured and predicted."""
        o = self.options
        section = bubble_section(
            self._steps,
            schedule=o.schedule,
            pp=self.pp,
            microbatches=int(o.microbatches or 1),
            virtual_stages=int(o.virtual_stages or 1),
            num_stages=self.num_stages,
            stage_layers=self.stage_layers,
            warmup_steps=o.warmup_steps,
        )
        section.update({"tp": self.tp, "dp": self.dp, "dp_strategy": o.dp_strategy, "sequence_parallel": o.sequence_parallel})
        if self._timeline is not None:
            section["timeline"] = self._timeline
        return {"pipeline": section}
