#!/usr/bin/env bash
# Push lmops:<tag> (from deploy/build_image.sh) to the registry CLOUD pulls from:
# aks -> Azure Container Registry, eks -> Elastic Container Registry,
# kubeflow -> KUBEFLOW_REGISTRY (acr or ecr, default acr).
#
#   CLOUD=aks|eks|kubeflow [GPU=1] [IMAGE_TAG=...] deploy/push_image.sh [--dry-run]
#
# acr: ACR_NAME (+ AZURE_CLIENT_ID/SECRET/TENANT_ID, else the current `az login`).
# ecr: AWS_ACCOUNT_ID, AWS_REGION (+ the usual AWS credentials); the repository
#      `lmops` must exist (aws ecr create-repository --repository-name lmops).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

only_dry_run "deploy/push_image.sh [--dry-run]" "$@"
CLOUD=${CLOUD:-}
registry=$(registry_for "$CLOUD")
host=$(registry_host "$registry")
tag=$(image_tag)
# Registry logins go to a Docker config of this run's own, not the agent's.
export DOCKER_CONFIG="$WORK/docker" AZURE_CONFIG_DIR="$WORK/azure"

case "$registry" in
  acr)
    azure_login
    run az acr login --name "$ACR_NAME"
    ;;
  ecr)
    trace aws ecr get-login-password --region "$AWS_REGION" '|' docker login --username AWS --password-stdin "$host"
    dry_run || aws ecr get-login-password --region "$AWS_REGION" | docker login --username AWS --password-stdin "$host"
    ;;
esac
run docker tag "lmops:$tag" "$host/lmops:$tag"
run docker push "$host/lmops:$tag"
