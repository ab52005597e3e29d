"""The legacy ``gpc`` members that have a meaning with data parallelism only: the processes on this node, the
neighbouring ranks of a group, the sanity check, and the two launch steps ``launch`` now does itself."""
import json
import textwrap

import pytest
from dist_helpers import clean_launch_context, run_ranks

import colossal_lite
from colossal_lite.context import ParallelMode
from colossal_lite.core import global_context as gpc


@pytest.fixture(autouse=True)
def clean_context(monkeypatch):
    yield from clean_launch_context(monkeypatch)


def test_before_launch_the_members_give_legacys_single_process_answers():
    assert gpc.num_processes_on_current_node == -1  # legacy's value before launch
    assert gpc.virtual_pipeline_parallel_size is None and gpc.virtual_pipeline_parallel_rank is None
    assert gpc.get_next_global_rank(ParallelMode.DATA) == gpc.get_prev_global_rank(ParallelMode.DATA) == 0
    gpc.check_sanity()
    with pytest.raises(RuntimeError, match=r"init_parallel_groups: no process group is running; call "
                                           r"colossal_lite.launch"):
        gpc.init_parallel_groups()
    with pytest.raises(RuntimeError, match=r"gpc.init_global_dist is not supported by colossal_lite: start the group "
                                           r"with colossal_lite.launch\(config, rank=0, world_size=2, "
                                           r"host='127.0.0.1', port=29500, backend='gloo'\)"):
        gpc.init_global_dist(0, 2, "gloo", "127.0.0.1", 29500)


def test_one_process_launch_counts_itself_on_the_node():
    colossal_lite.launch_from_torch(config={}, verbose=False)
    assert gpc.num_processes_on_current_node == 1
    gpc.init_parallel_groups()  # the groups exist with the launch: nothing to make
    with pytest.raises(RuntimeError, match="the process group is already running .* remove the call"):
        gpc.init_global_dist(0, 1, "gloo", "127.0.0.1", 29500)
    gpc.destroy()
    assert gpc.num_processes_on_current_node == -1


TWO_RANKS = textwrap.dedent("""
    import json
    import colossal_lite
    from colossal_lite.context import ParallelMode
    from colossal_lite.core import global_context as gpc
    colossal_lite.launch_from_torch(config={}, backend="gloo", verbose=False)
    gpc.check_sanity()
    gpc.init_parallel_groups()
    out = dict(rank=gpc.get_global_rank(), node=gpc.num_processes_on_current_node,
               data=[gpc.get_next_global_rank(ParallelMode.DATA), gpc.get_prev_global_rank(ParallelMode.DATA)],
               pipe=[gpc.get_next_global_rank(ParallelMode.PIPELINE), gpc.get_prev_global_rank(ParallelMode.PIPELINE)],
               pipe_ranks=gpc.get_ranks_in_group(ParallelMode.PIPELINE), world=gpc.get_world_size(ParallelMode.DATA))
    print("RESULT " + json.dumps(out) + "\\n", end="", flush=True)
    gpc.destroy()
""")


def test_two_ranks_neighbours_and_processes_on_the_node(tmp_path):
    script = tmp_path / "gpc_members.py"
    script.write_text(TWO_RANKS)
    out = run_ranks(script, nproc=2, timeout=180).stdout
    results = sorted((json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")),
                     key=lambda r: r["rank"])
    # the data group is both ranks, in a ring; a pipeline group is the rank alone (no pipeline parallelism)
    assert results == [dict(rank=0, node=2, data=[1, 1], pipe=[0, 0], pipe_ranks=[0], world=2),
                       dict(rank=1, node=2, data=[0, 0], pipe=[1, 1], pipe_ranks=[1], world=2)], out
