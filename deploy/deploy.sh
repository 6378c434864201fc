#!/usr/bin/env bash
# Deploy the pushed image to AKS or EKS: render the cloud's overlay with it, pinned by
# digest (the tag's digest in the registry now), validate, apply, wait for the rollout,
# and roll back when the rollout fails.
#
#   CLOUD=aks|eks [GPU=1|CANARY=1|GATEWAY=1|GATEWAY=precise] [IMAGE_TAG=...] [LMOPS_API_KEY=...] deploy/deploy.sh [--dry-run]
#
# aks: ACR_NAME, AKS_RESOURCE_GROUP, AKS_CLUSTER (+ AZURE_CLIENT_ID/SECRET/TENANT_ID
#      for a service principal login, else the current `az login`).
# eks: AWS_ACCOUNT_ID, AWS_REGION, EKS_CLUSTER (+ the usual AWS credentials), and for
#      the CPU variants EFS_FILE_SYSTEM_ID (their shared compile cache; docs/deploy.md).
# LMOPS_API_KEY creates or updates the Secret lmops-api-key; without it the Secret
# must exist already. ROLLOUT_TIMEOUT defaults to 10m (30m with CANARY).
# CANARY=1 deploys deploy/<cloud>/canary (Argo Rollouts): the new version gets 10 %,
# then 50 % of the pods, each step gated by the analysis in deploy/canary; this
# script waits until Argo Rollouts promotes it or aborts it, and on an abort, an
# inconclusive analysis or the timeout it makes sure the rollout is aborted (the
# stable version keeps serving), prints the analysis, and exits non-zero.
# GATEWAY=1 deploys deploy/<cloud>/gateway (the Inference Gateway: InferencePool,
# HTTPRoute and llm-d-router's endpoint picker, docs/deploy.md) onto the cluster's
# Gateway inference-gateway, which must exist, and waits for the picker too. It is a
# CPU deployment without a canary: GPU or CANARY with it is refused. GATEWAY=precise
# deploys deploy/<cloud>/gateway-precise instead: the same, with every replica
# publishing its KV-cache events to the picker's precise prefix-cache scorer.
# Kubeflow: deploy/kubeflow.sh.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

only_dry_run "deploy/deploy.sh [--dry-run]" "$@"

# wait_for_canary TIMEOUT: poll the Rollout until Argo Rollouts has promoted the new
# version (phase Healthy) or aborted it (Degraded: an analysis failed or errored, or
# the canary was not ready within progressDeadlineSeconds). Fails on an abort, and at
# TIMEOUT (e.g. paused on an inconclusive analysis).
wait_for_canary() {
  local deadline=$((SECONDS + $(seconds "$1"))) status last="" generation observed phase message
  local get=(kubectl --namespace "$NAMESPACE" get rollout lmops --output
    'jsonpath={.metadata.generation} {.status.observedGeneration} {.status.phase} {.status.message}')
  trace "${get[@]}"
  if dry_run; then return 0; fi
  echo "(every ${ROLLOUT_POLL:-15}s until Healthy or Degraded, at most $1)" >&2
  while :; do
    status=$("${get[@]}")
    read -r generation observed phase message <<<"$status"
    if [ "$status" != "$last" ]; then echo "rollout: ${phase:-pending} ${message:-}" >&2; fi
    last=$status
    if [ "$generation" = "$observed" ]; then
      case "$phase" in
        Healthy) return 0 ;;
        Degraded) return 1 ;;
      esac
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "the rollout did not finish within $1 (${phase:-pending}: ${message:-})" >&2
      return 1
    fi
    sleep "${ROLLOUT_POLL:-15}"
  done
}

# abort_canary IMAGE: abort the rollout (a no-op when Argo Rollouts did already): the
# canary pods go, the stable version takes all traffic. Then say why, from the latest
# analysis run.
abort_canary() {
  echo "canary of $1 not promoted: aborting the rollout, the stable version keeps serving" >&2
  run kubectl --namespace "$NAMESPACE" patch rollout lmops --subresource status --type merge \
    --patch '{"status":{"abort":true}}'
  run kubectl --namespace "$NAMESPACE" wait rollout/lmops --for=jsonpath='{.status.phase}'=Degraded \
    --timeout=5m || echo "warning: the rollout has not reported the abort yet" >&2
  local analysis=(kubectl --namespace "$NAMESPACE" get analysisruns --sort-by=.metadata.creationTimestamp
    --output 'jsonpath={range .items[-1:]}analysis {.metadata.name}: {.status.phase} {.status.message}{"\n"}{range .status.metricResults[*]}  {.name}: {.phase} ({.count} measurements, {.failed} failed, {.inconclusive} inconclusive, {.error} errors) last value {.measurements[-1:].value} {.message}{"\n"}{end}{end}')
  local report
  report=$(run "${analysis[@]}") || true
  echo "${report:-(no analysis run to show)}" >&2
  case "$report" in
    "analysis "*": Error"* | "analysis "*": Inconclusive"*)
      echo "the analysis was inconclusive (no data to compare, or Prometheus unreachable): not promoting $1" >&2
      ;;
  esac
}

