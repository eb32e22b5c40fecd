"""The MPI transport's shared-memory mailboxes for small swaps (allreduce/transport/mailbox.py)."""
import pytest

from allreduce.config import Config, _btl_shares_memory

from .harness import mpirun


def test_open_mpi_btl_selection_decides_whether_ranks_may_share_memory():
    assert _btl_shares_memory("")
    assert _btl_shares_memory("sm,self") and _btl_shares_memory("self,vader,tcp")
    assert not _btl_shares_memory("tcp,self")
    assert not _btl_shares_memory("^sm") and _btl_shares_memory("^tcp")


def test_the_setting_follows_the_environment_and_the_btl():
    assert Config.from_env({}).shm_p2p is True
    assert Config.from_env({"ALLREDUCE_SHM_P2P": "0"}).shm_p2p is False
    assert Config.from_env({"OMPI_MCA_btl": "tcp,self"}).shm_p2p is False       # stands in for nodes
    assert Config.from_env({"OMPI_MCA_btl": "tcp,self", "ALLREDUCE_SHM_P2P": "1"}).shm_p2p is True


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_exchanges_of_every_size_through_both_channels_arrive_exactly(np_):
    out = mpirun(np_, "mailbox_check.py", timeout=240).stdout
    assert f"OK mailbox_check on {np_} ranks:" in out, out[-2000:]


@pytest.mark.mpi
@pytest.mark.parametrize("env", [{"ALLREDUCE_SHM_P2P": "0"}, {"OMPI_MCA_btl": "tcp,self"},
                                 {"ALLREDUCE_FAKE_NODE_SIZE": "1"}])
def test_no_mailbox_where_turned_off_or_standing_in_for_several_nodes(env):
    out = mpirun(2, "mailbox_check.py", "--expect-off", timeout=120, env=env).stdout
    assert "OK mailbox_check on 2 ranks (off)" in out, out[-2000:]
