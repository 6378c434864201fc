#!/usr/bin/env bash
# Export the served model from the MLflow registry to production_service/model
# (or EXPORT_DIR), where deploy/build_image.sh bakes it into the image.
#
#   MLFLOW_TRACKING_URI=... [MODEL_URI=models:/lmops@champion] deploy/fetch_model.sh [--dry-run]
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

only_dry_run "deploy/fetch_model.sh [--dry-run]" "$@"
: "${MLFLOW_TRACKING_URI:?set MLFLOW_TRACKING_URI, the MLflow server holding the registry}"
model_uri=${MODEL_URI:-models:/lmops@champion}
export_dir=${EXPORT_DIR:-production_service/model}

# Download the registered model, then copy its model directory into place atomically.
run python -c '
import sys, tempfile
from pathlib import Path
from lmops.runtime.model_dir import download, export
with tempfile.TemporaryDirectory() as tmp:
    export(download(sys.argv[1], Path(tmp)), Path(sys.argv[2]), model_uri=sys.argv[1])
' "$model_uri" "$export_dir"
dry_run || echo "$export_dir now holds $model_uri" >&2
