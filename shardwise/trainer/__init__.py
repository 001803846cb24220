"""Layer 5: the Trainer and its configuration."""

from shardwise.batches import model_inputs
from shardwise.trainer.config import TrainerConfig
from shardwise.trainer.loop import Trainer, batch_size_of, make_step_fn

__all__ = ["Trainer", "TrainerConfig", "batch_size_of", "make_step_fn", "model_inputs"]
