#!/usr/bin/env bash
# Deploy the pushed image to AKS or EKS: render the cloud's overlay with it,
# validate, apply, wait for the rollout, and roll back when the rollout fails.
#
#   CLOUD=aks|eks [GPU=1] [IMAGE_TAG=...] [LMOPS_API_KEY=...] deploy/deploy.sh [--dry-run]
#
# aks: ACR_NAME, AKS_RESOURCE_GROUP, AKS_CLUSTER (+ AZURE_CLIENT_ID/SECRET/TENANT_ID
#      for a service principal login, else the current `az login`).
# eks: AWS_ACCOUNT_ID, AWS_REGION, EKS_CLUSTER (+ the usual AWS credentials).
# LMOPS_API_KEY creates or updates the Secret lmops-api-key; without it the Secret
# must exist already. ROLLOUT_TIMEOUT defaults to 10m. Kubeflow: deploy/kubeflow.sh.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    *) die "usage: deploy/deploy.sh [--dry-run]" ;;
  esac
done
CLOUD=${CLOUD:-}
case "$CLOUD" in
  aks | eks) ;;
  *) die "CLOUD must be aks or eks (got '$CLOUD'); for kubeflow use deploy/kubeflow.sh deploy" ;;
esac

overlay=deploy/$CLOUD
if truthy "${GPU:-}"; then overlay=$overlay/gpu; fi
# The overlay names the image after a placeholder registry; swap in the real one.
placeholder=$(sed -n 's/^ *newName: *//p' "deploy/$CLOUD/cloud/kustomization.yaml")
image=$(remote_image "$CLOUD")
render "$overlay" "$placeholder" "$image"
echo "rendered $overlay with image $image" >&2

use_cluster "$CLOUD"
check_api_key_secret "$NAMESPACE"
run kubectl apply --filename "$WORK/manifests.yaml"
if ! run kubectl --namespace "$NAMESPACE" rollout status deployment/lmops --timeout="${ROLLOUT_TIMEOUT:-10m}"; then
  echo "rollout of $image failed: rolling back to the previous revision" >&2
  run kubectl --namespace "$NAMESPACE" rollout undo deployment/lmops
  run kubectl --namespace "$NAMESPACE" rollout status deployment/lmops --timeout="${ROLLOUT_TIMEOUT:-10m}"
  exit 1
fi
dry_run || echo "$image is live on $CLOUD" >&2