CLOUD=${CLOUD:-}
case "$CLOUD" in
  aks | eks) ;;
  *) die "CLOUD must be aks or eks (got '$CLOUD'); for kubeflow use deploy/kubeflow.sh deploy" ;;
esac

overlay=deploy/$CLOUD
timeout=${ROLLOUT_TIMEOUT:-10m}
gateway=""
if [ "${GATEWAY:-}" = precise ]; then
  gateway="gateway-precise"
elif truthy "${GATEWAY:-}"; then
  gateway="gateway"
fi
if [ -n "$gateway" ]; then
  if truthy "${CANARY:-}" || truthy "${GPU:-}"; then
    die "GATEWAY=1 cannot be combined with CANARY or GPU: deploy/$CLOUD/gateway is the CPU overlay behind the Inference Gateway (unset CANARY and GPU, or GATEWAY)"
  fi
  overlay=$overlay/$gateway
fi
if truthy "${CANARY:-}"; then
  overlay=$overlay/canary
  timeout=${ROLLOUT_TIMEOUT:-30m}
fi
seconds "$timeout" >/dev/null # a typo stops here, before anything is deployed
if truthy "${GPU:-}"; then overlay=$overlay/gpu; fi
# The CPU variants share one compile cache (deploy/compile-cache); on EKS it is an EFS file
# system of the user's, whose id goes into the StorageClass (a placeholder in the overlay).
efs_patch=""
if [ "$CLOUD" = eks ] && ! truthy "${GPU:-}"; then
  [[ "${EFS_FILE_SYSTEM_ID:-}" =~ ^fs-[0-9a-f]{8,17}$ ]] ||
    die "set EFS_FILE_SYSTEM_ID to the EFS file system (fs-...) that holds the pods' shared compile cache, reachable by the cluster's EFS CSI driver (docs/deploy.md, \"The compile cache\"); got '${EFS_FILE_SYSTEM_ID:-}'"
  efs_patch=$WORK/efs.yaml
  printf 'apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata: {name: lmops-compile-cache}\nparameters: {fileSystemId: %s}\n' \
    "$EFS_FILE_SYSTEM_ID" >"$efs_patch"
fi
use_cluster "$CLOUD"
# The overlay names the image after a placeholder registry and digest; swap in the
# pushed image, pinned by the digest its tag has now.
placeholder=$(sed -n 's/^ *newName: *//p' "deploy/$CLOUD/cloud/kustomization.yaml")
image=$(pinned_image "$CLOUD" "$(remote_image "$CLOUD")")
render "$overlay" "$placeholder" "$image" "" "$efs_patch"
if [ -n "$efs_patch" ]; then rendered_field fileSystemId "$EFS_FILE_SYSTEM_ID"; fi
echo "rendered $overlay with image $image${efs_patch:+, its compile cache on EFS $EFS_FILE_SYSTEM_ID}" >&2

check_api_key_secret "$NAMESPACE"
if [ -n "$gateway" ]; then
  run kubectl --namespace "$NAMESPACE" get gateway inference-gateway --output name ||
    die "no Gateway inference-gateway in namespace $NAMESPACE: install the Gateway API, the InferencePool CRD and a gateway implementation first (docs/deploy.md, \"Inference Gateway\")"
fi
run kubectl apply --filename "$WORK/manifests.yaml"
if [ -n "$gateway" ]; then
  run kubectl --namespace "$NAMESPACE" rollout status deployment/lmops-epp --timeout="$timeout" ||
    die "the endpoint picker (deployment/lmops-epp) did not become ready; the gateway routes around it (FailOpen) meanwhile: kubectl --namespace $NAMESPACE logs deployment/lmops-epp"
fi
if truthy "${CANARY:-}"; then
  if ! wait_for_canary "$timeout"; then
    abort_canary "$image"
    exit 1
  fi
  # Once a Rollout serves, a Deployment left from a deploy without CANARY must go.
  run kubectl --namespace "$NAMESPACE" delete deployment lmops --ignore-not-found
  dry_run || echo "$image is live on $CLOUD (canary promoted)" >&2
  exit 0
fi
if ! run kubectl --namespace "$NAMESPACE" rollout status deployment/lmops --timeout="$timeout"; then
  echo "rollout of $image failed: rolling back to the previous revision" >&2
  run kubectl --namespace "$NAMESPACE" rollout undo deployment/lmops
  run kubectl --namespace "$NAMESPACE" rollout status deployment/lmops --timeout="$timeout"
  exit 1
fi
dry_run || echo "$image is live on $CLOUD" >&2
