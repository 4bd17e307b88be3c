"""The embedded default: ``dare quickstart`` (tiny LLaDA learns 4x4 Sudoku on CPU, RL helps) and ``dare compare``
(every registered RL algorithm on the same task). See docs/quickstart.md and docs/comparison.md."""
from .assets import ASSET_ROOT, ShippedCheckpoint, checkpoint_for_family, get_checkpoint, recipe_path, shipped_checkpoints

__all__ = ["ASSET_ROOT", "ShippedCheckpoint", "checkpoint_for_family", "get_checkpoint", "recipe_path",
           "shipped_checkpoints", "run_quickstart", "QuickstartOptions", "run_compare", "CompareOptions"]


def __getattr__(name):  # the pipelines import the trainer; load them only when asked
    if name in ("run_quickstart", "QuickstartOptions"):
        from . import pipeline
        return getattr(pipeline, name)
    if name in ("run_compare", "CompareOptions"):
        from . import compare
        return getattr(compare, name)
    raise AttributeError(name)
