#!/usr/bin/env bash
# Installs the Debian packages behind the tests' own services when missing (root only; else a
# note and exit 0: those tests then skip with the reason).
set -u
# iproute2: the test hosts (tests/hosts.py)
packages=(ceph-mon ceph-osd radosgw ceph-mds ceph-fuse postgresql slurmctld slurmd slurm-client munge chromium
          rabbitmq-server openmpi-bin libopenmpi-dev iproute2)
missing=()
# installed, not merely known: a removed package keeps its configuration ("rc") and dpkg -s still succeeds
for p in "${packages[@]}"; do
  [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) == "install ok installed" ]] || missing+=("$p")
done
((${#missing[@]})) || exit 0
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
  echo "not installing ${missing[*]}: needs root and apt-get (their tests will skip)"; exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1; apt-get install -y -q "${missing[@]}" >/dev/null; }
