#!/usr/bin/env bash
# Start-up of an hvd_terngrad cluster node: host keys made here (never in the image), a cluster key pair
# made once per cluster in the shared volume $CLUSTER_KEYS_DIR (default /cluster-keys), trusted by every
# node that mounts it, then sshd on port 2222, then the command.
set -euo pipefail
KEYS=${CLUSTER_KEYS_DIR:-/cluster-keys}

ssh-keygen -A >/dev/null
mkdir -p /root/.ssh "$KEYS"
chmod 700 /root/.ssh
(
  flock 9
  [ -f "$KEYS/id_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -C "hvd_terngrad-cluster" -f "$KEYS/id_ed25519"
) 9>"$KEYS/.lock"
install -m 600 "$KEYS/id_ed25519" /root/.ssh/id_ed25519
install -m 644 "$KEYS/id_ed25519.pub" /root/.ssh/id_ed25519.pub
install -m 600 "$KEYS/id_ed25519.pub" /root/.ssh/authorized_keys
/usr/sbin/sshd
exec "$@"
