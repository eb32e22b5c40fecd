"""AutoGraph leaves tfops' own functions as they are, as it leaves TensorFlow's and Keras's.

Inside a ``tf.function``, AutoGraph rewrites every Python function that the traced code calls,
unless its module is on TensorFlow's list of libraries not to convert (``tensorflow``, ``keras``,
``numpy``, ...: ``tensorflow/python/autograph/core/config.py``). tfops was not on it, so the
first trace in each process re-parsed and re-wrote every tfops function that a step reached:
the collectives (``allreduce``, ``_allreduce``, ``_run``, ``numpy_call``, ...), the loss of
tfops.parallel, the helpers they call. Measured on examples/gpt.py's tensor-parallel step at
-np 2 (cProfile of the first call, rank 0): 37 conversions, 2.3 s of the trace's 5.6 s, each
process paying it once.

Converting them buys nothing. tfops' functions are written to run as they are both eagerly and
in a graph: they branch on Python values (shapes, ranks, settings) and build their graph ops with
``tf`` calls, never ``if`` or ``for`` on a symbolic tensor (the suite runs every one of them in a
``tf.function``; a tensor-valued ``if`` would raise there, not change behaviour quietly). So the
package is added to the same list, by the rule TensorFlow uses for its own modules. The user's
functions are converted as before: a step's own code, a loss passed in, and code that tfops
calls back (Keras layers are called unconverted by Keras itself, as always).

The list is a private module of TensorFlow's; if a TensorFlow release moves it, tfops imports
and runs as before, only its first trace is slower (:func:`leave_unconverted` returns False).
"""
from __future__ import annotations

PACKAGES = ("tfops",)


def leave_unconverted(packages: tuple[str, ...] = PACKAGES) -> bool:
    """Add ``packages`` to AutoGraph's do-not-convert rules (once); False where the list is not found."""
    try:
        from tensorflow.python.autograph.core import config
    except ImportError:                                   # pragma: no cover - a TensorFlow without it
        return False
    rules = getattr(config, "CONVERSION_RULES", None)
    if not isinstance(rules, tuple) or not hasattr(config, "DoNotConvert"):
        return False                                      # pragma: no cover
    have = {getattr(rule, "_prefix", None) for rule in rules}
    new = tuple(config.DoNotConvert(name) for name in packages if name not in have)
    config.CONVERSION_RULES = new + rules                 # first: checked before any Convert rule
    return True
