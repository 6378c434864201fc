#!/usr/bin/env bash
# Build the lmops image lmops:<tag> after linting the Dockerfile (hadolint).
#
#   [GPU=1] [IMAGE_TAG=...] [CONTAINER_ENGINE=podman] [CONTEXT=dir] \
#     deploy/build_image.sh [--dry-run] [-- BUILD-OPTION...]
#
# <tag> is IMAGE_TAG or the git commit; GPU=1 builds the CUDA variant, tagged
# <tag>-cuda; IMAGE_TARGET=pipeline the image Kubeflow's pipeline steps run in, tagged
# <tag>-pipeline (default: runtime, the serving image). The model in
# production_service/model is baked into the serving image when present.
# CONTAINER_ENGINE is docker (default) or podman (whose builder then writes the
# docker format: the OCI one has no HEALTHCHECK). CONTEXT is the build context
# (default: the repository). Options after `--` go to the build command as they
# are, e.g. `-- --secret id=pip.conf,src=pip.conf` (docs/deploy.md: behind a mirror).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --) shift && extra=("$@") && break ;;
    *) die "usage: deploy/build_image.sh [--dry-run] [-- BUILD-OPTION...]" ;;
  esac
  shift
done

hadolint Dockerfile
engine=${CONTAINER_ENGINE:-docker}
context=${CONTEXT:-.}
variant=cpu
if truthy "${GPU:-}"; then variant=cuda; fi
case "$engine" in
  docker) ;;
  podman) extra=(--format docker "${extra[@]}") ;;
  *) die "CONTAINER_ENGINE must be docker or podman (got '$engine')" ;;
esac
target=$(image_target)
if [ "$target" = runtime ] && [ ! -f "$context/production_service/model/config.json" ]; then
  echo "warning: no model in $context/production_service/model: the image will need one mounted" \
    "at /app/production_service/model, or LMOPS_MODEL_URI (see docs/deploy.md)" >&2
fi
run "$engine" build --pull --target "$target" --build-arg "VARIANT=$variant" \
  --build-arg "REVISION=$(git rev-parse HEAD)" \
  "${extra[@]}" --tag "lmops:$(image_tag)" "$context"
