"""The embedded default: ``dare quickstart`` (tiny LLaDA learns 4x4 Sudoku on CPU, RL helps), its shipped
checkpoints and the stages it chains (which ``dare compare``, ``dare.comparison``, reuses). See docs/quickstart.md."""
from .assets import ASSET_ROOT, ShippedCheckpoint, checkpoint_for_family, get_checkpoint, recipe_path, shipped_checkpoints

__all__ = ["ASSET_ROOT", "ShippedCheckpoint", "checkpoint_for_family", "get_checkpoint", "recipe_path",
           "shipped_checkpoints", "run_quickstart", "QuickstartOptions"]


def __getattr__(name):  # the pipelines import the trainer; load them only when asked
    if name in ("run_quickstart", "QuickstartOptions"):
        from . import pipeline
        return getattr(pipeline, name)
    raise AttributeError(name)
