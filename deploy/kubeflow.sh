#!/usr/bin/env bash
# Kubeflow: serve with KServe, train with a PyTorchJob, run the KFP pipeline.
#
#   deploy/kubeflow.sh [--dry-run] deploy     InferenceService (GPU=1: the GPU variant),
#                                             waits until it is Ready
#   deploy/kubeflow.sh [--dry-run] train      PyTorchJob lmops-train (replaces a finished one)
#   deploy/kubeflow.sh [--dry-run] pipeline   compiles kubeflow/pipeline.py with the image
#                                             and starts a run on KFP_HOST
#
# The image is IMAGE, else the one deploy/push_image.sh pushed with CLOUD=kubeflow
# (KUBEFLOW_REGISTRY acr|ecr, ACR_NAME or AWS_ACCOUNT_ID/AWS_REGION, IMAGE_TAG).
# deploy/train need KUBECONFIG for the cluster; pipeline needs KFP_HOST and
# MLFLOW_TRACKING_URI (an MLflow server the cluster reaches), KFP_TOKEN if the
# endpoint wants a bearer token. KUBEFLOW_NAMESPACE: the profile namespace
# (default kubeflow-user-example-com). LMOPS_API_KEY as for deploy/deploy.sh.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

action=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    deploy | train | pipeline) action=$arg ;;
    *) die "usage: deploy/kubeflow.sh [--dry-run] deploy|train|pipeline" ;;
  esac
done
[ -n "$action" ] || die "usage: deploy/kubeflow.sh [--dry-run] deploy|train|pipeline"
namespace=${KUBEFLOW_NAMESPACE:-kubeflow-user-example-com}
image=$(remote_image kubeflow)

case "$action" in
  deploy)
    manifest=kubeflow/inferenceservice.yaml
    if truthy "${GPU:-}"; then manifest=kubeflow/inferenceservice-gpu.yaml; fi
    render "$manifest" lmops "$image" "$namespace"
    use_cluster kubeflow
    check_api_key_secret "$namespace"
    run kubectl apply --filename "$WORK/manifests.yaml"
    # KServe (Knative) keeps routing to the last ready revision while a new one
    # fails, so a failed update leaves the previous model serving.
    if ! run kubectl --namespace "$namespace" wait inferenceservice/lmops \
      --for=condition=Ready --timeout="${ROLLOUT_TIMEOUT:-15m}"; then
      run kubectl --namespace "$namespace" describe inferenceservice lmops
      die "InferenceService lmops did not become Ready with $image"
    fi
    ;;
  train)
    LMOPS_API_KEY="" render kubeflow/pytorchjob.yaml lmops "$image" "$namespace"
    use_cluster kubeflow
    run kubectl --namespace "$namespace" delete pytorchjob lmops-train --ignore-not-found
    run kubectl apply --filename "$WORK/manifests.yaml"
    ;;
  pipeline)
    : "${KFP_HOST:?set KFP_HOST, the Kubeflow Pipelines endpoint}"
    python kubeflow/pipeline.py compile --image "$image" --output "$WORK/pipeline.yaml" >&2
    run python kubeflow/pipeline.py submit --host "$KFP_HOST" --package "$WORK/pipeline.yaml" \
      --namespace "$namespace"
    ;;
esac
