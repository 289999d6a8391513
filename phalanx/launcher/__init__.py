"""The launcher floor: the machinery that starts and watches ranks (the ``phalanx`` command is :mod:`phalanx.cli`).

    spawn       phalanx.run(fn, np=…): ranks forked from a forkserver, results back by pipe
    join        what a rank does to join: runtime init + the services the launch asked for
    local       this host's workers under TorchElastic's agent (phalanx run -np N)
    ssh         the launcher side of a multi-host run: probe, one agent per host, stop-all
    agent       the host side (python -m phalanx.launcher.agent): agent, worker, timeline-parts
    handoff     what passes from one side to the other: the secret on stdin, the environment
    supervisor  in-process elastic jobs (--min-np/--max-np/--host-discovery-script); discovery
    secret      the job secret, HMAC-signed messages and store values
    hosts, launch_options, horovodrun_flags: reading -H/hostfiles and the run's flags
"""

from phalanx.launcher.spawn import RankError, RankTimeoutError, free_port, run

__all__ = ["run", "RankError", "RankTimeoutError", "free_port"]
