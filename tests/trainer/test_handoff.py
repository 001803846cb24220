"""`fit` hands its workers a fingerprint of the model, not the model (`shardwise.trainer.handoff`): a script that
fits the same model twice must continue from the trained weights the second time, although each worker's run of
the script stops at the first `fit` with a freshly built model (the fingerprint of values tells them apart)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import torch, shardwise, torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=torch.Generator().manual_seed(1)), torch.arange(32) % 2)
kw = dict(strategy="ddp", nproc=2, global_batch_size=8, max_steps=2, progress_bar=False, loss_fn=lambda o, b: F.cross_entropy(o, b[1]))
first = shardwise.Trainer(**kw).fit(model, data)["train_loss"]
second = shardwise.Trainer(**kw).fit(model, data)["train_loss"]
print("LOSSES", first, second)
"""


def test_a_second_fit_of_a_trained_model_continues_from_its_weights(tmp_path: Path) -> None:
    script = tmp_path / "twice.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = (float(v) for v in proc.stdout.split("LOSSES")[1].split())
    assert second < first, f"the second fit started again from the script's fresh model: losses {first} then {second}"


SWEEP = """
import torch, shardwise, torch.nn.functional as F
data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(1)), torch.arange(64) % 2)
kw = dict(strategy="ddp", nproc=2, global_batch_size=8, max_steps=4, progress_bar=False, loss_fn=lambda o, b: F.cross_entropy(o, b[1]))
class Net(torch.nn.Module):
    def __init__(self, p, act):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(p), torch.nn.Linear(32, 2))
        self.act = act  # a function: no fingerprint of values can see it
    def forward(self, x):
        return self.act(self.net(x))
for p, act in ((0.0, torch.tanh), (0.5, torch.tanh), (0.0, torch.sigmoid)):
    print("LOSS", p, shardwise.Trainer(**kw).fit(Net(p, act), data)["train_loss"])
"""


def test_a_sweep_of_equally_seeded_models_that_differ_in_a_setting_trains_each_setting(tmp_path: Path) -> None:
    """A sweep of equally seeded models: the second differs from the first only in ``Dropout.p``, the third only in
    its activation function. Each worker's run of the script stops at the first fit and builds that model; only
    the first fit may train it, later ones load the model the parent was given (before: the first one again,
    silently, wherever the weights' fingerprint matched)."""
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split()[2]) for line in proc.stdout.splitlines() if line.startswith("LOSS")]
    assert len(losses) == 3 and len(set(losses)) == 3, f"a later fit trained the first fit's model: losses {losses}"


def test_the_fingerprint_holds_plain_settings_and_configs() -> None:
    import torch

    from shardwise.trainer.handoff import fingerprint

    def seeded(p: float) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(p))

    assert fingerprint(seeded(0.1)) == fingerprint(seeded(0.1))
    assert fingerprint(seeded(0.1)) != fingerprint(seeded(0.2))
    transformers = __import__("pytest").importorskip("transformers")
    cfg = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    models = []
    for dropout in (0.0, 0.1):
        torch.manual_seed(0)
        models.append(transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attention_dropout=dropout)))
    assert fingerprint(models[0]) != fingerprint(models[1]), "a config flag that changes training must change the fingerprint"
