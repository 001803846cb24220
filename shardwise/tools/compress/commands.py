"""``shardwise compress {quantize,prune,distill}``: compress a recipe's trained model and measure it.

Each command loads the model from a run directory, a checkpoint or a ``.safetensors`` export
(`shardwise.tools.compress.load`), measures it before and after on the recipe's validation data
(`shardwise.tools.compress.measure`), prints a table and writes ``report.json`` (and the compressed
weights) into ``--out``. Bad input (a checkpoint of another model, a sparsity outside [0, 1), a
model with no Linear layer) is one line, before any work.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardwise.config import add_arguments as add_flags
from shardwise.config import flag
from shardwise.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

_Q_DESCRIPTION = "Post-training int8 of the Linear layers; size, latency and accuracy before and after."
_P_DESCRIPTION = "Magnitude pruning of the Linear weights, one-shot and with fine-tuning; sparsity, size and accuracy."
_D_DESCRIPTION = "Distill a teacher into a smaller student with the Trainer; compare with the student trained alone (same steps, same seed)."
COMPRESS_HELP = "compress a trained recipe model (int8 quantization, magnitude pruning, distillation) and measure it"


_FROM = "a run directory (its newest checkpoint), a checkpoint directory or a .safetensors export"


@dataclass(frozen=True, kw_only=True)
class CompressOptions:
    """The flags every compress command takes (`shardwise.config.flag`: each field's flag, default and help)."""

    recipe: str = flag(help="the recipe the model comes from (digits, charlm)", required=True)
    set: list[str] = flag(help="the recipe options the checkpoint was trained with", action="append", metavar="recipe.KEY=VALUE", default_factory=list)
    out: str = flag(help="directory for report.json and the compressed weights", required=True)
    batch_size: int | None = flag(None, "batch size of evaluation and latency (default: the recipe's global batch)")


@dataclass(frozen=True, kw_only=True)
class _Checkpoint:
    checkpoint: str = flag(help=_FROM, positional=True)


@dataclass(frozen=True, kw_only=True)
class QuantizeOptions(CompressOptions, _Checkpoint):
    """``shardwise compress quantize``'s arguments."""

    to: str = flag("int8", "the target type (int8)", choices=("int8",))
    calibration_batches: int = flag(8, "training batches the static observers see (default 8)")
    repeats: int = flag(30, "timed forward passes per latency figure (median; default 30)")


@dataclass(frozen=True, kw_only=True)
class PruneOptions(CompressOptions, _Checkpoint):
    """``shardwise compress prune``'s arguments."""

    sparsity: float = flag(help="fraction of weights (or channels/heads with --structured) to remove, in [0, 1)", required=True)
    structured: bool = flag(False, "remove whole output channels (and attention heads) instead of single weights")
    finetune_steps: int = flag(0, "also prune iteratively while fine-tuning this many steps (ModelPruning), and report that too")
    rounds: int = flag(3, "pruning rounds spread over the fine-tuning steps (default 3)")


@dataclass(frozen=True, kw_only=True)
class _Teacher:
    teacher: str = flag(help="the teacher: a run directory, a checkpoint directory or a .safetensors export", required=True)


@dataclass(frozen=True, kw_only=True)
class DistillOptions(CompressOptions, _Teacher):
    """``shardwise compress distill``'s arguments."""

    student_set: list[str] = flag(help="the student's recipe options (default: smaller)", action="append", metavar="recipe.KEY=VALUE", default_factory=list)
    steps: int | None = flag(None, "training steps of each student (default: the recipe's)")
    temperature: float = flag(2.0, "softmax temperature T (default 2)")
    soft_weight: float = flag(0.5, "weight of T^2 KL (default 0.5)")
    hard_weight: float = flag(0.5, "weight of the hard-label cross entropy (default 0.5)")
    strategy: str = flag("single", "data-parallel strategy of the student's training (default single)")
    nproc: int = flag(1, "processes (default 1)")
    seed: int = flag(0, "seed of both students' initialization and data order (default 0)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="compress_command", required=True)
    add_flags(sub.add_parser("quantize", help="dynamic and static int8 of the Linear layers (CPU)", description=_Q_DESCRIPTION), QuantizeOptions)
    add_flags(sub.add_parser("prune", help="magnitude pruning to a target sparsity", description=_P_DESCRIPTION), PruneOptions)
    distill_help = "train a smaller student from a teacher checkpoint, against the same student alone"
    add_flags(sub.add_parser("distill", help=distill_help, description=_D_DESCRIPTION), DistillOptions)


def _options(items: list[str]) -> dict[str, Any]:
    from shardwise.trainer.config import apply_overrides

    sections = apply_overrides({}, items)
    unknown = sorted(set(sections) - {"recipe"})
    if unknown:
        raise ConfigError(f"--set here takes recipe.KEY=VALUE only; got sections {unknown}")
    return dict(sections.get("recipe", {}))


def _batch_size(args: argparse.Namespace) -> int:
    from shardwise.tools.recipes import get_recipe

    size = args.batch_size or int(get_recipe(args.recipe).trainer_defaults.get("global_batch_size", 32))
    if size < 1:
        raise ConfigError(f"--batch-size must be >= 1; got {size}")
    return size


def _write(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")


def _row(name: str, r: dict[str, Any]) -> str:
    acc = r.get("val_accuracy")
    lat = f"{r['latency_ms_1_thread']:8.3f} {r['latency_ms_all_threads']:8.3f}" if "latency_ms_1_thread" in r else f"{'':8s} {'':8s}"
    return f"{name:22s} {r['bytes'] / 1024:9.1f} {lat} {r['val_loss']:9.4f} {'' if acc is None else f'{100 * acc:8.2f}'}"


def _table(rows: dict[str, dict[str, Any]]) -> str:
    head = f"{'model':22s} {'KiB':>9s} {'ms/1thr':>8s} {'ms/all':>8s} {'val_loss':>9s} {'acc %':>8s}"
    return "\n".join([head, *(_row(k, v) for k, v in rows.items())])


def cmd_quantize(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from shardwise.tools.compress import measure
    from shardwise.tools.compress.load import load_recipe_model
    from shardwise.tools.compress.quantize import check_quantizable, dynamic_int8, int8_layers, linear_weight_bytes, static_int8

    if args.calibration_batches < 1 or args.repeats < 1:
        raise ConfigError(f"--calibration-batches and --repeats must be >= 1; got {args.calibration_batches} and {args.repeats}")
    model, parts, path = load_recipe_model(args.checkpoint, args.recipe, _options(args.set))
    check_quantizable(model)
    size = _batch_size(args)
    val = measure.batches(parts.val, size)
    calibration = measure.batches(parts.train, size)[: args.calibration_batches]
    threads = torch.get_num_threads()
    models = {"fp32": model, "dynamic_int8": dynamic_int8(model), "static_int8": static_int8(model, calibration)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, m in models.items():
        torch.save(m.state_dict(), out / f"{name}.pt")
        rows[name] = {
            "bytes": (out / f"{name}.pt").stat().st_size,
            "linear_weight_bytes": linear_weight_bytes(m),
            "int8_layers": len(int8_layers(m)),
            "latency_ms_1_thread": measure.latency_ms(m, val[0][0], 1, args.repeats),
            "latency_ms_all_threads": measure.latency_ms(m, val[0][0], threads, args.repeats),
            **measure.evaluate(m, val, parts.loss_fn, parts.metrics),
        }
    report = {"command": "quantize", "recipe": args.recipe, "checkpoint": str(path), "batch_size": size, "threads_all": threads, "models": rows}
    _write(out, report)
    print(f"{args.recipe} from {path}: batch {size}, latency median of {args.repeats} at 1 and {threads} threads")
    print(_table(rows))
    print(f"wrote {out / 'report.json'}")
    return report


def cmd_prune(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from shardwise.tools.compress import measure
    from shardwise.tools.compress.load import load_recipe_model
    from shardwise.tools.compress.prune import ModelPruning, check_sparsity, linears, make_permanent, prune_to, sparse_bytes, sparsity_of

    check_sparsity(args.sparsity)
    if args.finetune_steps < 0 or args.rounds < 1:
        raise ConfigError(f"--finetune-steps must be >= 0 and --rounds >= 1; got {args.finetune_steps} and {args.rounds}")
    options = _options(args.set)
    model, parts, path = load_recipe_model(args.checkpoint, args.recipe, options)
    linears(model)
    val = measure.batches(parts.val, _batch_size(args))

    def row(m: nn.Module) -> dict[str, Any]:
        scores = measure.evaluate(m, val, parts.loss_fn, parts.metrics)
        return {"bytes": measure.saved_bytes(m.state_dict()), "sparse_bytes": sparse_bytes(m), **sparsity_of(m), **scores}

    rows = {"dense": row(model)}
    oneshot, _, _ = load_recipe_model(args.checkpoint, args.recipe, options)
    prune_to(oneshot, args.sparsity, args.structured)
    rows["pruned"] = row(make_permanent(oneshot))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(oneshot.state_dict(), out / "pruned.pt")
    if args.finetune_steps:
        from shardwise.engine import seed_everything
        from shardwise.tools.recipes import get_recipe
        from shardwise.trainer.config import from_mapping
        from shardwise.trainer.loop import Trainer

        tuned, tparts, _ = load_recipe_model(args.checkpoint, args.recipe, options)
        every = max(1, args.finetune_steps // args.rounds)
        steps = [1 + i * every for i in range(args.rounds) if 1 + i * every <= args.finetune_steps]
        config = from_mapping(dict(get_recipe(args.recipe).trainer_defaults)).probe(args.finetune_steps)
        seed_everything(config.seed)
        pruning = ModelPruning(args.sparsity, at_steps=steps, structured=args.structured)
        print(f"pruned_finetuned: fine-tuning {args.finetune_steps} steps, pruning at steps {steps}", flush=True)
        Trainer(config=config, optimizer=tparts.optimizer, loss_fn=tparts.loss_fn, callbacks=[pruning]).fit(tuned.train(), tparts.train)
        rows["pruned_finetuned"] = {**row(tuned.eval()), "finetune_steps": args.finetune_steps, "prune_at_steps": steps}
        torch.save(tuned.state_dict(), out / "pruned_finetuned.pt")
    report = {"command": "prune", "recipe": args.recipe, "checkpoint": str(path), "sparsity": args.sparsity, "structured": args.structured, "models": rows}
    _write(out, report)
    print(f"{args.recipe} from {path}: {'structured' if args.structured else 'global unstructured'} magnitude pruning to {args.sparsity}")
    print(f"{'model':18s} {'sparsity':>8s} {'dense KiB':>9s} {'CSR KiB':>9s} {'val_loss':>9s} {'acc %':>7s}")
    for k, r in rows.items():
        acc = r.get("val_accuracy")
        acc_text = "" if acc is None else f"{100 * acc:7.2f}"
        print(f"{k:18s} {r['sparsity']:8.4f} {r['bytes'] / 1024:9.1f} {r['sparse_bytes'] / 1024:9.1f} {r['val_loss']:9.4f} {acc_text}")
    print(f"wrote {out / 'report.json'}")
    return report


_SMALLER = {"digits": ["recipe.hidden=32"], "charlm": ["recipe.d_model=64", "recipe.n_layers=2"]}


def cmd_distill(args: argparse.Namespace) -> dict[str, Any]:
    from shardwise.engine import seed_everything
    from shardwise.tools.compress import measure
    from shardwise.tools.compress.distill import Distillation
    from shardwise.tools.compress.load import load_recipe_model
    from shardwise.tools.recipes import get_recipe
    from shardwise.trainer.config import from_mapping
    from shardwise.trainer.loop import Trainer

    recipe = get_recipe(args.recipe)
    teacher, tparts, path = load_recipe_model(args.teacher, args.recipe, _options(args.set))
    student_options = _options(args.student_set or _SMALLER.get(args.recipe, []))
    settings = {**recipe.trainer_defaults, "strategy": args.strategy, "nproc": args.nproc, "seed": args.seed}
    config = from_mapping(settings).probe(args.steps or int(recipe.trainer_defaults.get("max_steps", 300)))
    loss = Distillation(teacher, temperature=args.temperature, soft_weight=args.soft_weight, hard_weight=args.hard_weight)
    val = measure.batches(tparts.val, _batch_size(args))
    teacher_scores = measure.evaluate(teacher, val, tparts.loss_fn, tparts.metrics)
    rows: dict[str, dict[str, Any]] = {"teacher": {"parameters": sum(p.numel() for p in teacher.parameters()), **teacher_scores}}
    for name, loss_fn in (("student_alone", None), ("student_distilled", loss)):
        print(f"{name}: {'the student trained alone' if loss_fn is None else 'the same student distilled from the teacher'}", flush=True)
        seed_everything(args.seed)  # both students start from the same weights and see the same batches
        parts = recipe.parts(student_options)
        Trainer(config=config, optimizer=parts.optimizer, loss_fn=loss_fn or parts.loss_fn).fit(parts.model, parts.train)
        rows[name] = {"parameters": sum(p.numel() for p in parts.model.parameters()), **measure.evaluate(parts.model, val, parts.loss_fn, parts.metrics)}
    report = {
        "command": "distill",
        "recipe": args.recipe,
        "teacher": str(path),
        "student_options": student_options,
        "steps": config.max_steps,
        "strategy": args.strategy,
        "nproc": args.nproc,
        "seed": args.seed,
        "temperature": args.temperature,
        "soft_weight": args.soft_weight,
        "hard_weight": args.hard_weight,
        "models": rows,
    }
    _write(Path(args.out), report)
    print(f"{args.recipe}: student {student_options} trained {config.max_steps} steps ({args.strategy}, {args.nproc} process(es), seed {args.seed})")
    print(f"{'model':18s} {'parameters':>10s} {'val_loss':>9s} {'acc %':>7s}")
    for k, r in rows.items():
        acc = r.get("val_accuracy")
        print(f"{k:18s} {r['parameters']:10d} {r['val_loss']:9.4f} {'' if acc is None else f'{100 * acc:7.2f}'}")
    print(f"wrote {Path(args.out) / 'report.json'}")
    return report


def main(args: argparse.Namespace) -> int:
    {"quantize": cmd_quantize, "prune": cmd_prune, "distill": cmd_distill}[args.compress_command](args)
    return 0
