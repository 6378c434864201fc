#!/usr/bin/env bash
# Kubeflow: serve with KServe, train with a Trainer v2 TrainJob, run the KFP pipeline.
#
#   deploy/kubeflow.sh [--dry-run] deploy     InferenceService (GPU=1: the GPU variant),
#                                             waits until it is Ready; CANARY=1: a canary
#                                             release (below); LLM=1: KServe's LLM path
#                                             instead, kubeflow/llminferenceservice.yaml
#                                             (the lmops-runtime preset and the
#                                             LLMInferenceService lmops), waits until Ready
#   deploy/kubeflow.sh [--dry-run] train      TrainJob lmops-train on the ClusterTrainingRuntime
#                                             lmops-torch (replaces a finished one)
#   deploy/kubeflow.sh [--dry-run] pipeline   applies what its train step's TrainJob needs
#                                             (kubeflow/trainjob.yaml but the TrainJob: the
#                                             runtime, the volume, the step's RBAC), compiles
#                                             kubeflow/pipeline.py with the image and starts
#                                             a run on KFP_HOST
#   deploy/kubeflow.sh [--dry-run] schedule   the same as a recurring run (KFP_CRON, KFP's
#                                             six fields, default nightly 0 0 2 * * *)
#   deploy/kubeflow.sh [--dry-run] sweep      the same, with the sweep pipeline: a TrainJob
#                                             per item of KFP_SWEEP (a JSON list of
#                                             params.yaml overrides; default: its grid)
#
# The image is IMAGE, else the one deploy/push_image.sh pushed with CLOUD=kubeflow
# (KUBEFLOW_REGISTRY acr|ecr, ACR_NAME or AWS_ACCOUNT_ID/AWS_REGION, IMAGE_TAG): the
# serving image for deploy, the pipeline image (IMAGE_TARGET=pipeline, tag <tag>-pipeline)
# for train, pipeline and schedule.
# Every action needs KUBECONFIG for the cluster (a dry run does not); pipeline needs KFP_HOST and
# MLFLOW_TRACKING_URI (an MLflow server the cluster reaches), KFP_TOKEN if the
# endpoint wants a bearer token. KUBEFLOW_NAMESPACE: the profile namespace
# (default kubeflow-user-example-com). LMOPS_API_KEY as for deploy/deploy.sh.
#
# COMPILE_CACHE_CLAIM (deploy, CPU or LLM=1): a ReadWriteMany claim in the namespace that
# the pods keep their compile cache on, so only the first one compiles (for the
# InferenceService, Knative's PVC features must be on; docs/deploy.md).
# CANARY=1: KServe's canaryTrafficPercent sends CANARY_PERCENT (default 10) % of the
# traffic to the new revision and the rest to the previous one; then the analysis of
# deploy/canary (the queries, margins and limits Argo Rollouts uses on AKS/EKS, run by
# deploy/canary_analysis.py against PROMETHEUS_URL) promotes it to 100 %, or rolls back
# to 0 % (the previous revision serves everything) and exits non-zero; so does a canary
# that never becomes Ready. ANALYSIS_INTERVAL: seconds between measurements (default:
# the template's).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

action=""
split_args "$@"
for arg in "${ARGS[@]}"; do
  case "$arg" in
    deploy | train | pipeline | schedule | sweep) action=$arg ;;
    *) die "usage: deploy/kubeflow.sh [--dry-run] deploy|train|pipeline|schedule|sweep" ;;
  esac
done
[ -n "$action" ] || die "usage: deploy/kubeflow.sh [--dry-run] deploy|train|pipeline|schedule|sweep"
namespace=${KUBEFLOW_NAMESPACE:-kubeflow-user-example-com}
if [ "$action" = deploy ]; then
  image=$(IMAGE_TARGET=runtime remote_image kubeflow)
else
  image=$(IMAGE_TARGET=pipeline remote_image kubeflow)
fi

# traffic PERCENT: the share of the InferenceService's traffic on its latest revision.
traffic() {
  run kubectl --namespace "$namespace" patch inferenceservice lmops --type merge \
    --patch "{\"spec\":{\"predictor\":{\"canaryTrafficPercent\":$1}}}"
}

