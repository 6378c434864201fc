# shellcheck shell=bash
# Shared by the deploy/ scripts: sourced, never run on its own.
#
# Every script runs from the repository root with .venv/bin first on PATH and
# takes --dry-run (or DRY_RUN=1/true): it then renders and validates everything
# for real but prints each cloud command (az, aws, docker, kubectl against a
# cluster, dvc, kfp) instead of running it. Commands are traced as `+ ...` on
# stderr, with the values of the secret variables below masked.
set -euo pipefail
shopt -s inherit_errexit

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# The project's tools (.venv/bin) come first, unless the caller placed them already.
case ":$PATH:" in
  *":$ROOT/${VENV:-.venv}/bin:"*) ;;
  *) export PATH="$ROOT/${VENV:-.venv}/bin:$PATH" ;;
esac
DRY_RUN=${DRY_RUN:-0}
SECRET_VARS=(LMOPS_API_KEY AZURE_CLIENT_SECRET AWS_SECRET_ACCESS_KEY KFP_TOKEN)
# Masking replaces a secret's value wherever it occurs in a traced command; a value this
# short would also be masked inside ordinary words (and guessed), so it is refused.
MIN_SECRET_CHARS=8
# shellcheck disable=SC2034 # used by the scripts that source this file
NAMESPACE=lmops # the namespace of deploy/base

WORK=$(mktemp -d)
# The dry run's closing note only when it got to the end: after an error, nothing was
# printed in full.
on_exit() {
  local status=$?
  rm -rf "$WORK"
  if dry_run && [ "$status" = 0 ]; then echo "(dry run: the cloud commands above were printed, not run)" >&2; fi
}
trap on_exit EXIT

die() {
  echo "error: $*" >&2
  exit 1
}

truthy() {
  case "${1:-}" in
    1 | true | TRUE | True | yes) return 0 ;;
    *) return 1 ;;
  esac
}

dry_run() { truthy "$DRY_RUN"; }

for name in "${SECRET_VARS[@]}"; do
  value=${!name:-}
  if [ -n "$value" ] && [ "${#value}" -lt "$MIN_SECRET_CHARS" ]; then
    die "$name is ${#value} character(s) long: a secret needs at least $MIN_SECRET_CHARS (e.g. \`openssl rand -hex 16\`)"
  fi
done
unset name value

# split_args ARG...: every script's --dry-run (sets DRY_RUN=1); the other arguments in ARGS.
split_args() {
  ARGS=()
  local arg
  for arg in "$@"; do
    if [ "$arg" = --dry-run ]; then DRY_RUN=1; else ARGS+=("$arg"); fi
  done
}

# only_dry_run USAGE ARG...: for the scripts that take no argument but --dry-run.
only_dry_run() {
  local usage=$1
  shift
  split_args "$@"
  [ "${#ARGS[@]}" -eq 0 ] || die "usage: $usage"
}

# trace WORD...: print a command as it would run, secrets masked.
trace() {
  local line name value
  line=$(printf ' %q' "$@")
  for name in "${SECRET_VARS[@]}"; do
    value=${!name:-}
    [ -n "$value" ] || continue
    line=${line//"$(printf %q "$value")"/***}
    line=${line//"$value"/***}
  done
  echo "+${line}" >&2
}

# run WORD...: trace a cloud command, then run it unless this is a dry run.
run() {
  trace "$@"
  dry_run || "$@"
}

# The image tag: IMAGE_TAG or the commit, with -cuda for the GPU variant (GPU=1) and
# -pipeline for the Dockerfile's pipeline target (IMAGE_TARGET=pipeline; default: runtime,
# the serving image).
image_tag() {
  local tag=${IMAGE_TAG:-}
  [ -n "$tag" ] || tag=$(git rev-parse --short=12 HEAD)
  if truthy "${GPU:-}"; then tag="$tag-cuda"; fi
  case "$(image_target)" in
    pipeline) tag="$tag-pipeline" ;;
  esac
  echo "$tag"
}

image_target() {
  case "${IMAGE_TARGET:-runtime}" in
    runtime | pipeline) echo "${IMAGE_TARGET:-runtime}" ;;
    *) die "IMAGE_TARGET must be runtime (the serving image) or pipeline (got '$IMAGE_TARGET')" ;;
  esac
}

