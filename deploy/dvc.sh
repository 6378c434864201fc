#!/usr/bin/env bash
# The DVC steps of the Jenkins pipeline, in the order given.
#
#   deploy/dvc.sh [--dry-run] pull | refresh | repro | push ...
#
# refresh re-fetches the data source (the get_data stage, forced); `dvc repro` then
# re-runs only the stages whose inputs changed, so an unchanged corpus trains
# nothing, and promote makes the new model @champion only if it beats the current
# one. When this run made a new champion, repro writes reports/new-champion (the
# decision from artifacts/promotion.json): the Jenkinsfile releases only then on a
# scheduled or alert-triggered run.
#
# DVC_REMOTE_CONFIG names a DVC config file holding the remote and its credentials
# (a Jenkins file credential); it serves as DVC's global config for this run only,
# so nothing secret lands in the workspace. Without it, .dvc/config must name a
# remote the agent can reach.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

actions=()
split_args "$@"
for arg in "${ARGS[@]}"; do
  case "$arg" in
    pull | refresh | repro | push) actions+=("$arg") ;;
    *) die "usage: deploy/dvc.sh [--dry-run] pull|refresh|repro|push ..." ;;
  esac
done
[ "${#actions[@]}" -gt 0 ] || die "usage: deploy/dvc.sh [--dry-run] pull|refresh|repro|push ..."

PROMOTION=artifacts/promotion.json
MARKER=reports/new-champion

# The promotion decision when it promoted, else nothing.
promoted() {
  [ -f "$PROMOTION" ] || return 0
  python -c 'import json, sys; d = json.load(open(sys.argv[1])); print(json.dumps(d) if d.get("promoted") else "")' \
    "$PROMOTION"
}

if [ -n "${DVC_REMOTE_CONFIG:-}" ]; then
  mkdir -p "$WORK/dvc"
  cp "$DVC_REMOTE_CONFIG" "$WORK/dvc/config"
  export DVC_GLOBAL_CONFIG_DIR="$WORK/dvc"
fi
dvc stage list >/dev/null # dvc.yaml parses and names its stages
for action in "${actions[@]}"; do
  case "$action" in
    pull) run dvc pull --allow-missing ;; # on a first run the remote is still empty
    refresh) run dvc repro --force --single-item get_data ;;
    repro)
      rm -f "$MARKER"
      before=$(promoted)
      run dvc repro
      after=$(promoted)
      if [ -n "$after" ] && [ "$after" != "$before" ]; then
        mkdir -p "$(dirname "$MARKER")"
        echo "$after" >"$MARKER"
        echo "new champion: $after" >&2
      elif ! dry_run; then
        echo "no new champion (data unchanged, or the model did not beat the champion): nothing to release" >&2
      fi
      ;;
    push) run dvc push ;;
  esac
done
