#!/usr/bin/env bash
# The DVC steps of the Jenkins pipeline, in the order given.
#
#   deploy/dvc.sh [--dry-run] pull | repro | push ...
#
# DVC_REMOTE_CONFIG names a DVC config file holding the remote and its credentials
# (a Jenkins file credential); it serves as DVC's global config for this run only,
# so nothing secret lands in the workspace. Without it, .dvc/config must name a
# remote the agent can reach.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

actions=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    pull | repro | push) actions+=("$arg") ;;
    *) die "usage: deploy/dvc.sh [--dry-run] pull|repro|push ..." ;;
  esac
done
[ "${#actions[@]}" -gt 0 ] || die "usage: deploy/dvc.sh [--dry-run] pull|repro|push ..."

if [ -n "${DVC_REMOTE_CONFIG:-}" ]; then
  mkdir -p "$WORK/dvc"
  cp "$DVC_REMOTE_CONFIG" "$WORK/dvc/config"
  export DVC_GLOBAL_CONFIG_DIR="$WORK/dvc"
fi
dvc stage list >/dev/null # dvc.yaml parses and names its stages
for action in "${actions[@]}"; do
  case "$action" in
    pull) run dvc pull --allow-missing ;; # on a first run the remote is still empty
    *) run dvc "$action" ;;
  esac
done
