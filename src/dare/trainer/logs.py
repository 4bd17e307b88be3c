"""Training logs: JSON lines (the record of truth), TensorBoard and wandb (optional, offline-safe), and a PNG of
the training curves written next to every checkpoint."""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

# Curves drawn in the PNG, in this order, when they were logged.
PLOTTED = ("loss", "reward_mean", "kl", "clip_frac", "entropy", "grad_norm", "lr", "step_time")


def read_metrics(path: Path) -> list[dict]:
    """The JSON lines of ``path``; a line that is not JSON (cut by a kill -9) or not even UTF-8 (a damaged file) is
    left out, the second with a warning naming the line, instead of stopping a resume with a codec error."""
    if not Path(path).exists():
        return []
    out = []
    for number, raw in enumerate(Path(path).read_bytes().splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            log.warning("%s, line %d: not UTF-8 text (a damaged file?); left out", path, number)
            continue
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill -9: ignore it
                continue
    return out


class MetricsLogger:
    """Rank 0 writes; other ranks hold a disabled logger."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True, wandb: bool = False,
                 wandb_project: str = "dare", run_config: Optional[dict] = None):
        self.run_dir, self.enabled = Path(run_dir), enabled
        self.path = self.run_dir / "metrics.jsonl"
        self.tb = self.wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                log.warning("tensorboard is not installed; logging to metrics.jsonl only (pip install tensorboard)")
        if wandb:
            try:
                import wandb as wandb_lib
                os.environ.setdefault("WANDB_MODE", "offline")  # never block a run on the network
                self.wandb = wandb_lib.init(project=wandb_project, dir=str(self.run_dir), config=run_config or {})
            except Exception as e:  # not installed, or no credentials: keep training
                log.warning("wandb unavailable (%s); continuing without it", e)

    def truncate_after(self, step: int) -> None:
        """Resuming from ``step``: drop lines of steps the killed run logged after its last checkpoint."""
        if not self.enabled or not self.path.exists():
            return
        from ..files import write_text
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))  # a reader never sees it half written

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        rec = {"step": step, **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, float) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(rec, step=step)

    def plot(self, out: Optional[Path] = None) -> Optional[Path]:
        """Write the training curves to ``training_curves.png`` (matplotlib, Agg backend)."""
        if not self.enabled:
            return None
        rows = read_metrics(self.path)
        keys = [k for k in PLOTTED if any(k in r for r in rows)]
        keys += sorted({k for r in rows for k in r if k.startswith("eval/")})
        if not keys:
            return None
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        cols = min(3, len(keys))
        nrows = -(-len(keys) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.0 * nrows), squeeze=False)
        for ax, k in zip(axes.flat, keys):
            pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2)
            ax.set_title(k)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(keys):]:
            ax.axis("off")
        fig.tight_layout()
        from ..files import write_file
        out = Path(out or self.run_dir / "training_curves.png")
        try:
            write_file(out, lambda tmp: fig.savefig(tmp, dpi=90))  # swapped in whole: a viewer never reads half a PNG
        except OSError as e:  # a full disk: the curves are a convenience (metrics.jsonl holds the numbers)
            log.warning("could not write %s (%s); the training curves are in %s", out,
                        os.strerror(e.errno) if e.errno else e, self.path)
            return None
        finally:
            plt.close(fig)
        return out

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
