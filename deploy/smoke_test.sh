#!/usr/bin/env bash
# Smoke-test a running lmops service: GET /health, /ready and /v1/models, then
# one POST /v1/completions to the model served, whose answer must carry a completion.
#
#   deploy/smoke_test.sh [--dry-run] [URL]       e.g. http://127.0.0.1:5001
#
# Without URL it finds the service's external address in the cluster of CLOUD,
# waiting up to LB_TIMEOUT seconds (default 900) for it: aks/eks the LoadBalancer
# Service lmops, or with GATEWAY=1 the Gateway inference-gateway (port 80); kubeflow
# the KServe ingress gateway (istio-system), with the InferenceService's host name
# as Host header. LMOPS_API_KEY, when set, is sent
# as the bearer token (through a private file, never on a command line).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

url=""
split_args "$@"
for arg in "${ARGS[@]}"; do
  case "$arg" in
    http://* | https://*) url=${arg%/} ;;
    *) die "usage: deploy/smoke_test.sh [--dry-run] [URL]" ;;
  esac
done
curl_args=(--fail --silent --show-error --max-time 60)
if [ -n "${LMOPS_API_KEY:-}" ]; then
  # From a file (curl's --header @FILE), not argv, which `ps` shows anyone on the agent.
  (umask 077 && printf 'Authorization: Bearer %s\n' "$LMOPS_API_KEY" >"$WORK/auth-header")
  curl_args+=(--header "@$WORK/auth-header")
fi

LOADBALANCER_ADDRESS='{.status.loadBalancer.ingress[0].ip}{.status.loadBalancer.ingress[0].hostname}'
GATEWAY_ADDRESS='{.status.addresses[0].value}'

# external_address KIND/NAME NAMESPACE JSONPATH: a LoadBalancer Service's or a
# Gateway's address (JSONPATH says where its status holds it), once it has one.
external_address() {
  local address="" deadline=$((SECONDS + ${LB_TIMEOUT:-900}))
  while [ -z "$address" ]; do
    address=$(run kubectl --namespace "$2" get "$1" --output "jsonpath=$3")
    if dry_run; then address=LOADBALANCER; fi
    if [ -z "$address" ]; then
      [ "$SECONDS" -lt "$deadline" ] || die "$2/$1 got no external address in ${LB_TIMEOUT:-900} s"
      sleep 10
    fi
  done
  echo "$address"
}

if [ -z "$url" ]; then
  CLOUD=${CLOUD:-}
  use_cluster "$CLOUD"
  if [ "$CLOUD" = kubeflow ]; then
    namespace=${KUBEFLOW_NAMESPACE:-kubeflow-user-example-com}
    host=$(run kubectl --namespace "$namespace" get inferenceservice lmops --output 'jsonpath={.status.url}')
    if dry_run; then host=http://lmops.$namespace.example.com; fi
    curl_args+=(--header "Host: ${host#*://}")
    url=http://$(external_address service/istio-ingressgateway istio-system "$LOADBALANCER_ADDRESS")
  elif truthy "${GATEWAY:-}"; then
    url=http://$(external_address gateway/inference-gateway "$NAMESPACE" "$GATEWAY_ADDRESS")
  else
    url=http://$(external_address service/lmops "$NAMESPACE" "$LOADBALANCER_ADDRESS"):5001
  fi
fi
echo "smoke-testing $url" >&2

# The load balancer may need a few minutes before it forwards: retry the first call.
run curl "${curl_args[@]}" --retry 30 --retry-delay 10 --retry-all-errors "$url/health"
echo
run curl "${curl_args[@]}" --retry 12 --retry-delay 10 --retry-all-errors "$url/ready"
echo
# Ask for a completion from the model the service says it serves.
models=$(run curl "${curl_args[@]}" "$url/v1/models")
model=lmops
if ! dry_run; then
  model=$(python -c 'import json, sys; print(json.loads(sys.argv[1])["data"][0]["id"])' "$models") ||
    die "unexpected /v1/models answer: $models"
fi
request=$(python -c 'import json, sys; print(json.dumps({"model": sys.argv[1], "prompt": "def ", "max_tokens": 16}))' "$model")
body=$(run curl "${curl_args[@]}" --header "Content-Type: application/json" --data "$request" "$url/v1/completions")
if ! dry_run; then
  python -c '
import json, sys
text = json.loads(sys.argv[1])["choices"][0]["text"]
assert isinstance(text, str), "choices[0].text is not a string"
print("completion:", repr(text))
' "$body" || die "unexpected /v1/completions answer: $body"
  echo "smoke test passed: $url" >&2
fi
