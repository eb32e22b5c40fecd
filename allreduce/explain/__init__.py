"""See an algorithm work: run its real code on thread ranks and print every step.

``allreduce-explain ring --ranks 4 --count 8`` (or ``python -m allreduce.explain``)
prints, for each step the algorithm marks, which rank sends which chunk to
which rank and what every rank's buffer then holds, in symbols: ``a1+c1`` is
chunk 1 summed over ranks 0 and 2. Then the totals, and the alpha-beta-gamma
cost evaluated with them. ``--png``/``--svg`` draw the same as a grid.

Modules: :mod:`.recorder` (the recording transport), :mod:`.symbolic` (the
bitmask run, cut into steps), :mod:`.text` (the printout), :mod:`.draw`
(the figure).
"""
from .symbolic import Trace, explain, letters

__all__ = ["explain", "Trace", "letters"]
