"""Ready-made hooks: checkpoints (more to come).

Combinators (``every``, ``on``, ...) live at the top level, ``fnloop.every``.
"""

from fnloop.hooks._checkpoint import Best, best_checkpoint, checkpoint

__all__ = ["Best", "best_checkpoint", "checkpoint"]
