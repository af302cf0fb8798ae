"""A torch-backend rank's place read from torchrun's, a site's or Slurm's variables, and the start-up mistakes
named before any wait (hpcdl.runtime.launch_env, hpcdl.runtime.rendezvous, hpcdl.runtime.world)."""

from __future__ import annotations

import socket
import time

import pytest

from hpcdl.runtime import launch_env, rendezvous, world
from hpcdl.runtime.errors import UsageError
from hpcdl.runtime.launch_env import Place, first_host, place_from_env, slurm_port

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def test_torchrun_ranks_meet_at_its_agents_store() -> None:
    assert place_from_env(TORCHRUN) == Place(1, 2, 1, 2, "127.0.0.1", 29400, True, "torchrun")


def test_a_sites_recipe_has_rank_0_start_the_store() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "8", "MASTER_ADDR": "login7", "MASTER_PORT": "3442"}
    assert place_from_env(env) == Place(0, 8, None, None, "login7", 3442, False, "WORLD_SIZE")


def test_plain_srun_meets_at_the_first_node_on_a_port_of_the_job() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "123456",
           "SLURM_STEP_ID": "2", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "4"}
    assert place_from_env(env) == Place(3, 4, 1, None, "gpu07", 20000 + 10 * (123456 % 2000) + 2, False, "srun")
    # A site's MASTER_ADDR / MASTER_PORT win over the rule.
    assert place_from_env({**env, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "4000"}).address == "10.0.0.5"
    assert place_from_env({**env, "MASTER_PORT": "4000"}).port == 4000


def test_the_slurm_port_rule_separates_jobs_and_steps() -> None:
    ports = {slurm_port({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step)}) for job in (7, 8) for step in (0, 1)}
    assert len(ports) == 4 and all(20000 <= p < 40010 for p in ports)


@pytest.mark.parametrize("nodelist, first", [("c001", "c001"), ("c[001-004]", "c001"), ("gpu[07,09-12],cpu1", "gpu07"),
                                             ("a1,b[2-3]", "a1")])
def test_first_host_of_a_slurm_node_list(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


def test_no_launcher_is_one_process() -> None:
    assert place_from_env({}) is None
    assert place_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) is None  # an sbatch script, not a step's task


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 needs RANK between 0 and 1"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "WORLD_SIZE=2 needs RANK between 0 and 1"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "29500"}, "MASTER_ADDR is not set"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h"}, "MASTER_PORT is not set"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "http"}, "MASTER_PORT must be a port number"),
    ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE must be a whole number"),
])
def test_a_broken_environment_is_one_line_naming_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        place_from_env(env)


def test_mpi_launchers_are_told_apart_from_torchrun_and_srun() -> None:
    assert launch_env.mpi_launched({"OMPI_COMM_WORLD_SIZE": "2"}) and launch_env.mpi_launched({"PMIX_RANK": "0"})
    assert not launch_env.mpi_launched(TORCHRUN)
    assert not launch_env.mpi_launched({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"})


def test_horovod_refuses_a_world_that_mpi_cannot_see() -> None:
    with pytest.raises(UsageError, match=r"WORLD_SIZE=2 \(torchrun's\) but no MPI launcher.*add --backend torch, "
                                         r"or start with mpirun -np 2"):
        world.refuse_unseen_world(True, TORCHRUN)
    with pytest.raises(UsageError, match=r"WORLD_SIZE=4 \(the environment's\)"):
        world.refuse_unseen_world(True, {"WORLD_SIZE": "4", "RANK": "1"})
    with pytest.raises(UsageError, match=r"srun started 2 tasks without an MPI plugin.*srun --mpi=pmix, or add "
                                         r"--backend torch"):
        world.refuse_unseen_world(True, {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"})
    world.refuse_unseen_world(True, {**TORCHRUN, "OMPI_COMM_WORLD_SIZE": "2"})  # mpirun's ranks: MPI sees them
    world.refuse_unseen_world(True, {"WORLD_SIZE": "1", "RANK": "0"})
    world.refuse_unseen_world(True, {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "PMIX_RANK": "0"})


def test_an_unresolvable_master_addr_is_named_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(UsageError, match=r"MASTER_ADDR=no-such-host\.invalid does not resolve"):
        rendezvous.check_resolves("no-such-host.invalid")
    assert time.monotonic() - start < 10
    rendezvous.check_resolves("127.0.0.1")


def test_a_master_port_in_use_is_named_by_rank_0() -> None:
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(UsageError, match=rf"MASTER_PORT={port} is in use on .*set MASTER_PORT to a free port"):
            rendezvous.open_store("127.0.0.1", port, 0, 2, 5, agent_store=False)


def test_a_rank_waits_for_rank_0_no_longer_than_the_rendezvous_timeout() -> None:
    port = rendezvous.free_port()  # nobody listens there
    start = time.monotonic()
    with pytest.raises(UsageError, match=rf"rank 1 found no rendezvous at MASTER_ADDR=127.0.0.1 MASTER_PORT={port} "
                                         r"within 2 s"):
        rendezvous.open_store("127.0.0.1", port, 1, 2, 2, agent_store=False)
    assert time.monotonic() - start < 30


def test_ranks_missing_from_the_rendezvous_are_counted() -> None:
    port = rendezvous.free_port()
    store = rendezvous.open_store("127.0.0.1", port, 0, 3, 5, agent_store=False)
    with pytest.raises(UsageError, match=r"only 1 of 3 ranks reached the rendezvous within 1 s \(missing: rank 1, 2\)"):
        rendezvous.store_allgather(store, "hosts", 0, 3, "me", 1)


def test_the_rendezvous_timeout_comes_from_the_environment() -> None:
    assert launch_env.rendezvous_timeout({}) == launch_env.RENDEZVOUS_TIMEOUT
    assert launch_env.rendezvous_timeout({"HPCDL_RENDEZVOUS_TIMEOUT": "12.5"}) == 12.5
    with pytest.raises(UsageError, match="HPCDL_RENDEZVOUS_TIMEOUT must be a number of seconds"):
        launch_env.rendezvous_timeout({"HPCDL_RENDEZVOUS_TIMEOUT": "soon"})


def test_iface_names_rank_0s_address_for_the_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    addresses = {"lo": "127.0.0.1", "eth0": "192.168.5.4", "ib0": "10.1.2.7"}
    assert rendezvous.iface_address("ib0", addresses) == "10.1.2.7"
    assert rendezvous.iface_address("10.1.2.0/24", addresses) == "10.1.2.7"
    assert rendezvous.iface_address("eth9,eth0", addresses) == "192.168.5.4"
    assert rendezvous.iface_address("10.9.0.0/16", addresses) is None
    monkeypatch.setattr(rendezvous, "interface_addresses", lambda: addresses)
    assert rendezvous.root_address(["a", "b"], "a", env={"HPCDL_IFACE": "ib0"}) == "10.1.2.7"
    assert rendezvous.root_address(["a", "b"], "a", env={"GLOO_SOCKET_IFNAME": "eth0"}) == "192.168.5.4"
    with pytest.raises(UsageError, match="--iface 10.9.0.0/16: rank 0 on a has no address on that network"):
        rendezvous.root_address(["a", "b"], "a", env={"HPCDL_IFACE": "10.9.0.0/16"})
    assert rendezvous.root_address(["a", "a"], "a", env={"HPCDL_IFACE": "ib0"}) == "127.0.0.1"  # one host
