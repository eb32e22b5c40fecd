"""Schedules: pure functions that say, rank by rank, what runs in which order.

:mod:`.pipeline` holds the pipeline-parallel schedules (GPipe, 1F1B, interleaved 1F1B) and
:mod:`.grid` the simulator that lays them out in time slots. Neither imports TensorFlow or a
transport, so ``allreduce-explain pipeline`` prints the very lists that
``tfops.parallel.Pipeline`` executes (the runtime imports this package; nothing here imports up).
"""
from .grid import Grid, simulate
from .pipeline import SCHEDULES, Action, schedule, stage_actions

__all__ = ["Action", "Grid", "SCHEDULES", "schedule", "simulate", "stage_actions"]
