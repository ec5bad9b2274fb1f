"""What the console shows at default verbosity, and the detail `-v` (logging.verbose) adds.

Detail lines (every weight version a sampler fetches and installs, every checkpoint, every stale drop) go to loggers
under grpo_stream.detail, which setup_logging lets through only with logging.verbose (or at DEBUG level). The rest
of the console is periodic summaries, so a run of thousands of versions prints a few hundred lines.
"""

from __future__ import annotations

import logging

DETAIL_ROOT = "grpo_stream.detail"


def detail_logger(name: str) -> logging.Logger:
    """The logger for `name`'s detail lines (log them at INFO)."""
    return logging.getLogger(f"{DETAIL_ROOT}.{name}")


def show_detail(verbose: bool, level: str) -> None:
    logging.getLogger(DETAIL_ROOT).setLevel(logging.NOTSET if verbose or level == "DEBUG" else logging.WARNING)


def count_and_range(values: list[int]) -> str:
    """'57 (0..400)' for a list of versions; '0' when empty. A list of hundreds of numbers helps nobody on a console."""
    if not values:
        return "0"
    return f"{len(values)} ({min(values)}..{max(values)})" if len(values) > 1 else f"1 ({values[0]})"
