# Shipping targets, included by the root Makefile. Docs: docs/deploy.md.
# The scripts read CLOUD (aks|eks|kubeflow), GPU=1, IMAGE_TAG and DRY_RUN=1 from
# the command line or the environment, e.g. `make deploy CLOUD=eks GPU=1 DRY_RUN=1`.
# Their offline tools (kubectl, hadolint, shellcheck, validators, kfp) come from
# requirements-dev.lock through `make install`.

.PHONY: image image-push deploy smoke-test kfp-compile kfp-run

image: install ## docker build lmops:<commit> (GPU=1: the CUDA variant)
	deploy/build_image.sh

image-push: install ## push the image to ACR or ECR (CLOUD=aks|eks|kubeflow)
	deploy/push_image.sh

deploy: install ## deploy to AKS or EKS and wait for the rollout (CLOUD=aks|eks, GPU=1, CANARY=1)
	deploy/deploy.sh

smoke-test: install ## curl /health and /v1/completions (URL=http://... or the cluster's LoadBalancer)
	deploy/smoke_test.sh $(URL)

kfp-compile: install ## recompile kubeflow/pipeline.yaml from kubeflow/pipeline.py
	$(BIN)/python kubeflow/pipeline.py compile --output kubeflow/pipeline.yaml

kfp-run: install ## start the Kubeflow pipeline: make kfp-run KFP_HOST=https://... [IMAGE=...]
	deploy/kubeflow.sh pipeline
