#!/usr/bin/env bash
# The system tools some tests use, installed when this is root on a Debian/Ubuntu machine:
#   openssh-server, openssh-client, iproute2  the simulated multi-host cluster (tests/launcher/test_multihost.py, …)
#   slurm-wlm, munge                          a real SLURM cluster (tests/jobs/slurm_cluster.py, tests/launcher/test_slurm*.py)
#   openmpi-bin                               mpirun (tests/launcher/test_mpirun.py)
# Anywhere else it prints one line and exits 0: the tests that need a missing tool skip with the reason.
# The README's test command runs it first; so does CI (.ci/run runs that command verbatim).
set -u

missing=()
need() {  # need TOOL PACKAGE
  command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || missing+=("$2")
}
need sshd openssh-server
need ssh openssh-client
need ip iproute2
need tc iproute2
need slurmctld slurm-wlm
need slurmd slurm-wlm
need munged munge
need mpirun openmpi-bin
[ ${#missing[@]} -eq 0 ] && exit 0

packages=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install-test-deps: not root with apt-get; tests needing ${packages% } will skip"
  exit 0
fi
# shellcheck disable=SC2086
if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $packages >/dev/null 2>&1); then
  echo "install-test-deps: could not install ${packages% }; tests needing them will skip"
fi
exit 0
