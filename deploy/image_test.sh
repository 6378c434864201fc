#!/usr/bin/env bash
# Build the CPU image and run it as production does (its own user, read-only root
# filesystem, a tmpfs /tmp, the port published on 127.0.0.1), twice: with a model
# baked in, decoding compiled (the image's g++ compiles it at start), then with another
# one mounted read-only, decoding eagerly (LMOPS_COMPILE=0). Each time: deploy/smoke_test.sh,
# a completion and a streamed one with the openai client, then SIGTERM: the
# container must exit 0 within the grace period. `make image-test` runs it (CI too).
#
#   [IMAGE_TEST_MODEL=dir] [PYTHON=system|managed] [TORCH_INDEX=url] deploy/image_test.sh
#
# The model is a tiny random one (tests/conftest.py), or IMAGE_TEST_MODEL's copy,
# exported as `lmops promote` exports (lmops.runtime.model_dir.export).
# The engine is docker when its daemon answers, else podman (rootful, runc: crun
# fails on hybrid cgroup hosts; explicit ulimits, as there is no CAP_SYS_RESOURCE).
#
# Offline stand-ins, made here when missing (no registry for base images needed):
# - the Dockerfile's debian base: debootstrap minbase bookworm plus python3.11, the
#   interpreter PYTHON=system (the default here) uses; PYTHON=managed downloads one;
# - its uv image: the uv wheel of the same version from the package index;
# - pip's configuration on this machine (index URLs, find-links, CA bundle) goes to
#   the build as secrets, and the local folders it names as read-only build mounts
#   (podman only); none of it stays in the image. TORCH_INDEX is then empty (the
#   configuration offers torch's +cpu wheel) unless set.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

