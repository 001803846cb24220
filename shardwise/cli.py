"""The ``shardwise`` command.

::

    shardwise train --recipe NAME [--strategy NAME] [--nproc N] [--max-steps N] [--out DIR]
                    [--resume auto|PATH] [--overwrite] [--config FILE.toml] [--set section.key=value ...]
                    [--allreduce ALGO] [--compression CODEC] [--offload]
    shardwise export CHECKPOINT_DIR OUT.safetensors      # consolidated weights, any strategy's checkpoint
    shardwise run [torchrun flags] script.py [args ...]
    shardwise bench comm [--nproc P] [--algorithms ...] [--sizes ...] [--json FILE]
    shardwise strategies | recipes
    shardwise --version
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from shardwise.errors import ShardwiseError

# Command-line flags that map onto trainer settings (flag dest -> TrainerConfig field).
_TRAINER_FLAGS = {
    "strategy": "strategy",
    "nproc": "nproc",
    "max_steps": "max_steps",
    "max_epochs": "max_epochs",
    "out": "out",
    "resume": "resume",
    "overwrite": "overwrite",
    "precision": "precision",
    "accelerator": "accelerator",
    "global_batch_size": "global_batch_size",
    "accumulate": "accumulate",
    "seed": "seed",
    "clip_grad_norm": "clip_grad_norm",
    "checkpoint_every": "checkpoint_every",
    "log_every": "log_every",
    "val_every": "val_every",
}


def _train_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="train a built-in recipe", description="Train a built-in recipe with any strategy.")
    p.add_argument("--recipe", required=True, help="recipe name (see `shardwise recipes`)")
    p.add_argument("--strategy", help="strategy name (default single; see `shardwise strategies`)")
    p.add_argument("--nproc", type=int, help="local worker processes (default 1); under torchrun/srun the job's processes are used, and a different N > 1 is an error")
    p.add_argument("--max-steps", type=int, help="optimizer steps (default: the recipe's, 300 for digits and charlm)")
    p.add_argument("--max-epochs", type=int)
    p.add_argument("--out", help="run directory: metrics.jsonl, summary.json, checkpoints/")
    p.add_argument("--resume", help="'auto' (newest valid checkpoint in --out) or a checkpoint directory")
    p.add_argument("--overwrite", action="store_true", default=None, help="start afresh in an --out that holds an earlier run (its files are moved to OUT/replaced-<time>/)")
    p.add_argument("--precision", help="32, 64, bf16-mixed, 16-mixed")
    p.add_argument("--accelerator", choices=["auto", "cpu", "cuda"])
    p.add_argument("--global-batch-size", type=int)
    p.add_argument("--accumulate", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--clip-grad-norm", type=float)
    p.add_argument("--checkpoint-every", type=int)
    p.add_argument("--log-every", type=int)
    p.add_argument("--val-every", type=int)
    p.add_argument("--allreduce", metavar="ALGO", help="ddp: allreduce algorithm for gradient buckets: ring, recursive-doubling, rabenseifner, tree, master-worker, all-to-all, native (sets strategy_options.allreduce)")
    p.add_argument("--compression", metavar="CODEC", help="ddp: gradient compression: fp16, bf16, int8, topk:RATIO, randomk:RATIO, sign, powersgd:RANK (sets strategy_options.compression)")
    p.add_argument("--offload", action="store_true", default=None, help="zero2/zero3/fsdp/hsdp: keep parameter, gradient and optimizer shards in CPU memory (sets strategy_options.offload)")
    p.add_argument("--sync-every", type=int, metavar="H", help="local-sgd/diloco/gossip: average the replicas every H steps (sets strategy_options.sync_every)")
    p.add_argument("--servers", type=int, metavar="K", help="ps: parameter-server processes among --nproc (sets strategy_options.servers)")
    p.add_argument("--mode", choices=["sync", "async", "ssp"], help="ps: sync (equals ddp without clipping: with --clip-grad-norm each worker clips its own gradient), async, or ssp with --staleness (sets strategy_options.mode)")
    p.add_argument("--staleness", type=int, metavar="S", help="ps --mode ssp: no worker runs more than S steps ahead of the slowest (sets strategy_options.staleness)")
    p.add_argument("--pp", type=int, metavar="N", help="pipeline: number of pipeline stages (sets strategy_options.pp)")
    p.add_argument("--tp", type=int, metavar="N", help="tp/pipeline: tensor-parallel degree (sets strategy_options.tp)")
    p.add_argument("--microbatches", type=int, metavar="M", help="pipeline: micro-batches per step (sets strategy_options.microbatches)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], help="pipeline: schedule (sets strategy_options.schedule)")
    p.add_argument("--layers", metavar="PATH", help="pipeline: dotted path of the model's list of blocks to cut into stages, e.g. model.layers (sets strategy_options.layers; found by itself when not given)")
    p.add_argument("--split-points", metavar="NAMES", help="pipeline: comma-separated layer names that start stages 1.. (sets strategy_options.split_points)")
    p.add_argument("--sequence-parallel", action="store_true", default=None, help="tp: shard norms and dropout along the sequence (sets strategy_options.sequence_parallel)")
    p.add_argument("--dp-strategy", choices=["ddp", "fsdp"], help="tp/pipeline: how the data-parallel dimension is kept in sync (sets strategy_options.dp_strategy)")
    p.add_argument("--straggler", metavar="RANK:FACTOR", help="slow rank RANK down FACTOR times on purpose (demonstrations, benchmarks)")
    p.add_argument("--config", help="TOML file with [trainer] and [recipe] sections")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one setting (repeatable)")
    p.add_argument("--print-summary", action="store_true", help="print summary.json to stdout at the end")


def cmd_train(args: argparse.Namespace) -> int:
    from shardwise.engine import seed_everything
    from shardwise.recipes import get_recipe
    from shardwise.trainer.config import apply_overrides, from_mapping, load_toml
    from shardwise.trainer.loop import Trainer

    recipe = get_recipe(args.recipe)
    sections = load_toml(args.config) if args.config else {}
    sections = apply_overrides(sections, args.set)
    unknown = sorted(set(sections) - {"trainer", "recipe"})
    if unknown:
        raise ShardwiseError(f"unknown config sections {unknown}; use [trainer] and [recipe]")
    settings: dict[str, Any] = {**recipe.trainer_defaults, **sections.get("trainer", {})}
    for dest, name in _TRAINER_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            settings[name] = value
    for option in ("allreduce", "compression", "offload", "sync_every", "servers", "mode", "staleness",
                   "pp", "tp", "microbatches", "schedule", "sequence_parallel", "dp_strategy", "layers", "split_points"):  # strategy options with flags of their own
        value = getattr(args, option)
        if value is not None:
            settings["strategy_options"] = {**settings.get("strategy_options", {}), option: value}
    config = from_mapping(settings)  # validates before anything is built or started
    seed_everything(config.seed)  # every rank (under an external launcher) builds the same initial model
    parts = recipe.parts(sections.get("recipe"))
    callbacks = []
    if args.straggler is not None:
        from shardwise.trainer.straggler import Straggler

        callbacks.append(Straggler.from_spec(args.straggler))
    trainer = Trainer(config=config, optimizer=parts.optimizer, loss_fn=parts.loss_fn, lr_scheduler=parts.lr_scheduler, metrics=parts.metrics, callbacks=callbacks)
    summary = trainer.fit(parts.model, parts.train, parts.val)
    if parts.after_fit is not None and _is_rank_zero():
        print(parts.after_fit(parts.model), flush=True)
    if args.print_summary:
        print(json.dumps(summary, indent=2, default=str))
    return 0


def _is_rank_zero() -> bool:
    from shardwise.launcher.env import detect_env

    return detect_env().rank == 0


def cmd_export(args: argparse.Namespace) -> int:
    from shardwise.checkpoint import export_safetensors

    n, size = export_safetensors(args.checkpoint, args.out, key=args.key)
    print(f"wrote {n} tensors ({size / 2**20:.2f} MiB) to {args.out}")
    return 0


def cmd_run(argv: Sequence[str]) -> int:
    from shardwise.launcher.torchrun import run

    if not argv or argv[0] in ("-h", "--help"):
        print("usage: shardwise run [torchrun flags] script.py [args ...]\n\n"
              "Runs a script on torch.distributed.run (torchrun) with defaults that work:\n"
              "  --standalone on one machine, fresh rendezvous stores on restart,\n"
              "  a short last-call wait for --nnodes MIN:MAX. Every torchrun flag is accepted.")
        return 0
    return run(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        # torchrun's own flags go straight through; argparse would eat them.
        return _guard(lambda: cmd_run(argv[1:]))
    if argv and argv[0] == "bench":
        from shardwise.bench import main as bench_main  # loaded only for this command

        return _guard(lambda: bench_main(argv[1:]))
    parser = argparse.ArgumentParser(prog="shardwise", description="Distributed training on PyTorch: every strategy behind one flag.")
    from shardwise import __version__

    parser.add_argument("--version", action="version", version=f"shardwise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    sub.add_parser("run", help="run a script under torchrun with working defaults")
    sub.add_parser("bench", help="benchmarks shipped with the package (`shardwise bench comm --help`)")
    ex = sub.add_parser("export", help="write a checkpoint's consolidated model weights to one safetensors file",
                        description="Consolidate a checkpoint's model weights (sharded or not) into one .safetensors file "
                                    "for use outside shardwise (needs the safetensors package: pip install safetensors).")
    ex.add_argument("checkpoint", help="a checkpoint directory (e.g. runs/x/checkpoints/step-00000300)")
    ex.add_argument("out", help="the .safetensors file to write")
    ex.add_argument("--key", default="model", help="which saved model to export (default: model)")
    sub.add_parser("strategies", help="list the strategies")
    sub.add_parser("recipes", help="list the built-in recipes")
    args = parser.parse_args(argv)
    if args.command == "train":
        return _guard(lambda: cmd_train(args))
    if args.command == "export":
        return _guard(lambda: cmd_export(args))
    if args.command == "strategies":
        from shardwise.strategies import available

        print("\n".join(available()))
        return 0
    if args.command == "recipes":
        from shardwise.recipes import available as recipes, get_recipe

        for name in recipes():
            print(f"{name:12s} {get_recipe(name).description}")
        return 0
    return 2


def _guard(fn: Any) -> int:
    """User errors print one clear line and exit 2; anything else keeps its traceback."""
    try:
        return int(fn())
    except ShardwiseError as exc:
        print(f"shardwise: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shardwise: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
