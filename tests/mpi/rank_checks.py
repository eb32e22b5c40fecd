"""Helpers the rank scripts share (imported from the script's own folder)."""
import numpy as np

from allreduce.kernels.reference import allreduce_reference
from allreduce.ops import Op


def check_result(buf: np.ndarray, xs: list[np.ndarray], op: Op, me: int, what: str, abort) -> None:
    """``buf`` against the float64 reference of every rank's input ``xs``: bit for bit (small
    integers make every order of additions exact), or within 1e-2 for a float Average. On a miss,
    print the first wrong elements with ``what`` (the call) and call ``abort(1)``."""
    want = allreduce_reference(xs, op)
    if buf.dtype.kind == "f" and op == Op.AVERAGE:
        ok = np.allclose(buf.astype(np.float64), want.astype(np.float64), rtol=1e-2, atol=1e-2)
    else:
        ok = buf.tobytes() == want.tobytes()
    if not ok:
        bad = np.flatnonzero(buf != want)[:5]
        print(f"rank {me} {what} {buf.dtype} {op!r} wrong at {bad}: {buf[bad]} != {want[bad]}", flush=True)
        abort(1)
