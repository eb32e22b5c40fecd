"""tfops.parallel (issue 42): the mesh's layout arithmetic here; the layers under mpirun
(tests/mpi/tensor_check.py at -np 2 and 4, in tests/test_tf_parallel_scripts.py's launches)."""
import pytest

pytest.importorskip("tensorflow")
from tfops.parallel.mesh import groups  # noqa: E402


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