# seconds DURATION: a kubectl-style duration (90, 90s, 10m, 1h) in seconds.
seconds() {
  [[ "$1" =~ ^([0-9]+)([smh]?)$ ]] || die "not a duration: '$1' (e.g. 90s, 10m, 1h)"
  case "${BASH_REMATCH[2]}" in
    h) echo $((BASH_REMATCH[1] * 3600)) ;;
    m) echo $((BASH_REMATCH[1] * 60)) ;;
    *) echo "${BASH_REMATCH[1]}" ;;
  esac
}

# The registry (acr or ecr) a cloud pulls from.
registry_for() {
  case "$1" in
    aks) echo acr ;;
    eks) echo ecr ;;
    kubeflow) echo "${KUBEFLOW_REGISTRY:-acr}" ;;
    *) die "CLOUD must be aks, eks or kubeflow (got '$1')" ;;
  esac
}

registry_host() {
  case "$1" in
    acr) echo "${ACR_NAME:?set ACR_NAME, the Azure Container Registry}.azurecr.io" ;;
    ecr) echo "${AWS_ACCOUNT_ID:?set AWS_ACCOUNT_ID}.dkr.ecr.${AWS_REGION:?set AWS_REGION}.amazonaws.com" ;;
    *) die "registry must be acr or ecr (got '$1')" ;;
  esac
}

# The pushed image for CLOUD: IMAGE when set, else <registry>/lmops:<tag>.
remote_image() {
  if [ -n "${IMAGE:-}" ]; then
    echo "$IMAGE"
    return
  fi
  local registry host tag
  registry=$(registry_for "$1")
  host=$(registry_host "$registry")
  tag=$(image_tag)
  echo "$host/lmops:$tag"
}

# pinned_image CLOUD IMAGE: IMAGE (name:tag, as pushed) as name@sha256:..., the digest the
# registry holds for that tag now, so what is deployed cannot change under the tag. A dry
# run prints the lookup and pins a placeholder digest.
pinned_image() {
  local name=${2%:*} tag=${2##*:} digest
  case "$2" in *@sha256:*)
    echo "$2"
    return
    ;;
  esac
  [ -z "${IMAGE:-}" ] || die "IMAGE must name a digest (name@sha256:...), got $IMAGE"
  case "$(registry_for "$1")" in
    acr) digest=$(run az acr repository show --name "$ACR_NAME" --image "lmops:$tag" --query digest --output tsv) ;;
    ecr) digest=$(run aws ecr describe-images --region "$AWS_REGION" --repository-name lmops \
      --image-ids "imageTag=$tag" --query 'imageDetails[0].imageDigest' --output text) ;;
  esac
  if dry_run; then digest=sha256:$(printf 'd%.0s' {1..64}); fi
  case "$digest" in
    sha256:*) echo "$name@$digest" ;;
    *) die "no digest for $2 in the registry (pushed? deploy/push_image.sh)" ;;
  esac
}

azure_login() {
  if [ -n "${AZURE_CLIENT_ID:-}" ]; then
    # The secret goes through a private file (az reads `@FILE` values from it), never argv,
    # which `ps` shows anyone on the agent.
    (umask 077 && printf '%s' "${AZURE_CLIENT_SECRET:?set AZURE_CLIENT_SECRET}" >"$WORK/azure-secret")
    run az login --service-principal --username "$AZURE_CLIENT_ID" --password "@$WORK/azure-secret" \
      --tenant "${AZURE_TENANT_ID:?set AZURE_TENANT_ID}" --output none
    rm -f "$WORK/azure-secret"
  fi
  if [ -n "${AZURE_SUBSCRIPTION_ID:-}" ]; then
    run az account set --subscription "$AZURE_SUBSCRIPTION_ID"
  fi
}

