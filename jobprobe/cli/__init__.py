# SPDX-License-Identifier: Apache-2.0
"""jobprobe's command line. The commands, and the module that carries each out:

    run         attach to one job (--cgroup, --pid, --slurm-job, --k8s-pod or -- CMD) and sample it   node.py
    agent       the node daemon: jobs attached and detached at run time over its control socket        node.py
    attach      ask the agent to attach a job                                                          node.py
    detach      ask the agent to detach a job (after a last frame)                                     node.py
    status      the agent's jobs, each probe's status per job, the agent's own cost                    node.py
    probes      every probe and whether it can run here; with --job, switch one job's probes           node.py
    trace       open a deep-trace window for a job (one node, or every node through the controller)    node.py
    doctor      is this node ready? each check pass / warn / fail / absent, with its fix               node.py
    controller  frames from NATS JetStream into the store; stats; enroll NODE                          cluster.py
    query       read the controller's store: SQL, one field of a job, a job's cost                     cluster.py
    report      one self-contained HTML page of a job                                                  cluster.py
    read        decode a frame file                                                                    frames.py
    bench       overhead, peers, events, agent, controller, accuracy                                   bench.py

parser.py holds the grammar (build_parser) and the two rewrites of argv that argparse cannot express. Bad input gets
one line on stderr and exit code 2 (127/126 for a -- CMD that is not there / cannot be executed); nothing deeper
than main() exits the process. Each command imports what it drives inside its function: `jobprobe --version` and
the node's commands never import the controller's NATS client.
"""
from __future__ import annotations

import logging
import sys

from jobprobe.cli.parser import build_parser, split_command, toggles_as_options
from jobprobe.core.errors import BadInput, JobprobeError

__all__ = ["build_parser", "main"]


def one_line(err: Exception) -> str:
    """An error's text on one line: a name given on the command line may hold a newline or a carriage return."""
    return str(err).replace("\r", "\\r").replace("\n", "\\n")


def main(argv: list[str] | None = None) -> int:
    argv, command = split_command(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(format="jobprobe: %(message)s", level=logging.WARNING, stream=sys.stderr)
    try:
        args = build_parser().parse_args(toggles_as_options(argv))
        if command and args.cmd not in ("run", "bench"):
            raise BadInput("-- CMD is only for 'jobprobe run' and 'jobprobe bench'")
        args.command = command     # the words after `--`: run's and bench's CMD ARGS...
        return args.func(args)
    except BadInput as err:   # 2; 127/126 for a -- CMD that is not there / cannot be executed (shell convention)
        print(f"jobprobe: error: {one_line(err)}", file=sys.stderr)
        return err.exit_code
    except JobprobeError as err:
        print(f"jobprobe: error: {one_line(err)}", file=sys.stderr)
        return 1
    except UnicodeEncodeError as err:   # a path or value no file system name can hold (a lone surrogate)
        print(f"jobprobe: error: an argument cannot be encoded for this system: {err.object[err.start:err.end]!r}",
              file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
