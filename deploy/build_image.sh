#!/usr/bin/env bash
# Build the lmops image lmops:<tag> after linting the Dockerfile (hadolint).
#
#   [GPU=1] [IMAGE_TAG=...] deploy/build_image.sh [--dry-run]
#
# <tag> is IMAGE_TAG or the git commit; GPU=1 builds the CUDA variant, tagged
# <tag>-cuda. The model in production_service/model is baked in when present.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    *) die "usage: deploy/build_image.sh [--dry-run]" ;;
  esac
done

hadolint Dockerfile
variant=cpu
if truthy "${GPU:-}"; then variant=cuda; fi
if [ ! -f production_service/model/config.json ]; then
  echo "warning: no model in production_service/model: the image will need one mounted" \
    "at /app/production_service/model, or LMOPS_MODEL_URI (see docs/deploy.md)" >&2
fi
run docker build --pull --build-arg "VARIANT=$variant" \
  --label "org.opencontainers.image.revision=$(git rev-parse HEAD)" \
  --tag "lmops:$(image_tag)" .
