"""tfops.parallel (issue 42): the mesh's layout arithmetic here; the layers under mpirun
(tests/mpi/tensor_check.py, one launch per world size)."""
import pytest

pytest.importorskip("tensorflow")
from tfops.parallel.mesh import groups  # noqa: E402

from .harness import TF_ENV, mpirun  # noqa: E402


@pytest.mark.parametrize("tensor,data,pipeline", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 2, 2), (4, 1, 2), (1, 3, 2)])
def test_mesh_groups_tile_the_world_in_megatron_order(tensor, data, pipeline):
    size = tensor * data * pipeline
    for axis, n in (("tensor", tensor), ("data", data), ("pipeline", pipeline)):
        gs = groups(axis, tensor=tensor, data=data, pipeline=pipeline)
        assert sorted(r for g in gs for r in g) == list(range(size)), f"{axis} groups do not tile the world"
        assert all(len(g) == n for g in gs)
    for g in groups("tensor", tensor=tensor, data=data, pipeline=pipeline):   # tensor groups: consecutive
        assert g == list(range(g[0], g[0] + tensor))
    for r in range(size):                       # global = pipeline * (data * tensor) + data * tensor + tensor
        t, d, p = r % tensor, (r // tensor) % data, r // (tensor * data)
        assert [x for x in groups("data", tensor=tensor, data=data, pipeline=pipeline) if r in x][0] == \
            [p * data * tensor + i * tensor + t for i in range(data)]
        assert [x for x in groups("pipeline", tensor=tensor, data=data, pipeline=pipeline) if r in x][0] == \
            [i * data * tensor + d * tensor + t for i in range(pipeline)]


TIMEOUT = 900          # a launch: TF's import and tracing take minutes on a loaded 2-core machine


@pytest.mark.parametrize("np_", [2, 4])
def test_tensor_parallel_under_mpirun(np_):
    """tests/mpi/tensor_check.py (its docstring lists the checks): tensor 2 at -np 2; tensor 4 and
    tensor 2 x data 2 in one launch at -np 4 (tensor 4's checkpoint loaded at tensor 2)."""
    text = mpirun(np_, "tensor_check.py", timeout=TIMEOUT, env=TF_ENV).stdout
    for r in range(np_):
        assert f"rank {r}: tensor_check OK" in text, text[-3000:]
    meshes = ["tensor=2, data=1"] if np_ == 2 else ["tensor=4, data=1", "tensor=2, data=2"]
    for mesh in meshes:
        done = "regions, layers, per-rank init, model.fit, bad input, gpt, counts, memory, checkpoint"
        assert f"Mesh({mesh}, pipeline=1; this rank: tensor_rank=0, data_rank=0, pipeline_rank=0): {done}: OK" \
            in text, text[-3000:]
