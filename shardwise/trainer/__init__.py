"""Layer 5: the Trainer and its configuration."""

from shardwise.data.batches import model_inputs
from shardwise.trainer.config import TrainerConfig
from shardwise.trainer.loop import Trainer, batch_size_of, make_step_fn
from shardwise.trainer.lr_find import LRFindResult, lr_find

__all__ = ["LRFindResult", "Trainer", "TrainerConfig", "batch_size_of", "lr_find", "make_step_fn", "model_inputs"]
