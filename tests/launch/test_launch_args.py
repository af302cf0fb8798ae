"""launch/mpirun.sh's parser and decisions (hpcdl/launching/args.py, plan.py), without starting anything.

Which words are the launcher's and which the entry module's, host lists counted as Open MPI
counts them, slots against -np, a virtual cluster's nodes, and every bad value refused with one
line. A fake machine (PATH of stand-in programs, a core count, no nvidia-smi call) makes each
decision depend only on what the test gives. tests/launch/test_launch_scripts.py runs the shell
script itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from hpcdl.launching import args as launch_args
from hpcdl.launching import plan as launch_plan
from hpcdl.launching.args import Host
from hpcdl.launching.plan import Launch, Machine, MpirunLaunch
from hpcdl.launching.rank_command import LaunchError


class FakeMachine(Machine):
    def is_open_mpi(self, mpirun: str) -> bool:
        return True


@pytest.fixture()
def bin_dir(tmp_path: Path) -> Path:
    """A PATH folder with mpirun and the container runtimes as empty executables."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("mpirun", "apptainer", "singularity", "ch-run"):
        (folder / name).write_text("#!/bin/sh\n")
        (folder / name).chmod(0o755)
    return folder


def decide(argv: list[str], bin_dir: Path, env: dict[str, str] | None = None, cores: int = 8,
           gpus: int = 0) -> MpirunLaunch:
    environment = dict(env or {})
    options, entry_args = launch_args.split_words(launch_args.mpirun_parser(environment), argv, environment)
    machine = FakeMachine(env=environment, path=str(bin_dir), cores=cores, root="/repo", gpus=gpus)
    return launch_plan.decide_mpirun(options, entry_args, machine)


def command(argv: list[str], bin_dir: Path, env: dict[str, str] | None = None) -> Launch:
    """The whole plan: the decisions, then the command with each rank's words (the container's included)."""
    environment = dict(env or {})
    options, entry_args = launch_args.split_words(launch_args.mpirun_parser(environment), argv, environment)
    machine = FakeMachine(env=environment, path=str(bin_dir), cores=8, root="/repo", gpus=0)
    return launch_plan.plan("mpirun", options, entry_args, machine)


