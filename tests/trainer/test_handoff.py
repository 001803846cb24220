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