# canary_release: judge the Ready canary revision against the previous one, then
# promote it or roll back.
canary_release() {
  local revisions latest previous
  revisions=$(run kubectl --namespace "$namespace" get inferenceservice lmops --output \
    'jsonpath={.status.components.predictor.latestCreatedRevision} {.status.components.predictor.previousRolledoutRevision}')
  if dry_run; then revisions="CANARY_REVISION STABLE_REVISION"; fi
  read -r latest previous <<<"$revisions"
  if [ -z "$previous" ]; then
    echo "no previous revision to compare with: $latest takes all traffic" >&2
    traffic 100
    return
  fi
  echo "canary $latest has ${CANARY_PERCENT:-10} % of the traffic, $previous the rest: analysing" >&2
  if run python deploy/canary_analysis.py --prometheus "$PROMETHEUS_URL" --arg "namespace=$namespace" \
    --arg "canary-hash=$latest" --arg "stable-hash=$previous" --arg version-label=serving_knative_dev_revision ${ANALYSIS_INTERVAL:+--interval "$ANALYSIS_INTERVAL"}; then
    traffic 100
    run kubectl --namespace "$namespace" wait inferenceservice/lmops --for=condition=Ready \
      --timeout="${ROLLOUT_TIMEOUT:-15m}"
    dry_run || echo "canary $latest promoted: $image serves all traffic" >&2
  else
    traffic 0
    die "canary $latest ($image) not promoted: rolled back, $previous serves all traffic"
  fi
}

# compile_cache_ops POD: JSON patch operations that mount COMPILE_CACHE_CLAIM, a ReadWriteMany
# claim in the namespace, as the compile cache of the pod spec at POD (its first container),
# so that only the first pod compiles its decode graphs (docs/deploy.md, "The compile cache").
compile_cache_ops() {
  [[ "$COMPILE_CACHE_CLAIM" =~ ^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$ ]] ||
    die "COMPILE_CACHE_CLAIM must name a PersistentVolumeClaim in $namespace (lowercase letters, digits and '-'), got '$COMPILE_CACHE_CLAIM'"
  printf '%s\n' \
    "- {op: add, path: $1/containers/0/env/-, value: {name: TORCHINDUCTOR_CACHE_DIR, value: /var/cache/lmops/inductor}}" \
    "- {op: add, path: $1/containers/0/volumeMounts/-, value: {name: compile-cache, mountPath: /var/cache/lmops}}" \
    "- {op: add, path: $1/volumes/-, value: {name: compile-cache, persistentVolumeClaim: {claimName: $COMPILE_CACHE_CLAIM}}}"
}

