"""``shardwise tune hparams``: trials as runs of their own, K at a time; pruning; the best and its command; errors first.

One search through the Python API (3 digits runs, 2 at a time, the third pruned) carries most
checks; one through the command line (your own model, ``param.NAME``, ``--json``) is reproduced by
the command it prints; the mistakes are refused in this process, before any trial starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.errors import ConfigError
from shardwise.tools.tune import hparam, search_hparams
from shardwise.tools.tune.space import format_value, parse_space, parse_value

pytestmark = [pytest.mark.timeout(300)]

GOOD, BETTER, DIVERGES = 0.002, 0.01, 3.0
"""Learning rates of the digits recipe's AdamW: at 3.0 the validation loss is in the hundreds or
more at step 10 (a fresh classifier's is ln 10 = 2.3; the others are below it). The runs are 600
steps, a few seconds of training: the search must read step 10 of the diverging run and stop it before
the run ends by itself. At 150 steps (about a second of training) a full suite once starved the
search's polling thread that long, and the run completed unpruned."""
STEPS, EVERY = 600, 10


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    out = tmp_path_factory.mktemp("search") / "hp"
    result = search_hparams(
        {"recipe.lr": "loguniform:1e-4:10"},
        recipe="digits",
        first=[{"recipe.lr": GOOD}, {"recipe.lr": BETTER}, {"recipe.lr": DIVERGES}],
        trials=3,
        parallel=2,
        max_steps=STEPS,
        report_every=EVERY,
        startup_trials=1,
        out=str(out),
        echo=False,
    )
    return result, out


@pytest.mark.e2e
def test_each_trial_is_a_run_of_its_own_and_two_ran_at_once(search):
    result, out = search
    assert [t.number for t in result.trials] == [0, 1, 2]
    assert [t.params["recipe.lr"] for t in result.trials] == [GOOD, BETTER, DIVERGES]
    pids = {t.pid for t in result.trials}
    assert len(pids) == 3 and os.getpid() not in pids
    for t in result.trials:
        run = out / f"trial-{t.number:04d}"
        assert t.out == str(run) and (run / "metrics.jsonl").is_file() and (run / "summary.json").is_file()
        assert t.command[1:4] == ["-m", "shardwise", "train"] and t.command[-2:] == ["--out", str(run)]
        assert f"recipe.lr={format_value(t.params['recipe.lr'])}" in t.command
        # what the pruner saw is what the run wrote, step by step
        logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert t.intermediate == {r["step"]: r["val_loss"] for r in logged if "val_loss" in r}
    first, second, _ = result.trials
    assert first.started < second.ended and second.started < first.ended  # parallel=2: the first two overlapped


@pytest.mark.e2e
def test_the_best_is_the_best_value_of_the_table_and_its_command_reproduces_its_settings(search):
    result, _ = search
    complete = [t for t in result.trials if t.state == "complete"]
    assert [t.number for t in complete] == [0, 1] and all(t.steps == STEPS for t in complete)
    for t in complete:
        assert t.value == json.loads((Path(t.out) / "summary.json").read_text())["val_loss"]
    best = min(complete, key=lambda t: t.value)
    assert result.best is best and best.params["recipe.lr"] in (GOOD, BETTER)
    lines = result.table().splitlines()
    assert lines[0].split() == ["trial", "state", "val_loss", "steps", "seconds", "recipe.lr"]
    assert lines[1 + best.number].startswith(f"{best.number}*") and sum("*" in line for line in lines) == 1
    command = result.command()
    assert command.startswith(f"shardwise train --recipe digits --max-steps {STEPS} --set trainer.val_every={EVERY} ")
    assert command.endswith(f"--set recipe.lr={best.params['recipe.lr']!r}")
    assert "--out" not in command
    threads = json.loads((Path(best.out) / "summary.json").read_text())["threads"]
    assert f" --threads {threads} --set recipe.lr=" in command  # the count the trials ran with, not a fresh run's automatic one


@pytest.mark.e2e
def test_a_clearly_worse_trial_is_pruned_and_its_process_ends(search):
    result, out = search
    bad = result.trials[2]
    assert bad.state == "pruned" and bad.pruned_at == EVERY and bad.value == bad.intermediate[EVERY] > 100
    # SIGTERM is shardwise train's preemption: it stopped at a logged step (log_every = report_every), checkpoint written, exit 75
    assert EVERY < bad.steps < STEPS and bad.steps % EVERY == 0 and bad.returncode == 75
    summary = json.loads((out / "trial-0002" / "summary.json").read_text())
    assert summary["preempted"]["signal"] == "SIGTERM" and summary["steps"] == bad.steps
    with pytest.raises(ProcessLookupError):
        os.kill(bad.pid, 0)


@pytest.mark.e2e
def test_search_json_holds_the_table(search):
    result, out = search
    doc = json.loads((out / "search.json").read_text())
    assert doc == json.loads(json.dumps(result.to_dict()))
    assert [(t["trial"], t["state"]) for t in doc["trials"]] == [(0, "complete"), (1, "complete"), (2, "pruned")]
    assert doc["best"]["trial"] == result.best.number and doc["best"]["command"] == result.command()
    assert doc["metric"] == "val_loss" and doc["direction"] == "minimize"
    assert doc["settings"]["space"] == {"recipe.lr": "loguniform:0.0001:10.0"} and doc["settings"]["report_every"] == EVERY


OWN = """
import torch
from shardwise.tools.tune import hparam

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, hparam("width", 8)), torch.nn.ReLU(), torch.nn.Linear(hparam("width", 8), 2))

def _data(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 4, generator=g)
    return torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())

def data():
    return _data(1)

def val():
    return _data(2)

def loss(out, batch):
    return torch.nn.functional.cross_entropy(out, batch[1])

def opt(params):
    return torch.optim.SGD(params, lr=hparam("lr", 0.01))
"""


@pytest.mark.e2e
def test_the_command_line_searches_your_own_model_and_its_best_command_reproduces_the_best_value(tmp_path):
    (tmp_path / "mine.py").write_text(OWN)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    own = ["--model", "mine:model", "--data", "mine:data", "--val-data", "mine:val", "--loss", "mine:loss", "--optimizer", "mine:opt"]
    space = ["--space", "param.lr=choice:0.3,0.001", "--space", "param.width=choice:16", "--space", "trainer.global_batch_size=choice:32"]
    args = ["tune", "hparams", *own, *space, "--sampler", "grid", "--trials", "2", "--parallel", "2", "--max-steps", "10", "--json", "hp.json"]
    proc = subprocess.run([sys.executable, "-m", "shardwise", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "hp.json").read_text())
    assert sorted(t["params"]["param.lr"] for t in doc["trials"]) == [0.001, 0.3] and {t["state"] for t in doc["trials"]} == {"complete"}
    for t in doc["trials"]:  # each run's factories read their own values: the width is in the model it trained
        summary = json.loads((tmp_path / t["out"] / "summary.json").read_text())
        assert summary["model_summary"]["parameters_per_rank"] == [4 * 16 + 16 + 16 * 2 + 2] and summary["global_batch_size"] == 32
    best = min(doc["trials"], key=lambda t: t["value"])
    assert doc["best"]["trial"] == best["trial"] and f"best: trial {best['trial']}, val_loss {best['value']:.4g}" in proc.stdout
    command = doc["best"]["command"]
    assert f"reproduce: {command}" in proc.stdout and command.startswith(f"SHARDWISE_HPARAMS='{json.dumps({'lr': best['params']['param.lr'], 'width': 16})}'")
    again = subprocess.run(["bash", "-c", f"{command} --out again"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["val_loss"] == pytest.approx(best["value"], rel=1e-4)


@pytest.mark.parametrize(
    ("space", "kwargs", "message"),
    [
        (["recipe.lr=loguniform:1e-4"], {}, "--space recipe.lr=loguniform:1e-4: loguniform takes two numbers, loguniform:LO:HI"),
        (["recipe.lr"], {}, "--space takes KEY=KIND:ARGS"),
        (["recipe.lr=gauss:0:1"], {}, "unknown kind 'gauss'"),
        (["recipe.lr=loguniform:0:1"], {}, "a log scale needs a low end above 0"),
        (["recipe.lr=uniform:1:0.5"], {}, "the low end must be below the high end"),
        (["recipe.lrr=loguniform:1e-4:1e-1"], {}, "recipe 'digits' has no option 'lrr' (did you mean recipe.lr?)"),
        (["trainer.lr=loguniform:1e-4:1e-1"], {}, "trainer has no setting 'lr' (recipe 'digits' has it: recipe.lr"),
        (["optim.lr=loguniform:1e-4:1e-1"], {}, "unknown section 'optim'"),
        (["trainer.global_batch_size=uniform:16:64"], {}, "with trainer.global_batch_size=16.0: global_batch_size must be a whole number"),
        (["trainer.strategy=choice:ddp,zero9"], {}, "with trainer.strategy=zero9: unknown strategy 'zero9'"),
        (["trainer.out=choice:a,b"], {}, "the search sets trainer.out itself"),
        (["recipe.lr=choice:0.1"], {"metric": "val_los"}, "--metric 'val_los' is not a value the runs log (did you mean 'val_loss'?)"),
        (["recipe.lr=choice:0.1"], {"metric": "val_f2"}, "is not a value the runs log"),
        (["recipe.lr=choice:0.1"], {"metric": "lr"}, "--metric lr: say whether to --direction minimize or maximize it"),
        (["recipe.lr=choice:0.1"], {"settings": ["trainer.nproc=0"]}, "nproc must be a whole number >= 1"),
        (["recipe.lr=choice:0.1"], {"parallel": 0}, "--parallel must be a whole number >= 1"),
        (["recipe.lr=uniform:0.1:0.2"], {"sampler": "grid"}, "--sampler grid needs choices or whole-number ranges"),
        (["recipe.lr=choice:0.1"], {"recipe": None, "model": "mine:model"}, "your own model needs --data as well"),
        (["recipe.lr=choice:0.1"], {"recipe": None, "model": "mine:model", "data": "mine:data"}, "recipe.NAME is a built-in recipe's option; for your own"),
    ],
)
def test_mistakes_are_one_line_before_any_trial_starts(tmp_path, space, kwargs, message):
    out = tmp_path / "hp"
    with pytest.raises(ConfigError) as exc:
        search_hparams(space, **{"recipe": "digits", "out": str(out), "echo": False, **kwargs})
    assert message in str(exc.value) and "\n" not in str(exc.value)
    assert not out.exists()


def test_an_earlier_search_is_kept(tmp_path):
    (tmp_path / "trial-0000").mkdir()
    with pytest.raises(ConfigError, match="holds an earlier search .1 trials.; pass --overwrite"):
        search_hparams(["recipe.lr=choice:0.1"], recipe="digits", out=str(tmp_path), echo=False)


def test_without_optuna_the_error_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(ConfigError, match=r"^shardwise tune hparams needs Optuna: pip install torch==2.13.0 'shardwise\[tune\]'$"):
        search_hparams(["recipe.lr=choice:0.1"], recipe="digits", echo=False)


@pytest.mark.e2e
def test_the_command_line_refuses_a_bad_space_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "shardwise", "tune", "hparams", "--recipe", "digits", "--space", "recipe.lr=loguniform:1e-4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "shardwise: error: --space recipe.lr=loguniform:1e-4: loguniform takes two numbers, loguniform:LO:HI (e.g. loguniform:1e-4:1e-1); got '1e-4'"
    ]


def test_space_values_go_to_the_runs_as_set_reads_them(monkeypatch):
    space = parse_space({"trainer.precision": ["32", "bf16-mixed"], "recipe.lr": "loguniform:1e-5:1e-1", "trainer.accumulate": "logint:1:8"})
    assert space["trainer.precision"].choices == ("32", "bf16-mixed") and space["trainer.accumulate"].edges() == [1, 8]
    for value in ("32", "bf16-mixed", 1e-05, 0.1, 3, True, "a,b", "two words"):
        assert parse_value(format_value(value)) == value and type(parse_value(format_value(value))) is type(value)
    assert hparam("lr", 0.5) == 0.5
    monkeypatch.setenv("SHARDWISE_HPARAMS", json.dumps({"lr": 0.25}))
    assert hparam("lr", 0.5) == 0.25


def test_overwrite_moves_the_earlier_search_aside_and_a_failed_run_is_told_by_its_error_line(tmp_path):
    from shardwise.tools.tune.hparams import _prepare_out
    from shardwise.tools.tune.trial import error_line

    (tmp_path / "trial-0000").mkdir()
    (tmp_path / "search.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    assert _prepare_out(tmp_path, overwrite=True) == tmp_path
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("replaced-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["search.json", "trial-0000"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([aside[0].name, "notes.txt"])  # nothing else moved or lost
    log = tmp_path / "output.log"
    log.write_text("step 5 train_loss 2.3\nshardwise: a worker failed:\n  rank 1: ValueError: bad shape\n  more\n")
    assert error_line(log, 1) == f"exit 1: shardwise: a worker failed: rank 1: ValueError: bad shape (whole output: {log})"
    log.write_text("Traceback (most recent call last):\nMemoryError\n")
    assert error_line(log, -9) == f"killed by signal 9: MemoryError (whole output: {log})"


@pytest.mark.parametrize("kind", ["random", "tpe", "grid"])
def test_the_seed_gives_the_same_values_at_any_parallel(kind):
    """The values that do not depend on which trials have finished (the random ones, TPE's first
    trials, a grid's order) are the seed's, whether the trials run one or three at a time, with
    threads finishing in any order (Optuna alone reseeds its sampler for each trial when n_jobs > 1)."""
    import random
    import time

    import optuna

    from shardwise.tools.tune.hparams import InOrder, _sampler

    dims = parse_space(["recipe.lr=loguniform:1e-4:1", "trainer.global_batch_size=choice:16,32,64", "recipe.hidden=int:8:64"])
    if kind == "grid":
        dims = parse_space(["trainer.global_batch_size=choice:16,32,64", "recipe.hidden=choice:8,16"])
    trials, jitter = 6, random.Random()

    def values(parallel: int) -> list[dict]:
        study, order = optuna.create_study(sampler=_sampler(kind, dims, trials, seed=7)), InOrder()

        def objective(trial):
            time.sleep(jitter.random() * 0.01)
            params = order.suggest(trial, dims)
            time.sleep(jitter.random() * 0.02)
            return float(len(str(params)))

        study.optimize(objective, n_trials=trials, n_jobs=parallel)
        return [t.params for t in sorted(study.trials, key=lambda t: t.number)]

    first = values(1)
    startup = trials if kind != "tpe" else 2  # TPE's random first trials: max(2, 6 // 3)
    assert values(3)[:startup] == first[:startup] and values(3)[:startup] == first[:startup]
    assert len({json.dumps(p, sort_keys=True) for p in first}) == len(first)  # and they are not all one value