[ $# -eq 0 ] || die "usage: deploy/image_test.sh (settings come from the environment)"
GRACE=45 # the pods' terminationGracePeriodSeconds; gunicorn's graceful timeout is 30 s
READY_TIMEOUT=300 # as the startupProbe (k8s-deployment.yml): a first start compiles decode
export IMAGE_TAG="image-test"
image=lmops:$IMAGE_TAG
containers=()
compile_cache=""
cleanup() {
  local container
  for container in "${containers[@]}"; do $engine rm --force "$container" >/dev/null 2>&1 || true; done
  if [ -n "$compile_cache" ]; then $engine volume rm --force "$compile_cache" >/dev/null 2>&1 || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

if docker info >/dev/null 2>&1; then
  engine=docker
else
  engine=podman
  command -v podman >/dev/null || die "neither a docker engine nor podman: run \`make image-tools\`"
  printf '[engine]\nruntime = "runc"\n' >"$WORK/containers.conf"
  export CONTAINERS_CONF="$WORK/containers.conf"
fi
ulimits=(--ulimit nofile=20000:20000 --ulimit nproc=32768:32768)
echo "image-test: using $engine" >&2

# from_image STAGE: the image the Dockerfile's stage STAGE starts from.
from_image() {
  awk -v stage="$1" 'toupper($1) == "FROM" && toupper($3) == "AS" && $4 == stage { print $2 }' Dockerfile
}

# import_rootfs DIR NAME: DIR's files as the image NAME.
import_rootfs() {
  tar --numeric-owner -C "$1" -c . | $engine import - "$2" >"$WORK/import.log" 2>&1 ||
    { cat "$WORK/import.log" >&2 && die "could not import $2"; }
  echo "image-test: made the stand-in $2" >&2
}

debian=$(from_image base-cpu)
if ! $engine image inspect "$debian" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || die "no $debian and no debootstrap: run \`make image-tools\`"
  # python3.11-venv's dependencies are named too: debootstrap does not resolve them.
  python=python3.11,python3.11-venv,python3-distutils,python3-pip-whl,python3-setuptools-whl
  debootstrap --variant=minbase --include="$python" bookworm "$WORK/rootfs" \
    "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$WORK/debootstrap.log" 2>&1 ||
    { tail -20 "$WORK/debootstrap.log" >&2 && die "debootstrap failed"; }
  # What the slim image leaves out too: documentation, manuals, translations, apt's caches.
  (cd "$WORK/rootfs" && rm -rf usr/share/doc/* usr/share/man/* usr/share/info/* usr/share/locale/* \
    var/cache/apt/* var/lib/apt/lists/*)
  import_rootfs "$WORK/rootfs" "$debian"
  rm -rf "$WORK/rootfs"
fi
uv=$(from_image uv)
if ! $engine image inspect "$uv" >/dev/null 2>&1; then
  python -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
    --dest "$WORK/uv-wheel" "uv==${uv##*:}"
  mkdir "$WORK/uv"
  python - "$WORK"/uv-wheel/uv-*.whl "$WORK/uv" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    for name in wheel.namelist():
        if name.endswith((".data/scripts/uv", ".data/scripts/uvx")):
            target = os.path.join(sys.argv[2], os.path.basename(name))
            with open(target, "wb") as out:
                out.write(wheel.read(name))
            os.chmod(target, 0o755)
PY
  import_rootfs "$WORK/uv" "$uv"
fi

# pip's configuration here, for the build: pip.conf and the CA bundle as secrets.
build_opts=(--pull=false "${ulimits[@]}" --build-arg "PYTHON=${PYTHON:-system}")
python - "$WORK/pip.conf" >"$WORK/local-paths" <<'PY'
"""Write the index settings of `pip config list` (environment last, so it wins) as a
pip.conf naming the CA bundle where the build's secret puts it; print the local
folders it needs, and the CA bundle's path on the last line."""
import os, re, subprocess, sys
listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True)
settings = {}
for line in sorted(listing.stdout.splitlines(), key=lambda line: line.startswith(":env:")):
    match = re.match(r"^(?:global|install|:env:)\.([\w-]+)='(.*)'$", line)
    if match and match[1] in ("index-url", "extra-index-url", "find-links", "cert"):
        settings[match[1]] = match[2]
cert = settings.pop("cert", "")
if cert:
    settings["cert"] = "/run/secrets/ca.crt"
with open(sys.argv[1], "w") as conf:
    conf.write("[global]\n" + "".join(f"{key} = {value}\n" for key, value in settings.items()))
for key in ("index-url", "extra-index-url", "find-links"):
    for value in settings.get(key, "").split():
        path = value.removeprefix("file://")
        if path.startswith("/"):  # an index's files usually lie beside it: mount its parent
            print(path if key == "find-links" else os.path.dirname(path.rstrip("/")))
print(cert)
PY
cert=$(tail -1 "$WORK/local-paths")
if [ "$(wc -c <"$WORK/pip.conf")" -gt 9 ]; then # more than "[global]\n"
  build_opts+=(--secret "id=pip.conf,src=$WORK/pip.conf" --build-arg "TORCH_INDEX=${TORCH_INDEX-}")
  if [ -n "$cert" ]; then build_opts+=(--secret "id=ca.crt,src=$cert"); fi
  while read -r path; do
    [ -e "$path" ] && [ "$path" != "$cert" ] || continue
    if [ "$engine" = podman ]; then
      build_opts+=(--volume "$path:$path:ro")
    else
      echo "warning: docker build cannot read $path (pip's configuration names it): use an HTTP mirror" >&2
    fi
  done <"$WORK/local-paths"
elif [ -n "${TORCH_INDEX+set}" ]; then
  build_opts+=(--build-arg "TORCH_INDEX=$TORCH_INDEX")
fi

# The build context: the working tree as git sees it, plus a model to bake in.
make_model() { # make_model DIR NAME: exported the way promote exports, served as NAME
  python - "$1" "$2" "${IMAGE_TEST_MODEL:-}" <<'PY'
import sys, tempfile
from pathlib import Path
from lmops.runtime.model_dir import export
from tests.conftest import make_tiny_model_dir
target, name, source = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
with tempfile.TemporaryDirectory() as tmp:
    export(Path(source) if source else make_tiny_model_dir(Path(tmp)), target, model_name=name)
PY
}
context="$WORK/context"
mkdir "$context"
git ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d '' file; do [ ! -e "$file" ] || printf '%s\0' "$file"; done |
  tar --null -T - -c | tar -x -C "$context"
make_model "$context/production_service/model" lmops-baked
make_model "$WORK/mounted-model" lmops-mounted

started=$SECONDS
CONTAINER_ENGINE=$engine CONTEXT=$context deploy/build_image.sh -- "${build_opts[@]}"
echo "image-test: built $image in $((SECONDS - started)) s," \
  "$($engine image inspect --format '{{.Size}}' "$image" | awk '{printf "%.2f GB", $1 / 1e9}')" >&2

# serve NAME DECODE [RUN-OPTION...]: run the image as production does, smoke-test it, stop
# it. DECODE: compiled (inductor, with the image's g++, at the first start), loaded (every
# graph from the compile cache) or eager.
serve() {
  local name=$1 decode=$2 container port ready_ms state
  shift 2
  container=lmops-image-test-$$-$name-$decode
  port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  containers+=("$container")
  local t0
  t0=$(date +%s%N)
  $engine run --detach --name "$container" --read-only --tmpfs /tmp:rw,mode=1777 \
    --publish "127.0.0.1:$port:5001" "${ulimits[@]}" "$@" "$image" >/dev/null
  until curl --silent --fail --max-time 2 "http://127.0.0.1:$port/ready" >/dev/null; do
    if [ "$($engine inspect --format '{{.State.Running}}' "$container")" != true ] ||
      [ $(($(date +%s%N) - t0)) -gt $((READY_TIMEOUT * 1000000000)) ]; then
      $engine logs "$container" >&2
      die "$name: the container did not get ready"
    fi
    sleep 0.1
  done
  ready_ms=$((($(date +%s%N) - t0) / 1000000))
  echo "image-test: $name: ready $ready_ms ms after \`$engine run\`" >&2
  [ "$($engine exec "$container" id -u)" = 10001 ] || die "$name: the service does not run as user 10001"
  # gunicorn's master and worker, each with tcmalloc mapped (the image's LD_PRELOAD).
  $engine exec "$container" python -c '
import glob, os, sys
from pathlib import Path
procs = [Path(c).parent for c in glob.glob("/proc/[0-9]*/cmdline") if b"gunicorn" in Path(c).read_bytes()]
procs = [p for p in procs if p.name != str(os.getpid())]  # (this script names gunicorn too)
sys.exit(len(procs) < 2 or not all("libtcmalloc" in (p / "maps").read_text() for p in procs))' ||
    die "$name: gunicorn does not run on tcmalloc (the image's LD_PRELOAD)"
  if [ "$decode" = compiled ]; then
    $engine logs "$container" 2>&1 | grep -E "compiled decode in .*, [1-9][0-9]* compiled\)" >&2 ||
      { $engine logs "$container" >&2 && die "$name: the service did not compile its decode graphs"; }
  elif [ "$decode" = loaded ]; then
    $engine logs "$container" 2>&1 | grep -E "compiled decode in .*, 0 compiled\)" >&2 ||
      { $engine logs "$container" >&2 && die "$name: the service did not load every decode graph from the cache"; }
  else
    ! $engine logs "$container" 2>&1 | grep -E "compil(ed|ing) decode" >&2 || die "$name: the service compiled"
  fi
  # Where the CPU has AVX2 and FMA, the image's g++ builds lmops' kernels (engine/kernels.py).
  if [ "$decode" != eager ] && grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
    $engine logs "$container" 2>&1 | grep -F "few-row products and attention through lmops' kernels" >&2 ||
      { $engine logs "$container" >&2 && die "$name: the service did not build or load lmops' kernels"; }
  fi
  deploy/smoke_test.sh "http://127.0.0.1:$port"
  python - "http://127.0.0.1:$port/v1" "lmops-$name" <<'PY'
import sys
import openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=60)
models = [m.id for m in client.models.list().data]
assert models == [sys.argv[2]], f"serving {models}, not {sys.argv[2]}"
done = client.completions.create(model=sys.argv[2], prompt="def ", max_tokens=16, temperature=0)
assert done.choices[0].finish_reason in ("length", "stop") and done.usage.completion_tokens > 0, done
chunks = list(client.completions.create(model=sys.argv[2], prompt="def ", max_tokens=16, temperature=0, stream=True))
assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text, "stream and completion differ"
assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason, chunks[-1]
print(f"openai client: {done.choices[0].text!r}, streamed in {len(chunks)} chunks")
PY
  t0=$SECONDS
  $engine stop --time "$GRACE" "$container" >/dev/null
  state=$($engine inspect --format '{{.State.ExitCode}}' "$container")
  $engine logs "$container" >"$WORK/$name.log" 2>&1
  [ "$state" = 0 ] || { cat "$WORK/$name.log" >&2 && die "$name: exit status $state after SIGTERM"; }
  [ $((SECONDS - t0)) -lt "$GRACE" ] || die "$name: took $((SECONDS - t0)) s to stop (grace period: $GRACE s)"
  echo "image-test: $name: stopped with status 0 in $((SECONDS - t0)) s" >&2
}

# LMOPS_MODEL_URI needs only the skinny MLflow client: resolving one asks the registry
# (none here: refused) and fails with the service's one-line error, not an ImportError.
$engine run --rm --read-only --tmpfs /tmp "${ulimits[@]}" --env MLFLOW_TRACKING_URI=http://127.0.0.1:9 \
  --env MLFLOW_HTTP_REQUEST_MAX_RETRIES=0 "$image" python -c '
from pathlib import Path
from lmops.errors import LmopsError
from production_service.model_source import resolve_model
try:
    resolve_model(Path("/nonexistent"), "models:/lmops@champion")
except LmopsError as exc:
    print("image-test: LMOPS_MODEL_URI reaches the registry:", str(exc)[:100])
else:
    raise SystemExit("resolved a model without a registry")
' 2>&1 | grep -v systemd >&2

# The serving image carries the runtime half of lmops only (docs/architecture.md: two halves).
$engine run --rm --read-only "${ulimits[@]}" "$image" python -c '
import importlib.util, shutil
assert importlib.util.find_spec("lmops.runtime.engine"), "no runtime in the serving image"
for absent in ("lmops.pipeline", "dvc", "transformers", "pandas"):
    assert importlib.util.find_spec(absent) is None, f"the serving image carries {absent}"
assert shutil.which("lmops") is None, "the serving image has the pipeline command"
print("image-test: the serving image holds the runtime half only")
'

# Compiled for one sequence (LMOPS_MAX_NUM_SEQS=1): its step and multi-step runs and the
# draw, what a lone request decodes through, in 4 graphs of the 8 a default engine compiles
# at start, since .ci/run builds and serves this image beside the test suite, on the same
# cores. Into a compile cache on a named volume at /var/cache/lmops, as compose mounts it
# (the volume starts as the image's directory, the service user's) and as the CPU overlays
# mount their shared claim (deploy/compile-cache): the first container compiles, the second
# (another replica on the same volume) loads every graph.
compile_cache=lmops-image-test-$$-compile-cache
$engine volume create "$compile_cache" >/dev/null
shared_cache=(--volume "$compile_cache:/var/cache/lmops" --env TORCHINDUCTOR_CACHE_DIR=/var/cache/lmops/inductor)
serve baked compiled --env LMOPS_MAX_NUM_SEQS=1 "${shared_cache[@]}"
serve baked loaded --env LMOPS_MAX_NUM_SEQS=1 "${shared_cache[@]}"
serve mounted eager --env LMOPS_COMPILE=0 --cpus 1 --volume "$WORK/mounted-model:/app/production_service/model:ro"
# A CPU quota (--cpus 1) of fewer CPUs than the container sees sets torch's threads
# (gunicorn.conf.py: production_service.server.thread_env).
grep -q ", 1 CPU threads" "$WORK/mounted.log" ||
  { cat "$WORK/mounted.log" >&2 && die "mounted: torch does not follow the container's CPU quota"; }

# The pipeline target (Kubeflow's steps): the whole lmops and its command, as user 10001,
# and the train step's launcher with the TrainJob it carries (a dry run: no cluster).
started=$SECONDS
IMAGE_TARGET=pipeline CONTAINER_ENGINE=$engine CONTEXT=$context deploy/build_image.sh -- "${build_opts[@]}"
pipeline_image="lmops:$(IMAGE_TARGET=pipeline image_tag)"
echo "image-test: built $pipeline_image in $((SECONDS - started)) s" >&2
# shellcheck disable=SC2016 # expanded by the container's shell, not this one
$engine run --rm --read-only --tmpfs /tmp:rw,mode=1777 "${ulimits[@]}" "$pipeline_image" sh -c '
  test "$(id -u)" = 10001 && lmops --help >/dev/null &&
  python -c "import dvc, mlflow, lmops.pipeline.train, lmops.pipeline.promote" &&
  lmops trainjob --image lmops:x --manifest /app/kubeflow/trainjob.yaml --dry-run | grep -q "^kind: TrainJob$" &&
  echo "image-test: the pipeline image runs lmops as user $(id -u), and its TrainJob launcher"'
echo "image-test passed: $image and $pipeline_image (built and run by $engine)" >&2
