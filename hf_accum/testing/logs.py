"""Log lines a test reads back: what the fused loss decided for a run (its one line, ``fused linear
cross-entropy on (...)`` or ``... off, logits path for this run: <reason>``), in-process or in a worker."""

from __future__ import annotations

import logging

FUSED_LOSS_LOGGER = "hf_accum.fused.loss"


class CapturedLog(logging.Handler):
    """Every message of one logger from construction to :meth:`remove` (INFO and up)."""

    def __init__(self, name: str = FUSED_LOSS_LOGGER) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.logger = logging.getLogger(name)
        self.level_before = self.logger.level
        self.logger.addHandler(self)
        self.logger.setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def remove(self) -> list[str]:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)
        return self.lines


def fused_on(lines: list[str], engine: str = "") -> bool:
    """Whether the run's fused-loss line says it fused (inside ``engine``'s gathered head, when named)."""
    return any(line.startswith("fused linear cross-entropy on") and engine in line for line in lines)