def refused(argv: list[str], bin_dir: Path, env: dict[str, str] | None = None) -> str:
    with pytest.raises(LaunchError) as caught:
        command(argv, bin_dir, env)
    message = str(caught.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------ whose words


@pytest.mark.parametrize(("argv", "np", "entry_args"), [
    # A launcher option after a training flag is still the launcher's (the old parser stopped at --epochs).
    (["--epochs", "1", "-np", "3"], 3, ["--epochs", "1"]),
    (["--lr-decay", "30", "60", "-n", "4", "--batch-size", "16"], 4, ["--lr-decay", "30", "60", "--batch-size", "16"]),
    (["--np=5", "--base-lr", "-0.1"], 5, ["--base-lr", "-0.1"]),
    # After --, every word is the entry module's, launcher-like or not.
    (["-np", "2", "--", "--epochs", "3", "--np", "x"], 2, ["--epochs", "3", "--np", "x"]),
    (["-np", "2", "helloworld", "--", "-np", "9"], 2, ["helloworld", "-np", "9"]),
    # A word that is no spelling or abbreviation of a launcher option is the entry module's.
    (["-np", "2", "--hostx", "a", "--threadsx", "3"], 2, ["--hostx", "a", "--threadsx", "3"]),
])
def test_launcher_options_anywhere_before_the_separator(argv: list[str], np: int, entry_args: list[str],
                                                        bin_dir: Path) -> None:
    launch = decide(argv, bin_dir)
    assert launch.np == np
    assert launch.entry_args == entry_args


def test_every_launcher_option_is_taken_after_a_training_flag(bin_dir: Path, tmp_path: Path) -> None:
    image = tmp_path / "image.sif"
    image.write_text("")
    launch = decide(["--epochs", "1", "--threads", "3", "--oversubscribe", "--mpi-args", "-mca pml ob1",
                     "--export", "A B", "--abort-grace", "7", "--iface", "ib0", "--python", "/p", "--entry", "m.x",
                     "--image", str(image), "--runtime", "singularity", "--bind", "/s", "--no-nv", "--dry-run",
                     "-H", "a:2", "--mpirun", "mpirun", "--no-progress"], bin_dir)
    assert (launch.threads, launch.oversubscribe, launch.mpi_args, launch.export, launch.abort_grace) == (
        3, True, ["-mca", "pml", "ob1"], ["A", "B"], 7)
    assert (launch.iface, launch.python, launch.entry, launch.image, launch.runtime, launch.bind, launch.nv,
            launch.dry_run, launch.hosts) == ("ib0", "/p", "m.x", str(image), "singularity", "/s", "0", True, "a:2")
    assert launch.entry_args == ["--epochs", "1", "--no-progress"]


def test_environment_gives_the_defaults_and_a_flag_wins(bin_dir: Path) -> None:
    env = {"HPCDL_NP": "3", "HPCDL_ABORT_GRACE": "0", "OMP_NUM_THREADS": "2", "HPCDL_ENTRY": "hpcdl.doctor"}
    launch = decide([], bin_dir, env)
    assert (launch.np, launch.abort_grace, launch.threads, launch.entry) == (3, 0, 2, "hpcdl.doctor")
    assert decide(["-np", "4"], bin_dir, env).np == 4


# ------------------------------------------------------------------ host lists


@pytest.mark.parametrize(("text", "hosts"), [
    ("a:2,b:2", [Host("a", 2), Host("b", 2)]),
    ("a,a,b", [Host("a", 2), Host("b", 1)]),  # Open MPI's own example: two on aa, one on bb
    ("a:2, b:3,a", [Host("a", 3), Host("b", 3)]),
    ("10.1.2.3:4", [Host("10.1.2.3", 4)]),
])
def test_host_lists_count_like_open_mpi(text: str, hosts: list[Host]) -> None:
    assert launch_args.parse_host_list(text) == hosts


@pytest.mark.parametrize("text", ["a:2,,b:2", "a:2,", ",a", "a:0", "a:", "a:2:3", "fe80::1", "a:x", ":2", "a b:2"])
def test_odd_host_lists_are_refused(text: str, bin_dir: Path) -> None:
    assert refused(["-H", text], bin_dir).startswith("-H wants HOST:SLOTS,HOST:SLOTS")


def test_ranks_default_to_the_slots_and_fill_hosts_in_order(bin_dir: Path) -> None:
    launch = decide(["-H", "a:2,b,a"], bin_dir, cores=8)
    assert (launch.np, launch.hosts, launch.rank_map) == (4, "a:3,b:1", "a=0,1,2;b=3;")
    assert (launch.ranks_per_host, launch.threads) == (3, 2)  # 8 cores / 3 ranks on a
    launch = decide(["-H", "a:2,b:2", "-np", "3"], bin_dir)
    assert launch.rank_map == "a=0,1;b=2;"


def test_more_ranks_than_slots_needs_oversubscribe(bin_dir: Path) -> None:
    message = refused(["-H", "a:2,b:2", "-np", "5"], bin_dir)
    assert message == ("-np 5 is more ranks than the 4 slots of -H a:2,b:2: give more slots (HOST:SLOTS) or "
                       "--oversubscribe")
    launch = decide(["-H", "a:2,b:2", "-np", "5", "--oversubscribe"], bin_dir)
    assert launch.np == 5 and launch.oversubscribe and launch.rank_map == ""  # not known: no false names


def test_hostfile_slots_are_counted(bin_dir: Path, tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("# two nodes\nn1 slots=4 max_slots=8\nn2 slots=2  # small\n\nn1 slots=1\nn3:2\n")
    launch = decide(["--hostfile", str(hosts)], bin_dir)
    assert (launch.np, launch.rank_map) == (9, "n1=0,1,2,3,4;n2=5,6;n3=7,8;")
    assert f"-np 12 is more ranks than the 9 slots of --hostfile {hosts}" in refused(
        ["--hostfile", str(hosts), "-np", "12"], bin_dir)
    hosts.write_text("n1 slots=4\nn2\n")  # a host without slots: Open MPI counts its cores, so no check
    launch = decide(["--hostfile", str(hosts), "-np", "64"], bin_dir)
    assert (launch.np, launch.rank_map, launch.ranks_per_host) == (64, "", 32)


@pytest.mark.parametrize(("text", "message"), [
    ("n1 slots=0\n", "must be a positive whole number, got '0'"),
    ("n1 cpus=4\n", "'cpus=4' is not 'slots=N' or 'max_slots=N'"),
    ("# nothing\n\n", "hostfile lists no hosts"),
])
def test_bad_hostfiles_are_refused(text: str, message: str, bin_dir: Path, tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(text)
    assert message in refused(["--hostfile", str(hosts)], bin_dir)


# ------------------------------------------------------------------ virtual clusters


@pytest.fixture()
def state(tmp_path: Path) -> Path:
    """A virtual cluster 'demo' as hpcdl.tools.vcluster records it (two nodes), and a second one 'other'."""
    folder = tmp_path / "state"
    folder.mkdir()
    for name, net in (("demo", "10.200.7"), ("other", "10.200.8")):
        (folder / f"{name}.json").write_text(json.dumps({
            "name": name, "subnet": f"{net}.0/24", "bridge": f"hv{name}br", "bridge_address": f"{net}.254",
            "rate": None, "owner_pid": 1,
            "nodes": [{"hostname": f"node{i}", "namespace": f"hpcdlvc-{name}-n{i}", "address": f"{net}.{i}",
                       "host_veth": f"hv{name}h{i}"} for i in (1, 2)]}))
    return folder


def test_vcluster_spreads_ranks_over_its_nodes(bin_dir: Path, state: Path) -> None:
    env = {"HPCDL_VCLUSTER_STATE": str(state)}
    launch = decide(["--vcluster", "demo"], bin_dir, env)
    assert (launch.np, launch.hosts, launch.iface) == (4, "10.200.7.1:2,10.200.7.2:2", "10.200.7.0/24")
    assert launch.rsh_agent == "/repo/launch/vcluster-rsh" and launch.vcluster_state == str(state)
    assert decide(["--vcluster", "demo", "-np", "3"], bin_dir, env).hosts == "10.200.7.1:2,10.200.7.2:2"


def test_vcluster_keeps_the_slots_it_is_given(bin_dir: Path, state: Path) -> None:
    """The old script ignored -H's slots with --vcluster (-np was 2 per node whatever -H said)."""
    env = {"HPCDL_VCLUSTER_STATE": str(state)}
    launch = decide(["--vcluster", "demo", "-H", "node1:3,10.200.7.2:1"], bin_dir, env)
    assert (launch.np, launch.hosts, launch.rank_map) == (4, "10.200.7.1:3,10.200.7.2:1",
                                                          "10.200.7.1=0,1,2;10.200.7.2=3;")
    assert decide(["--vcluster", "demo", "-H", "node2"], bin_dir, env).np == 1
    assert "more ranks than the 1 slots" in refused(["--vcluster", "demo", "-H", "node2", "-np", "2"], bin_dir, env)


def test_vcluster_hosts_must_be_its_own_nodes(bin_dir: Path, state: Path, tmp_path: Path) -> None:
    env = {"HPCDL_VCLUSTER_STATE": str(state)}
    for host in ("node3", "10.200.8.1", "localhost"):  # 10.200.8.1 is a node of the OTHER cluster
        message = refused(["--vcluster", "demo", "-H", f"{host}:1"], bin_dir, env)
        assert message.startswith(f"virtual cluster demo has no node '{host}'"), message
    hosts = tmp_path / "hosts"
    hosts.write_text("10.200.7.1 slots=1\n10.200.8.2 slots=1\n")
    assert "has no node '10.200.8.2'" in refused(["--vcluster", "demo", "--hostfile", str(hosts)], bin_dir, env)


@pytest.mark.parametrize(("name", "message"), [
    ("nosuch", "no virtual cluster named 'nosuch'"),
    ("../etc", "--vcluster wants a cluster's name"),
])
def test_unknown_vcluster_is_refused(name: str, message: str, bin_dir: Path, state: Path) -> None:
    assert message in refused(["--vcluster", name], bin_dir, {"HPCDL_VCLUSTER_STATE": str(state)})


# ------------------------------------------------------------------ values


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["-np", "0"], {}, "-np must be a positive whole number, got '0'"),
    (["-np", "1.5"], {}, "-np must be a positive whole number, got '1.5'"),
    ([], {"HPCDL_NP": "two"}, "-np must be a positive whole number, got 'two'"),
    (["--threads", "-1"], {}, "--threads must be a positive whole number, got '-1'"),
    (["--abort-grace", "soon"], {}, "--abort-grace must be a whole number of seconds, got 'soon'"),
    (["-H", "a:1", "--hostfile", "/etc/hostname"], {}, "give -H or --hostfile, not both"),
    (["--iface", "10.1.2.0/33"], {}, "--iface: '10.1.2.0/33' is no subnet"),
    (["--iface", "eth0 ib0"], {}, "--iface: 'eth0 ib0' is no subnet"),
    (["--mpi-args", '-mca "pml ob1'], {}, "--mpi-args: No closing quotation"),
    (["--export", "A-B"], {}, "--export wants variable names"),
    (["--mpirun", "/nonexistent/mpirun"], {}, "/nonexistent/mpirun not found"),
    (["--runtime", "docker"], {}, "--runtime must be apptainer, singularity or charliecloud, got 'docker'"),
    ([], {"HPCDL_OVERSUBSCRIBE": "yes"}, "HPCDL_OVERSUBSCRIBE must be 0 or 1"),
    ([], {"HPCDL_NV": "2"}, "HPCDL_NV must be 0 or 1"),
    ([], {"HPCDL_OOB_KEEPALIVE": "10 x"}, "HPCDL_OOB_KEEPALIVE must be"),
])
def test_bad_values_are_one_line(argv: list[str], env: dict[str, str], message: str, bin_dir: Path) -> None:
    assert message in refused(argv, bin_dir, env)


