"""AutoGraph leaves tfops' functions unconverted (tfops/_autograph.py), and still converts the user's.

In this process, no MPI: the rule is in TensorFlow's list once, after any number of imports and
calls, and TensorFlow's own check (``conversion.is_allowlisted``, what ``converted_call`` asks
before rewriting a function) says tfops' collectives, training and parallel functions are left as
they are, and a function of this file is not.
"""
import pytest

tf = pytest.importorskip("tensorflow")

from tensorflow.python.autograph.core import config  # noqa: E402
from tensorflow.python.autograph.impl import conversion  # noqa: E402

import tfops  # noqa: E402
from tfops import _autograph, parallel  # noqa: E402
from tfops.collectives import ops  # noqa: E402


def test_tfops_is_on_autographs_do_not_convert_list_once():
    assert _autograph.leave_unconverted() and _autograph.leave_unconverted()
    prefixes = [getattr(rule, "_prefix", None) for rule in config.CONVERSION_RULES]
    assert prefixes.count("tfops") == 1
    rule = config.CONVERSION_RULES[prefixes.index("tfops")]
    assert isinstance(rule, config.DoNotConvert)


def users_step(x):
    if x > 0:        # a tensor-valued if: only AutoGraph's conversion makes this legal in a graph
        return x
    return -x


@pytest.mark.parametrize("fn", [tfops.allreduce, ops.allreduce, tfops.grouped_allreduce, tfops.allgather,
                                parallel.vocab_parallel_cross_entropy,
                                parallel.allreduce_sequence_parallel_gradients],
                         ids=lambda f: f"{f.__module__}.{f.__qualname__}")
def test_tfops_functions_are_left_unconverted(fn):
    assert conversion.is_allowlisted(fn)


def test_the_users_functions_are_still_converted():
    assert not conversion.is_allowlisted(users_step)
    step = tf.function(users_step)
    assert float(step(tf.constant(-2.0))) == 2.0 and float(step(tf.constant(3.0))) == 3.0