case "$action" in
  deploy)
    # JSON patch operations on the pods' template (a strategic merge would replace the
    # custom resources' lists).
    patch=$WORK/pods.yaml
    : >"$patch"
    if truthy "${LLM:-}"; then
      if truthy "${GPU:-}" || truthy "${CANARY:-}"; then
        die "LLM=1 cannot be combined with GPU or CANARY: kubeflow/llminferenceservice.yaml is its own (unset GPU and CANARY, or LLM)"
      fi
      if [ -n "${COMPILE_CACHE_CLAIM:-}" ]; then compile_cache_ops /spec/template >"$patch"; else patch=""; fi
      render kubeflow/llminferenceservice.yaml lmops "$image" "$namespace" "$patch" LLMInferenceServiceConfig/lmops-runtime
      if [ -n "${COMPILE_CACHE_CLAIM:-}" ]; then rendered_field claimName "$COMPILE_CACHE_CLAIM"; fi
      echo "rendered kubeflow/llminferenceservice.yaml with image $image${COMPILE_CACHE_CLAIM:+, its compile cache on the claim $COMPILE_CACHE_CLAIM}" >&2
      use_cluster kubeflow
      check_api_key_secret "$namespace"
      run kubectl apply --filename "$WORK/manifests.yaml"
      run kubectl --namespace "$namespace" wait llminferenceservice/lmops --for=condition=Ready \
        --timeout="${ROLLOUT_TIMEOUT:-15m}" ||
        die "LLMInferenceService lmops did not become Ready with $image: kubectl --namespace $namespace describe llminferenceservice lmops"
      exit 0
    fi
    manifest=kubeflow/inferenceservice.yaml
    if truthy "${GPU:-}"; then manifest=kubeflow/inferenceservice-gpu.yaml; fi
    if truthy "${CANARY:-}"; then
      : "${PROMETHEUS_URL:?set PROMETHEUS_URL, the Prometheus scraping the InferenceService, for the canary analysis}"
      percent=${CANARY_PERCENT:-10}
      [[ "$percent" =~ ^[1-9][0-9]?$ ]] || die "CANARY_PERCENT must be 1 to 99 (got '$percent')"
      echo "- {op: replace, path: /spec/predictor/canaryTrafficPercent, value: $percent}" >>"$patch"
    fi
    if [ -n "${COMPILE_CACHE_CLAIM:-}" ]; then
      ! truthy "${GPU:-}" || die "COMPILE_CACHE_CLAIM is for the CPU InferenceService: the GPU one decodes eagerly (unset COMPILE_CACHE_CLAIM or GPU)"
      compile_cache_ops /spec/predictor >>"$patch"
    fi
    if [ ! -s "$patch" ]; then patch=""; fi
    render "$manifest" lmops "$image" "$namespace" "$patch" InferenceService/lmops
    rendered="rendered $manifest with image $image"
    if truthy "${CANARY:-}"; then
      rendered_field canaryTrafficPercent "$percent"
      rendered+=", $percent % of the traffic to the new revision"
    fi
    if [ -n "${COMPILE_CACHE_CLAIM:-}" ]; then rendered_field claimName "$COMPILE_CACHE_CLAIM"; fi
    echo "$rendered${COMPILE_CACHE_CLAIM:+, its compile cache on the claim $COMPILE_CACHE_CLAIM}" >&2
    use_cluster kubeflow
    check_api_key_secret "$namespace"
    run kubectl apply --filename "$WORK/manifests.yaml"
    # KServe (Knative) keeps routing to the last ready revision while a new one
    # fails, so a failed update leaves the previous model serving.
    if ! run kubectl --namespace "$namespace" wait inferenceservice/lmops \
      --for=condition=Ready --timeout="${ROLLOUT_TIMEOUT:-15m}"; then
      run kubectl --namespace "$namespace" describe inferenceservice lmops
      if truthy "${CANARY:-}"; then traffic 0; fi
      die "InferenceService lmops did not become Ready with $image: the previous revision keeps serving"
    fi
    if truthy "${CANARY:-}"; then canary_release; fi
    ;;
  train)
    LMOPS_API_KEY="" render kubeflow/trainjob.yaml lmops "$image" "$namespace"
    use_cluster kubeflow
    run kubectl --namespace "$namespace" delete trainjob lmops-train --ignore-not-found
    run kubectl apply --filename "$WORK/manifests.yaml"
    ;;
  pipeline | schedule | sweep)
    : "${KFP_HOST:?set KFP_HOST, the Kubeflow Pipelines endpoint}"
    # Its train step creates kubeflow/trainjob.yaml's TrainJob itself, once per run.
    patch=$WORK/without-trainjob.yaml
    printf '%s\n' "apiVersion: trainer.kubeflow.org/v1alpha1" "kind: TrainJob" "metadata: {name: lmops-train}" \
      "\$patch: delete" >"$patch"
    LMOPS_API_KEY="" render kubeflow/trainjob.yaml lmops "$image" "$namespace" "$patch"
    use_cluster kubeflow
    run kubectl apply --filename "$WORK/manifests.yaml"
    verb=submit kind=() extra=()
    case $action in
      schedule) verb=schedule extra=(--cron "${KFP_CRON:-0 0 2 * * *}") ;;
      sweep) kind=(--sweep) extra=(${KFP_SWEEP:+--sweep "$KFP_SWEEP"}) ;;
    esac
    python kubeflow/pipeline.py compile --image "$image" --output "$WORK/pipeline.yaml" "${kind[@]}" >&2
    run python kubeflow/pipeline.py "$verb" --host "$KFP_HOST" \
      --package "$WORK/pipeline.yaml" --namespace "$namespace" "${extra[@]}"
    ;;
esac