@pytest.mark.processes  # the runtime is found by running it
@pytest.mark.parametrize(("runtime", "program"), [("apptainer", "apptainer"), ("singularity", "singularity"),
                                                  ("charliecloud", "ch-run")])
def test_a_runtime_is_accepted_only_where_its_program_is(runtime: str, program: str, bin_dir: Path,
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # under /tmp: ch-run binds nothing for the working folder
    image = tmp_path / "image" if runtime == "charliecloud" else tmp_path / "image.sif"  # ch-run runs a directory
    (tmp_path / "image").mkdir()
    (tmp_path / "image.sif").write_text("")
    words = command(["--image", str(image), "--runtime", runtime], bin_dir).words
    assert words[words.index(program) - 2] == "-x" and words[-3:] == ["python", "-m", "hpcdl.train"]
    assert decide(["--runtime", runtime], bin_dir).runtime == runtime  # no image: nothing to run it with
    (bin_dir / program).unlink()
    message = refused(["--image", str(image), "--runtime", runtime], bin_dir)
    assert message.startswith(f"no container runtime found ({runtime}") and program in message


@pytest.mark.processes  # the runtime is found by running it
def test_without_a_runtime_apptainer_comes_first(bin_dir: Path, tmp_path: Path) -> None:
    image = tmp_path / "image.sif"
    image.write_text("")
    assert "apptainer exec" in " ".join(command(["--image", str(image)], bin_dir).words)
    (bin_dir / "apptainer").unlink()
    assert "singularity exec" in " ".join(command(["--image", str(image)], bin_dir).words)
    (bin_dir / "singularity").unlink()
    assert refused(["--image", str(image)], bin_dir).startswith("no container runtime found (apptainer or singularity")
    assert refused(["--image", str(tmp_path / "none.sif")], bin_dir).startswith("container image not found")


def test_keepalive_setting(bin_dir: Path) -> None:
    assert decide([], bin_dir).keepalive == ["10", "5", "3"]
    assert decide([], bin_dir, {"HPCDL_OOB_KEEPALIVE": "30"}).keepalive == ["30", "5", "3"]
    assert decide([], bin_dir, {"HPCDL_OOB_KEEPALIVE": ""}).keepalive == []


def test_oversubscribe_is_added_only_beyond_this_machines_cores(bin_dir: Path) -> None:
    assert not decide(["-np", "8"], bin_dir, cores=8).oversubscribe
    launch = decide(["-np", "9"], bin_dir, cores=8)
    assert launch.oversubscribe and launch.notes == ["9 ranks on 8 cores: adding --oversubscribe"]
    assert not decide(["-np", "9"], bin_dir, {"SLURM_NTASKS": "9", "SLURM_JOB_NUM_NODES": "3"}, cores=8).oversubscribe


def test_ranks_default_to_gpus_then_slurm_then_two(bin_dir: Path) -> None:
    assert decide([], bin_dir, gpus=4).np == 4
    assert decide([], bin_dir).np == 2
    launch = decide([], bin_dir, {"SLURM_NTASKS": "6", "SLURM_JOB_NUM_NODES": "2"}, cores=12)
    assert (launch.np, launch.ranks_per_host, launch.threads) == (6, 3, 4)


# ------------------------------------------------------------------ what the shell reads


def test_shell_output_quotes_every_value() -> None:
    text = launch_args.shell_assignments({"A": "it's $HOME", "B": True, "C": ["x y", "--z"], "D": 3})
    assert text == "A='it'\"'\"'s $HOME'\nB=1\nC=('x y' --z)\nD=3\n"


def test_help_names_every_option_and_its_variable() -> None:
    parser = launch_args.mpirun_parser({})
    text = parser.format_help()
    assert text.startswith("Usage: launch/mpirun.sh")
    for action in parser._actions:
        for option in action.option_strings:
            assert option in text
    for name in ("HPCDL_NP", "HPCDL_HOSTS", "HPCDL_HOSTFILE", "HPCDL_VCLUSTER", "HPCDL_RUNTIME",
                 "HPCDL_OOB_KEEPALIVE", "HPCDL_VCLUSTER_STATE"):
        assert name in text
    assert "everything after the first -- goes to the entry module" in text


# ------------------------------------------------------------------ the environment, and values like options


def test_a_host_list_on_the_command_line_replaces_the_environments(bin_dir: Path, tmp_path: Path) -> None:
    """--help says a flag wins; a host list of the other kind in the environment must not clash with it."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1 slots=2\nn2 slots=2\n")
    launch = decide(["--hostfile", str(hostfile)], bin_dir, {"HPCDL_HOSTS": "a:1"})
    assert (launch.hostfile, launch.hosts, launch.np) == (str(hostfile), "", 4)
    launch = decide(["-H", "b:3"], bin_dir, {"HPCDL_HOSTFILE": str(hostfile)})
    assert (launch.hostfile, launch.hosts, launch.np) == ("", "b:3", 3)
    assert decide([], bin_dir, {"HPCDL_HOSTFILE": str(hostfile)}).hostfile == str(hostfile)
    both = {"HPCDL_HOSTS": "a:1", "HPCDL_HOSTFILE": str(hostfile)}
    assert refused([], bin_dir, both) == "give -H or --hostfile, not both"
    assert refused(["-H", "a:1", "--hostfile", str(hostfile)], bin_dir) == "give -H or --hostfile, not both"


@pytest.mark.parametrize(("argv", "field", "value"), [
    (["--mpi-args", "-npernode 2"], "mpi_args", ["-npernode", "2"]),  # once read as -np with 'pernode 2'
    (["--mpi-args", "-host"], "mpi_args", ["-host"]),  # once read as -h/--help
    (["--mpi-args", "-n"], "mpi_args", ["-n"]),
    (["--python", "-h"], "python", "-h"),
    (["--entry", "--help"], "entry", "--help"),
    (["--epochs", "1", "--mpi-args", "-mca pml ob1", "-np", "3"], "np", 3),
])
def test_an_options_value_is_the_next_word_whatever_it_starts_with(argv: list[str], field: str, value: object,
                                                                    bin_dir: Path) -> None:
    assert getattr(decide(argv, bin_dir), field) == value


@pytest.mark.parametrize("script", ["mpirun", "slurm", "frontera-rtx"])
def test_every_option_of_every_script_is_taken_after_an_entry_word(script: str) -> None:
    parser = launch_args.parser_for(script, {})
    for action in parser._actions:
        for option in action.option_strings:
            if option in ("-h", "--help"):
                continue
            takes_value = isinstance(action, argparse._StoreAction)
            argv = ["--epochs", "2", option] + (["-x"] if takes_value else []) + ["--lr", "1"]
            options, entry_args = launch_args.split_words(parser, argv, {})
            assert entry_args == ["--epochs", "2", "--lr", "1"], (script, option)
            assert getattr(options, action.dest) == ("-x" if takes_value else action.const), (script, option)


def test_the_options_every_script_takes_have_one_help_text() -> None:
    def common_section(script: str) -> str:
        text = launch_args.parser_for(script, {}).format_help()
        start = text.index("what each rank runs (every launch script):")
        return text[start:text.index("\n\n", start)]

    sections = {common_section(script) for script in launch_args.SCRIPTS}
    assert len(sections) == 1 and "--image IMAGE" in sections.pop()


# ------------------------------------------------------------------ no abbreviations, no other spellings


def refused_words(script: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one 'error: ' line split_words prints (exit 2) for ``argv`` given to ``script``."""
    with pytest.raises(SystemExit) as stopped:
        launch_args.split_words(launch_args.parser_for(script, {}), argv, {})
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize(("argv", "meant"), [
    (["--dryrun"], "did you mean --dry-run?"),  # was handed to hpcdl.train: the job started (issue 46)
    (["--dry"], "did you mean --dry-run?"),
    (["-np", "2", "--thread", "3"], "did you mean --threads?"),
    (["-threads", "3"], "did you mean --threads?"),
    (["--host-file", "hosts.txt"], "did you mean --hostfile?"),
    (["--epochs", "1", "--DRY_RUN"], "did you mean --dry-run?"),
    (["--e", "m"], "did you mean --entry or --export?"),
    (["--over=1"], "did you mean --oversubscribe?"),
])
def test_an_abbreviation_or_other_spelling_of_a_launcher_option_is_one_line(
        argv: list[str], meant: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = refused_words("mpirun", argv, capsys)
    assert "is not an option of launch/mpirun.sh" in line and meant in line and "after --" in line


def test_np_glued_to_its_count_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse read -np2 as -n with the value 'p2' ("got 'p2'"); mpirun does not read -np2 either."""
    line = refused_words("mpirun", ["-np2", "--epochs", "1"], capsys)
    assert line == "error: -np2: write the count as a word of its own, -np 2 (mpirun does not read -np2 either)"
    line = refused_words("mpirun", ["-npernode", "2"], capsys)
    assert "'-npernode' is not an option of launch/mpirun.sh" in line and "--mpi-args" in line


@pytest.mark.parametrize(("script", "argv", "meant"), [
    ("slurm", ["--srun-arg", "-x"], "--srun-args"),
    ("slurm", ["--out", "runs/a"], "--output-dir"),  # hpcdl.train would have expanded it, after the job started
    ("frontera-rtx", ["--launch", "srun"], "--launcher"),
    ("frontera-rtx", ["--no_resume"], "--no-resume"),
])
def test_the_batch_scripts_refuse_abbreviations_too(script: str, argv: list[str], meant: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert f"did you mean {meant}?" in refused_words(script, argv, capsys)


@pytest.mark.parametrize("script", ["mpirun", "slurm", "frontera-rtx"])
def test_every_hpcdl_train_option_still_goes_to_hpcdl_train(script: str) -> None:
    """The refusal stops at the launcher's own options: no option of hpcdl.train is mistaken for one."""
    from hpcdl.training.config import build_parser

    parser = launch_args.parser_for(script, {})
    mine = {option for action in parser._actions for option in action.option_strings}
    theirs = sorted({option for action in build_parser()._actions for option in action.option_strings} - mine)
    assert len(theirs) > 50
    options, entry_args = launch_args.split_words(parser, theirs, {})
    assert entry_args == theirs


def slurm_plan(argv: list[str], bin_dir: Path, tasks: str) -> Launch:
    env = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": tasks} if tasks else {}
    options, entry_args = launch_args.split_words(launch_args.parser_for("slurm", env),
                                                  [*argv, "--python", sys.executable], env)
    machine = FakeMachine(env=env, path=str(bin_dir), cores=8, root="/repo", gpus=0)
    return launch_plan.plan("slurm", options, entry_args, machine)


@pytest.mark.parametrize(("argv", "env_tasks"), [(["--mpi", "none"], "4"), (["--mpi", "none", "--dry-run"], "")])
def test_srun_without_mpi_is_refused_where_the_ranks_need_it(argv: list[str], env_tasks: str, bin_dir: Path) -> None:
    """srun --mpi=none leaves each task a world of its own: 4 single-rank trainings instead of one job."""
    with pytest.raises(LaunchError) as caught:
        slurm_plan(argv, bin_dir, env_tasks)
    message = str(caught.value)
    assert message.startswith("--mpi none: srun would start") and "pmix" in message and "\n" not in message
    assert (f"the {env_tasks} tasks" in message) == bool(env_tasks)


def test_srun_without_mpi_is_kept_for_one_task_and_pmix_stays_the_default(bin_dir: Path) -> None:
    assert "--mpi=none" in slurm_plan(["--mpi", "none"], bin_dir, "1").words
    assert "--mpi=pmix" in slurm_plan([], bin_dir, "4").words
