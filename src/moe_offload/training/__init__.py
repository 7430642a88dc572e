"""Training of the learned parts of the project. PyTorch is optional: only the training functions
import it, the rest of the package (policies included) runs on NumPy."""

from moe_offload.training.learned_eviction import (BeladySamples, TrainingResult, TrainingSource,
                                                   collect_belady_samples, evaluate_policies, train_learned_eviction)

__all__ = ["BeladySamples", "TrainingResult", "TrainingSource", "collect_belady_samples", "evaluate_policies",
           "train_learned_eviction"]
