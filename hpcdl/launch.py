"""``python -m hpcdl.launch SCRIPT STEP REPO ARGS...``: the one parser and decider behind every launch script.

launch/common.sh runs it twice per launch, with SCRIPT one of mpirun, slurm, frontera-rtx:
  STEP ``modules``: reads the arguments, makes the checks that need nothing loaded and prints
  ``LAUNCH_MODULES=...`` (frontera-rtx's modules; the shell loads them, as only it can);
  STEP ``command``: decides everything else and prints the exports, ``LAUNCH_WORDS=(...)`` (the words
  to run) and ``LAUNCH_HOW`` (exec, step or dry-run), after showing the notes and the command on
  stderr, ``[hpcdl] `` before each line.
``--help`` prints the script's help (as a ``printf``, then ``exit 0``); a bad argument or setting is one
``error: ...`` line and exit 2. Standard library only: it runs before a virtual environment is known.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence

from hpcdl.launching.args import SCRIPTS, fail, help_shell, parser_for, shell_assignments, split_words
from hpcdl.launching.cores import usable_cores
from hpcdl.launching.plan import Machine, launch_shell, modules_to_load, plan
from hpcdl.launching.rank_command import LaunchError


def caller_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The launch script's environment: launch/common.sh hands over its PATH and PYTHONPATH (if any) as
    LAUNCH_CALLER_*, having set PYTHONPATH to the repository for this module alone."""
    env = dict(environ)
    env.pop("PYTHONPATH", None)
    for name in ("PATH", "PYTHONPATH"):
        if f"LAUNCH_CALLER_{name}" in env:
            env[name] = env.pop(f"LAUNCH_CALLER_{name}")
    return env


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[0] not in SCRIPTS or args[1] not in ("modules", "command"):
        fail(f"usage: python -m hpcdl.launch {{{','.join(SCRIPTS)}}} {{modules,command}} REPO ARGS...")
    script, step, root = args[:3]
    env = caller_environment(os.environ)
    parser = parser_for(script, env)
    options, entry_args = split_words(parser, args[3:], env)
    if options.help:
        sys.stdout.write(help_shell(parser))
        return 0
    machine = Machine(env=env, path=env.get("PATH", ""), cores=usable_cores(), root=root)
    try:
        if step == "modules":
            sys.stdout.write(shell_assignments({"LAUNCH_MODULES": modules_to_load(script, options, env)}))
            return 0
        launch = plan(script, options, entry_args, machine)
    except LaunchError as err:
        fail(str(err))
    for line in [*launch.notes, shlex.join(launch.shown)]:
        print(f"[hpcdl] {line}", file=sys.stderr)
    sys.stdout.write(launch_shell(launch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
