"""Training stitch adapters (`kvstitch.models.stitch_adapter`): the data (`data`) and the run (`train`)."""

from .data import VALIDATION_ARTICLE, Context, document_contexts, squad_contexts, tuning_contexts
from .config import AdaptConfig
from .train import Trainer

__all__ = ["AdaptConfig", "Context", "Trainer", "VALIDATION_ARTICLE", "document_contexts", "squad_contexts",
           "tuning_contexts"]