# Point kubectl at the cluster of CLOUD. aks and eks write a kubeconfig of this
# run's own; kubeflow uses the one KUBECONFIG names.
use_cluster() {
  case "$1" in
    aks)
      export KUBECONFIG="$WORK/kubeconfig" AZURE_CONFIG_DIR="$WORK/azure"
      azure_login
      run az aks get-credentials --resource-group "${AKS_RESOURCE_GROUP:?set AKS_RESOURCE_GROUP}" \
        --name "${AKS_CLUSTER:?set AKS_CLUSTER}" --file "$KUBECONFIG" --overwrite-existing
      ;;
    eks)
      export KUBECONFIG="$WORK/kubeconfig"
      run aws eks update-kubeconfig --region "${AWS_REGION:?set AWS_REGION}" \
        --name "${EKS_CLUSTER:?set EKS_CLUSTER}" --kubeconfig "$KUBECONFIG"
      ;;
    kubeflow)
      # A dry run talks to no cluster, so it needs none.
      dry_run || : "${KUBECONFIG:?set KUBECONFIG to a kubeconfig for the Kubeflow cluster}"
      ;;
    *) die "CLOUD must be aks, eks or kubeflow (got '$1')" ;;
  esac
}

# rendered_field FIELD VALUE: fails unless the rendered manifests ($WORK/manifests.yaml) have
# a line `FIELD: VALUE`: the check that a patch took.
rendered_field() {
  grep -qE "^ +$1: $2\$" "$WORK/manifests.yaml" || die "the rendered manifests do not set $1 to $2"
}

# render SOURCE FROM TO [NAMESPACE [PATCH [TARGET]]]: SOURCE (a kustomization folder or one
# manifest file) with the image named FROM replaced by TO (name:tag or name@digest), moved to
# NAMESPACE when given, PATCH (a file: a strategic merge patch, or with TARGET, KIND/NAME, a
# JSON patch of that object, which a custom resource's lists need) applied, plus the
# Secret lmops-api-key when LMOPS_API_KEY is set. Writes $WORK/manifests.yaml and
# validates it (deploy/validate.py).
render() {
  local source=$1 from=$2 to=$3 namespace=${4:-} patch=${5:-} target=${6:-} dir="$WORK/render"
  rm -rf "$dir" && mkdir -p "$dir"
  if [ -d "$source" ]; then
    source=$(python -c 'import os, sys; print(os.path.relpath(*sys.argv[1:]))' "$source" "$dir")
  else
    cp "$source" "$dir/" && source=$(basename "$source")
  fi
  {
    echo "apiVersion: kustomize.config.k8s.io/v1beta1"
    echo "kind: Kustomization"
    if [ -n "$namespace" ]; then echo "namespace: $namespace"; fi
    echo "resources: [$source]"
    case "$to" in
      *@*) echo "images: [{name: $from, newName: ${to%@*}, digest: ${to#*@}}]" ;;
      *) echo "images: [{name: $from, newName: ${to%:*}, newTag: ${to##*:}}]" ;;
    esac
    if [ -n "$patch" ]; then
      cp "$patch" "$dir/patch.yaml"
      echo "patches: [{path: patch.yaml${target:+, target: {kind: ${target%/*}, name: ${target#*/}\}}}]"
    fi
    if [ -n "${LMOPS_API_KEY:-}" ]; then
      (umask 077 && printf '%s' "$LMOPS_API_KEY" >"$dir/api-key")
      echo "secretGenerator: [{name: lmops-api-key, files: [api-key], options: {disableNameSuffixHash: true}}]"
    fi
  } >"$dir/kustomization.yaml"
  kubectl kustomize "$dir" >"$WORK/manifests.yaml"
  python deploy/validate.py "$WORK/manifests.yaml" >&2
  grep -qF "image: $to" "$WORK/manifests.yaml" || die "the rendered manifests do not use $to"
}

# Without LMOPS_API_KEY, the Secret must already be in NAMESPACE.
check_api_key_secret() {
  [ -z "${LMOPS_API_KEY:-}" ] || return 0
  run kubectl --namespace "$1" get secret lmops-api-key --output name ||
    die "no Secret lmops-api-key in namespace $1: set LMOPS_API_KEY once to create it"
}
