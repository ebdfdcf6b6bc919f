"""Orbax checkpoints of the trainer state and its plan, under ``workdir/checkpoints``."""
from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp


class Checkpoints:
  """Saves the trainer state (asynchronously) with JSON metadata each epoch.

  Args:
    workdir: the run's directory; checkpoints go to ``workdir/checkpoints``.
    keep: how many recent checkpoints to keep.
  """

  def __init__(self, workdir: str, keep: int = 2):
    self.directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Starts saving ``state`` (a layout-free tree, see
    :meth:`pipejax.trainer.Trainer.portable_state`) and ``meta`` as checkpoint
    ``step``."""
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)))

  def latest(self) -> str | None:
    """The directory of the newest finished checkpoint, or None."""
    self.manager.wait_until_finished()
    step = self.manager.latest_step()
    return None if step is None else os.path.join(self.directory, str(step))

  def close(self) -> None:
    """Waits for pending saves."""
    self.manager.wait_until_finished()
    self.manager.close()

