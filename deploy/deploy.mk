# Shipping targets, included by the root Makefile. Docs: docs/deploy.md.
# The scripts read CLOUD (aks|eks|kubeflow), GPU=1, IMAGE_TAG and DRY_RUN=1 from
# the command line or the environment, e.g. `make deploy CLOUD=eks GPU=1 DRY_RUN=1`.
# Their offline tools (kubectl, hadolint, shellcheck, validators, kfp) come from
# requirements-dev.lock through `make install`.

.PHONY: image image-tools image-test image-push deploy smoke-test kfp-compile kfp-run kfp-sweep

image: install ## docker build lmops:<commit> (GPU=1: the CUDA variant)
	deploy/build_image.sh

image-tools: ## apt-get the tools image-test needs: debootstrap, and podman + runc without a docker engine
	@tools=debootstrap; docker info >/dev/null 2>&1 || tools="$$tools podman runc"; \
	missing=$$(for tool in $$tools; do command -v $$tool >/dev/null || echo $$tool; done); \
	if [ -n "$$missing" ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 \
	    install -y -qq --no-install-recommends $$missing; \
	fi

image-test: install image-tools ## build the CPU image and serve from it as production does (deploy/image_test.sh)
	deploy/image_test.sh

image-push: install ## push the image to ACR or ECR (CLOUD=aks|eks|kubeflow)
	deploy/push_image.sh

deploy: install ## deploy to AKS or EKS and wait for the rollout (CLOUD=aks|eks, GPU=1, CANARY=1 or GATEWAY=1)
	deploy/deploy.sh

smoke-test: install ## curl /health and /v1/completions (URL=http://... or the cluster's LoadBalancer)
	deploy/smoke_test.sh $(URL)

kfp-compile: install ## recompile kubeflow/pipeline.yaml and kubeflow/sweep.yaml from kubeflow/pipeline.py
	$(BIN)/python kubeflow/pipeline.py compile --output kubeflow/pipeline.yaml
	$(BIN)/python kubeflow/pipeline.py compile --sweep --output kubeflow/sweep.yaml

kfp-run: install ## start the Kubeflow pipeline: make kfp-run KFP_HOST=https://... [IMAGE=...]
	deploy/kubeflow.sh pipeline

kfp-sweep: install ## a model per params override as parallel TrainJobs: make kfp-sweep KFP_HOST=... [KFP_SWEEP='[{"train.muon_lr": 0.01}]']
	deploy/kubeflow.sh sweep
