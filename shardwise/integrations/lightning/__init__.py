"""Lightning-style modules in the `Trainer`: a module written for Lightning's API trains as it is.

A module that defines both ``training_step`` and ``configure_optimizers`` is taken as a LightningModule
(duck typing: Lightning is never imported). Write it as for Lightning, with `LightningModule` from here
as the base class (or a real ``lightning.LightningModule``)::

    from shardwise import Trainer
    from shardwise.integrations.lightning import LightningModule

    class Classifier(LightningModule):
        def training_step(self, batch, batch_idx):
            loss = F.cross_entropy(self(batch[0]), batch[1])
            self.log("train_loss", loss, prog_bar=True)
            return loss
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    Trainer(strategy="ddp", nproc=2, max_epochs=3, out="runs/lit").fit(Classifier(), train_set)

Importing this package registers its adapter with the Trainer (`shardwise.trainer.adapters`;
``from shardwise import Trainer`` imports it). What is supported, where each logged value goes, and
what is refused before any process starts: docs/integrations.md, "Lightning".
"""

from shardwise.integrations.lightning.adapter import LightningAdapter, adapter_for
from shardwise.integrations.lightning.api import (
    SUPPORTED_HOOKS,
    UNSUPPORTED,
    LightningModule,
    Schedule,
    SchedulerConfig,
    TrainerView,
    check_module,
    is_lightning_module,
    parse_optimizers,
)

__all__ = [
    "SUPPORTED_HOOKS",
    "UNSUPPORTED",
    "LightningAdapter",
    "LightningModule",
    "Schedule",
    "SchedulerConfig",
    "TrainerView",
    "adapter_for",
    "check_module",
    "is_lightning_module",
    "parse_optimizers",
]
