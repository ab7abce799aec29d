"""The on-node environment: ``python -m hpc_train env --json`` over a table of node lists and task
layouts, the rendezvous port's properties, and the errors that teach.

Every case runs the real command in a subprocess whose environment is built from scratch (no
Slurm or torchrun variable leaks in from the machine running the tests). The pure function
:func:`hpc_train.node.environment.derive` is also tested directly where many cases are needed.

Slurm facts behind the cases (checked on Slurm 22.05.8, ``sbatch -N2 -n4`` on a real cluster):
the batch script sees ``SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 SLURM_NTASKS=4
SLURM_TASKS_PER_NODE=3,1`` and NO ``SLURM_STEP_ID``; each srun task sees ``SLURM_STEP_ID=0`` and
``SLURM_STEP_NODELIST``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_TASKS_PER_NODE`` as well.
"""

from __future__ import annotations

import json

import pytest

from hpc_train.node.environment import PORT_BASE, PORT_SPAN, derive
from hpc_train.errors import UsageError


def srun_task(nodelist: str, ntasks: int, tasks_per_node: str, rank: int, local: int, node: int,
              job: str = "4242", **extra: str) -> dict[str, str]:
    """The variables a task started by srun sees (as observed on Slurm 22.05)."""
    return {"SLURM_JOB_ID": job, "SLURM_JOBID": job, "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
            "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist,
            "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks),
            "SLURM_TASKS_PER_NODE": tasks_per_node, "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node), **extra}


def slurm_expect(hosts: list[str], rank: int, local: int, world: int, local_world: int, node: int,
                 job: str = "4242", **extra) -> dict:
    return {"source": "slurm", "hosts": hosts, "master_addr": hosts[0], "rank": rank, "local_rank": local,
            "world_size": world, "local_world_size": local_world, "node_rank": node, "num_nodes": len(hosts),
            "job_id": job, "master_port": PORT_BASE + int(job) % PORT_SPAN, **extra}


COMPUTE = [f"compute-b24-{i}" for i in (1, 2, 3, 5, 6, 7, 8, 9)] + [f"compute-b25-{i}" for i in (1, 4, 8)]

# (id, environment, expected subset of the JSON record)
CASES = [
    ("plain-process", {},
     {"source": "single", "rank": 0, "local_rank": 0, "world_size": 1, "local_world_size": 1, "node_rank": 0,
      "num_nodes": 1, "master_addr": "127.0.0.1", "master_port": 29500, "hosts": ["localhost"], "job_id": None,
      "restart_count": 0, "array_job_id": None, "array_task_id": None, "requeue_target": None}),
    ("node[1-2]-rank1", srun_task("node[1-2]", 2, "1(x2)", rank=1, local=0, node=1),
     slurm_expect(["node1", "node2"], rank=1, local=0, world=2, local_world=1, node=1)),
    ("gpu[001-004,010]-last", srun_task("gpu[001-004,010]", 5, "1(x5)", rank=4, local=0, node=4),
     slurm_expect(["gpu001", "gpu002", "gpu003", "gpu004", "gpu010"], rank=4, local=0, world=5, local_world=1,
                  node=4)),
    ("two-prefixes-bracket-groups",
     srun_task("compute-b24-[1-3,5-9],compute-b25-[1,4,8]", 11, "1(x11)", rank=9, local=0, node=9),
     slurm_expect(COMPUTE, rank=9, local=0, world=11, local_world=1, node=9)),
    ("plain-names-alpha,beta", srun_task("alpha,beta", 2, "1(x2)", rank=0, local=0, node=0),
     slurm_expect(["alpha", "beta"], rank=0, local=0, world=2, local_world=1, node=0)),
    ("plain-names-three", srun_task("alpha,beta,gamma", 3, "1(x3)", rank=2, local=0, node=2),
     slurm_expect(["alpha", "beta", "gamma"], rank=2, local=0, world=3, local_world=1, node=2)),
    ("two-ranges-in-one-name", srun_task("rack[1-2]-n[01-02]", 4, "1(x4)", rank=3, local=0, node=3),
     slurm_expect(["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"], rank=3, local=0, world=4,
                  local_world=1, node=3)),
    ("2-nodes-x-4-tasks-rank5", srun_task("node[1-2]", 8, "4(x2)", rank=5, local=1, node=1),
     slurm_expect(["node1", "node2"], rank=5, local=1, world=8, local_world=4, node=1)),
    ("2-nodes-x-4-tasks-rank0", srun_task("node[1-2]", 8, "4(x2)", rank=0, local=0, node=0),
     slurm_expect(["node1", "node2"], rank=0, local=0, world=8, local_world=4, node=0)),
    ("heterogeneous-2(x2),1-last-node", srun_task("n[1-3]", 5, "2(x2),1", rank=4, local=0, node=2),
     slurm_expect(["n1", "n2", "n3"], rank=4, local=0, world=5, local_world=1, node=2)),
    ("heterogeneous-2(x2),1-middle", srun_task("n[1-3]", 5, "2(x2),1", rank=3, local=1, node=1),
     slurm_expect(["n1", "n2", "n3"], rank=3, local=1, world=5, local_world=2, node=1)),
    ("observed-3,1-layout", srun_task("node[1-2]", 4, "3,1", rank=3, local=0, node=1),
     slurm_expect(["node1", "node2"], rank=3, local=0, world=4, local_world=1, node=1)),
    ("step-on-a-subset-of-the-job",
     {**srun_task("node[3-4]", 2, "1(x2)", rank=1, local=0, node=1), "SLURM_JOB_NODELIST": "node[1-4]",
      "SLURM_NODELIST": "node[1-4]", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "1(x4)"},
     slurm_expect(["node3", "node4"], rank=1, local=0, world=2, local_world=1, node=1)),
    ("array-task-requeued",
     srun_task("node[1-2]", 2, "1(x2)", rank=0, local=0, node=0, job="107", SLURM_ARRAY_JOB_ID="100",
               SLURM_ARRAY_TASK_ID="7", SLURM_RESTART_COUNT="2", SLURMD_NODENAME="node1"),
     slurm_expect(["node1", "node2"], rank=0, local=0, world=2, local_world=1, node=0, job="107",
                  array_job_id="100", array_task_id="7", restart_count=2, requeue_target="100_7",
                  node_name="node1")),
    ("plain-job-requeue-target", srun_task("node1", 1, "1", rank=0, local=0, node=0, job="55"),
     slurm_expect(["node1"], rank=0, local=0, world=1, local_world=1, node=0, job="55", requeue_target="55",
                  restart_count=0)),
    ("reserved-ports", srun_task("node[1-2]", 2, "1(x2)", rank=1, local=0, node=1,
                                 SLURM_STEP_RESV_PORTS="12000-12003"),
     {**slurm_expect(["node1", "node2"], rank=1, local=0, world=2, local_world=1, node=1), "master_port": 12000}),
    ("master-port-and-addr-override",
     srun_task("node[1-2]", 2, "1(x2)", rank=1, local=0, node=1, MASTER_PORT="31337",
               MASTER_ADDR="node1-ib.cluster", SLURM_STEP_RESV_PORTS="12000-12003"),
     {**slurm_expect(["node1", "node2"], rank=1, local=0, world=2, local_world=1, node=1),
      "master_port": 31337, "master_addr": "node1-ib.cluster"}),
    ("torchrun", {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                  "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29400", "TORCHELASTIC_RESTART_COUNT": "1"},
     {"source": "torchrun", "rank": 3, "local_rank": 1, "world_size": 4, "local_world_size": 2, "node_rank": 1,
      "num_nodes": 2, "master_addr": "10.0.0.5", "master_port": 29400, "restart_count": 1, "job_id": None}),
    ("torchrun-per-node-in-slurm",
     {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
      "MASTER_ADDR": "node1", "MASTER_PORT": "29400", "SLURM_JOB_ID": "88", "SLURM_JOB_NODELIST": "node[1-2]",
      "SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_RESTART_COUNT": "3"},
     {"source": "torchrun", "rank": 2, "local_rank": 0, "world_size": 4, "local_world_size": 2, "node_rank": 1,
      "num_nodes": 2, "hosts": ["node1", "node2"], "master_addr": "node1", "master_port": 29400,
      "job_id": "88", "restart_count": 3}),
    ("local-launcher", {"HPC_TRAIN_LAUNCHER": "local", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                        "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "45678"},
     {"source": "local", "rank": 1, "local_rank": 1, "world_size": 2, "local_world_size": 2, "node_rank": 0,
      "num_nodes": 1, "master_addr": "127.0.0.1", "master_port": 45678, "hosts": ["127.0.0.1"]}),
    ("batch-script-of-one-task",
     {"SLURM_JOB_ID": "901", "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
      "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "node2", "SLURMD_NODENAME": "node2"},
     {"source": "single", "rank": 0, "world_size": 1, "job_id": "901", "hosts": ["node2"],
      "master_port": PORT_BASE + 901, "node_name": "node2"}),
    ("batch-step-id-of-old-slurm",
     {"SLURM_JOB_ID": "902", "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_STEP_ID": "4294967294",
      "SLURM_JOB_NODELIST": "node1"},
     {"source": "single", "rank": 0, "world_size": 1, "job_id": "902"}),
]


@pytest.mark.parametrize("env,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_env_json(run_cli, clean_env, env, expected):
    r = run_cli("env", "--json", env=clean_env(**env))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert {k: got.get(k) for k in expected} == expected
    # The record is self-consistent whatever the source.
    assert 0 <= got["rank"] < got["world_size"] and 0 <= got["local_rank"] < got["local_world_size"]
    assert 0 <= got["node_rank"] < got["num_nodes"] and 1024 <= got["master_port"] <= 65535


def test_env_text_output_names_every_field(run_cli, clean_env):
    r = run_cli("env", env=clean_env(**srun_task("node[1-2]", 8, "4(x2)", rank=5, local=1, node=1)))
    assert r.returncode == 0, r.stderr
    fields = dict(line.split(None, 1) for line in r.stdout.splitlines())
    assert fields["rank"] == "5" and fields["hosts"] == "node1,node2" and fields["master_addr"] == "node1"
    assert fields["requeue_target"] == "4242"


# -- the rendezvous port ----------------------------------------------------------------------------
def test_port_is_the_same_on_every_rank_of_a_job(run_cli, clean_env):
    envs = [srun_task("node[1-2]", 8, "4(x2)", rank=r, local=r % 4, node=r // 4, job="31337") for r in range(8)]
    ports = {derive(e).master_port for e in envs}
    assert len(ports) == 1
    # What the command prints agrees, on the first rank and on the last.
    printed = {json.loads(run_cli("env", "--json", env=clean_env(**e)).stdout)["master_port"]
               for e in (envs[0], envs[-1])}
    assert printed == ports


def test_port_differs_between_jobs_and_stays_in_range():
    ids = list(range(1, 5001)) + [39999, 40000, 40001, 123456789, 4294967290]
    ports = [derive(srun_task("node[1-2]", 2, "1(x2)", rank=0, local=0, node=0, job=str(j))).master_port
             for j in ids]
    assert len(set(ports[:5000])) == 5000, "consecutive job ids must get different ports"
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert PORT_BASE >= 1024 and PORT_BASE + PORT_SPAN - 1 <= 59999
    # Non-numeric ids (never seen from Slurm) still give a derived port in range, and different ones.
    odd = {derive(srun_task("n1", 1, "1", rank=0, local=0, node=0, job=j)).master_port for j in ("a1", "b2", "c3")}
    assert len(odd) == 3 and all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in odd)


def test_two_array_tasks_of_one_array_get_different_ports(run_cli, clean_env):
    """Two tasks of array 500 on the same node: each has its own SLURM_JOB_ID (500, 501)."""
    ports = []
    for job, task in (("500", "0"), ("501", "1")):
        env = srun_task("node1", 1, "1", rank=0, local=0, node=0, job=job, SLURM_ARRAY_JOB_ID="500",
                        SLURM_ARRAY_TASK_ID=task)
        r = run_cli("env", "--json", env=clean_env(**env))
        rec = json.loads(r.stdout)
        assert rec["requeue_target"] == f"500_{task}"
        ports.append(rec["master_port"])
    assert ports[0] != ports[1]


def test_master_port_overrides_everywhere():
    for env in ({}, srun_task("node[1-2]", 2, "1(x2)", rank=1, local=0, node=1, SLURM_STEP_RESV_PORTS="12000"),
                {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}):
        assert derive({**env, "MASTER_PORT": "23456"}).master_port == 23456


def test_reserved_ports_win_over_the_derived_port():
    base = srun_task("node[1-2]", 2, "1(x2)", rank=0, local=0, node=0, job="77")
    assert derive(base).master_port == PORT_BASE + 77
    assert derive({**base, "SLURM_STEP_RESV_PORTS": "12000-12003"}).master_port == 12000
    assert derive({**base, "SLURM_STEP_RESV_PORTS": "15001"}).master_port == 15001


# -- derive() directly ------------------------------------------------------------------------------
def test_derive_is_pure_and_frozen():
    env = srun_task("gpu[001-002]", 4, "2(x2)", rank=3, local=1, node=1)
    snapshot = dict(env)
    a, b = derive(env), derive(env)
    assert a == b and env == snapshot
    with pytest.raises(AttributeError):
        a.rank = 0  # type: ignore[misc]
    assert a.hosts == ("gpu001", "gpu002") and not a.is_main and derive({}).is_main


def test_derive_local_launcher_beats_stale_slurm_variables():
    env = {**srun_task("node[1-2]", 8, "4(x2)", rank=5, local=1, node=1), "HPC_TRAIN_LAUNCHER": "local",
           "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "40000"}
    e = derive(env)
    assert (e.source, e.rank, e.world_size, e.master_port) == ("local", 0, 2, 40000)


def task(**over) -> dict[str, str]:
    """A valid srun task (rank 0 of 2 on node[1-2]) with some variables replaced."""
    return {**srun_task("node[1-2]", 2, "1(x2)", rank=0, local=0, node=0), **over}


# Each case: the message names the variable, the value it refuses and what would be valid.
@pytest.mark.parametrize("env,needle", [
    ({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, "srun"),
    ({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "4294967294", "SLURM_PROCID": "0"}, "srun"),
    (srun_task("node[1-", 2, "1(x2)", rank=0, local=0, node=0), "node list"),
    (srun_task("node[3-1]", 2, "1(x2)", rank=0, local=0, node=0), "node list"),
    (srun_task("node[1-2]", 2, "two", rank=0, local=0, node=0), ("SLURM_STEP_TASKS_PER_NODE='two'", "N(xK)")),
    (srun_task("node[1-2]", 2, "1(x2)", rank=2, local=0, node=1), "SLURM_PROCID"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK"),
    ({"MASTER_PORT": "80"}, "MASTER_PORT"),
    ({"MASTER_PORT": "abc"}, "MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT"),
    # A repeat count or a task count of 0 left an empty list (IndexError), a huge repeat count
    # allocated one entry per node.
    (task(SLURM_STEP_TASKS_PER_NODE="2(x0)"), ("SLURM_STEP_TASKS_PER_NODE='2(x0)'", "K >= 1", "2(x3),1")),
    (task(SLURM_STEP_TASKS_PER_NODE="", SLURM_TASKS_PER_NODE="2(x0)"), ("SLURM_TASKS_PER_NODE='2(x0)'", "K >= 1")),
    (task(SLURM_STEP_TASKS_PER_NODE="0,2"), ("SLURM_STEP_TASKS_PER_NODE='0,2'", "N and K >= 1")),
    (task(SLURM_STEP_TASKS_PER_NODE="1(x999999999)"), ("'1(x999999999)'", "more than 1000000 nodes")),
    (task(SLURM_STEP_TASKS_PER_NODE="１(x2)"), ("'１(x2)'", "N(xK)")),
    # A negative node id indexed the task counts from the end and was reported as node_rank -1.
    (task(SLURM_NODEID="-1"), ("SLURM_NODEID='-1'", "from 0 to")),
    (task(SLURM_PROCID="x"), ("SLURM_PROCID='x'", "integer from 0 to")),
    # int() reads '1_0' as 10 and '١' as 1; Slurm writes neither.
    (task(SLURM_PROCID="1_0"), ("SLURM_PROCID='1_0'", "integer from 0 to")),
    (task(SLURM_PROCID="١"), ("SLURM_PROCID='١'", "integer from 0 to")),
    (task(SLURM_PROCID="9" * 5000), ("SLURM_PROCID='999", "characters)", "integer from 0 to")),
    (task(SLURM_LOCALID="-1"), ("SLURM_LOCALID='-1'", "from 0 to")),
    (task(SLURM_RESTART_COUNT="-3"), ("SLURM_RESTART_COUNT='-3'", "from 0 to")),
    (task(SLURM_STEP_NUM_TASKS="", SLURM_NTASKS="two"), ("SLURM_NTASKS='two'", "integer")),
    ({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "x"}, ("SLURM_NTASKS='x'", "integer")),
    ({"RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "-1"}, ("GROUP_RANK='-1'", "from 0 to")),
    ({"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "x"}, ("TORCHELASTIC_RESTART_COUNT='x'",)),
    # ',' expands to no host at all: hosts[0] raised IndexError.
    (task(SLURM_STEP_NODELIST=","), ("node list ','", "names no host")),
    (task(SLURM_STEP_RESV_PORTS="99999-100000"), ("SLURM_STEP_RESV_PORTS='99999-100000'", "1-65535")),
], ids=["batch-not-srun", "old-batch-step-id", "unbalanced-brackets", "reversed-range", "bad-tasks-per-node",
        "rank-out-of-range", "torchrun-rank-out-of-range", "non-integer-rank", "privileged-port",
        "non-integer-port", "torchrun-port-out-of-range",
        "tasks-per-node-repeat-0", "job-tasks-per-node-repeat-0", "tasks-per-node-count-0",
        "tasks-per-node-huge-repeat", "tasks-per-node-fullwidth-digit", "negative-nodeid", "non-numeric-procid",
        "underscore-procid", "arabic-indic-procid", "5000-digit-procid", "negative-localid",
        "negative-restart-count", "non-numeric-ntasks", "batch-non-numeric-ntasks", "negative-group-rank",
        "non-numeric-torchelastic-restart-count", "node-list-of-no-host", "reserved-port-out-of-range"])
def test_derive_errors_teach(env, needle):
    with pytest.raises(UsageError, match="environment") as e:
        derive(env)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 300, msg
    for n in (needle,) if isinstance(needle, str) else needle:
        assert n in msg, msg


@pytest.mark.parametrize("job", ["²", "9" * 5000, "12a"], ids=["superscript-digit", "5000-digits", "alnum"])
def test_odd_job_ids_still_get_a_port(job):
    """'²'.isdigit() is true but int() refuses it; 5000 digits exceed int()'s limit. Both raised
    ValueError; any job id now gets a port in range."""
    port = derive(task(SLURM_JOB_ID=job, SLURM_JOBID=job)).master_port
    assert PORT_BASE <= port < PORT_BASE + PORT_SPAN


# -- errors through the command ---------------------------------------------------------------------
@pytest.mark.parametrize("env,needles", [
    ({"SLURM_JOB_ID": "12", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
      "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "3,1"}, ("srun", "4 tasks", "job 12")),
    (srun_task("node[1-", 2, "1(x2)", rank=0, local=0, node=0), ("node[1-", "node list")),
    (task(SLURM_STEP_TASKS_PER_NODE="2(x0)", SLURM_TASKS_PER_NODE="2(x0)"),
     ("SLURM_STEP_TASKS_PER_NODE='2(x0)'", "K >= 1")),
    (task(SLURM_NODEID="-1"), ("SLURM_NODEID='-1'", "from 0 to")),
    (task(SLURM_PROCID="zero"), ("SLURM_PROCID='zero'", "integer from 0 to")),
    (task(SLURM_STEP_NODELIST=","), ("node list ','",)),
], ids=["inside-allocation-without-srun", "malformed-node-list", "tasks-per-node-repeat-0", "negative-nodeid",
        "non-numeric-procid", "node-list-of-no-host"])
def test_env_command_errors(run_cli, clean_env, env, needles):
    r = run_cli("env", "--json", env=clean_env(**env))
    assert r.returncode == 2
    assert r.stdout == "" and "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and all(n in lines[0] for n in needles), r.stderr
