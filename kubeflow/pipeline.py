"""The lmops pipeline on Kubeflow Pipelines (KFP v2).

Each step is one DVC stage, `lmops <stage>`, run in the lmops pipeline image (the Dockerfile's `pipeline` target); the data, the
tokenizer, the model and the metrics pass between steps as KFP artifacts. The tokenize
stage runs as steps of the same code: the tokenizer (`--tokenizer-only`), then
TOKENIZE_PARTS encoders in parallel (`dsl.ParallelFor`, `--part K/N`: each a byte range of
every split), then `--merge` of their token directories into the one training reads. Train,
evaluate and promote share the MLflow tracking server given as the pipeline's
`mlflow_tracking_uri` (promote registers the model there as @champion).

The train step runs on Kubeflow Trainer v2: `lmops trainjob` (src/lmops/pipeline/trainjob.py)
copies its inputs onto the ReadWriteMany volume of kubeflow/trainjob.yaml (mounted at
/workspace), creates that file's TrainJob for the run (the image carries the file: one
definition of nodes and resources), waits for it and brings the model and the training
logs back. The cluster needs what `deploy/kubeflow.sh pipeline` applies first: the
runtime, the volume, the step's RBAC. `compile --train-in-pod` trains in the step's own
pod instead, for clusters without Trainer v2.

    python kubeflow/pipeline.py compile [--image IMAGE] [--output FILE] [--train-in-pod] [--sweep]
    python kubeflow/pipeline.py submit --host URL --package FILE [--namespace NS] [--sweep JSON]
    python kubeflow/pipeline.py schedule --host URL --package FILE [--cron "0 0 2 * * *"]

The sweep pipeline (`compile --sweep`, kubeflow/sweep.yaml) runs the same data steps once,
then a train step (a TrainJob each, SWEEP_PARALLELISM at a time) and an evaluate step per
item of its `sweep` input, a JSON list of params.yaml overrides
(`[{"train.muon_lr": 0.01}, ...]`, set in each step's params.yaml by `lmops params
--update`): the same grid as `dvc exp run --queue -S ...`, its runs side by side in the
MLflow experiment. It promotes nothing: promote the winner with the main pipeline.

kubeflow/pipeline.yaml and kubeflow/sweep.yaml are this file compiled with DEFAULT_IMAGE (a test fails
when it is stale: `make kfp-compile`). `make kfp-run KFP_HOST=...` compiles it
again with the pushed image and submits it (deploy/kubeflow.sh pipeline); `schedule`
makes it a recurring run instead (deploy/kubeflow.sh schedule), replacing the one of
the same name.
"""

# No `from __future__ import annotations`: KFP reads the artifact types at run time.
import argparse
import json
import os
import sys
from pathlib import Path

import yaml
from kfp import compiler, dsl, kubernetes
from kfp.dsl import Artifact, Dataset, Input, Markdown, Model, Output
from kfp.dsl.placeholders import InputListOfArtifactsPlaceholder

from lmops.pipeline import paths

DEFAULT_IMAGE = (
    "lmops:dev-pipeline"  # the Dockerfile's pipeline target (deploy/kubeflow.sh passes the pushed one)
)

TOKENIZE_PARTS = 4  # encoders the tokenize stage fans out to

# The grid `submit` gives the sweep pipeline without --sweep (the README's `dvc exp run
# --queue` example): each item is params.yaml keys to set, `lmops params --update` style.
# Not the package's default: KFP writes a default's dicts in hash order, so the compiled
# file would change from run to run. Its TrainJobs run SWEEP_PARALLELISM at a time.
DEFAULT_SWEEP = [
    {"train.muon_lr": lr, "train.lr_schedule": schedule}
    for lr in (3e-3, 1e-2, 3e-2)
    for schedule in ("cosine", "wsd")
]
SWEEP_PARALLELISM = 3

# Where each KFP artifact lies in a step's workspace, by the name every step gives it: a
# directory artifact carries all of dvc.yaml's deps and outs under it (a test checks that
# the steps of each stage stage in and export just that stage's deps and outs).
ARTIFACT_PATHS = {
    "raw": paths.RAW_DIR,
    "splits": paths.PROCESSED_DIR,
    "report": paths.DATA_REPORT_FILE,
    "data_metrics": paths.DATA_METRICS_FILE,
    "data_card": paths.DATA_CARD_FILE,
    "tokenizer": paths.TOKENIZER_DIR,
    "parts": paths.PROCESSED_DIR / "token-parts",  # the encoders' outputs, for the merge step only
    "tokens": paths.TOKENS_DIR,
    "model": paths.MODEL_DIR,
    "plots": paths.PLOTS_DIR,
    "metrics": paths.METRICS_FILE,
    "samples": paths.SAMPLES_FILE,
    "units": paths.UNITS_FILE.parent,
    "promotion": paths.PROMOTION_FILE,
    "promotion_metrics": paths.PROMOTION_METRICS_FILE,
    "promotion_slices": paths.PROMOTION_SLICES_FILE,
}

# The TrainJob the train step runs, as the pipeline image carries it (the Dockerfile copies
# it there), and the volume its pods share with the step, mounted where they mount it.
TRAINJOB_MANIFEST = Path(__file__).with_name("trainjob.yaml")
TRAINJOB_IN_IMAGE = "/app/kubeflow/trainjob.yaml"
WORKSPACE_VOLUME = next(
    d["metadata"]["name"]
    for d in yaml.safe_load_all(TRAINJOB_MANIFEST.read_text())
    if d["kind"] == "PersistentVolumeClaim"
)
WORKSPACE = "/workspace"

# The artifacts of a collected list to DEST/0, DEST/1, ...: their URIs, read from KFP's JSON,
# at the local paths the launcher mounts them on (gs:// -> /gcs/, minio:// -> /minio/, s3:// -> /s3/).
IN_LIST = r"""import json, shutil, sys
def uris(o):
    if isinstance(o, dict):
        for k, v in o.items():
            yield from [v] if k == "uri" and isinstance(v, str) else uris(v)
    elif isinstance(o, list):
        for v in o:
            yield from uris(v)
mounts = {"gs://": "/gcs/", "minio://": "/minio/", "s3://": "/s3/"}
for i, uri in enumerate(uris(json.loads(sys.argv[2]))):
    path = next((m + uri[len(s):] for s, m in mounts.items() if uri.startswith(s)), uri)
    shutil.copytree(path, f"{sys.argv[1]}/{i}")
"""

# Runs one stage in a fresh workspace: copy the image's params.yaml and each input
# artifact to the path the stage reads (--in PATH SRC; --in-list PATH LIST: each artifact
# of a collected list, as KFP's JSON names them, to PATH/<i>), set params.yaml's keys of
# --update JSON (a sweep's overrides, checked by `lmops params`), run the stage with its
# options (--arg A), copy each path it wrote to its output artifact (--out PATH DST).
RUN_STAGE = (
    f"set -eu\nIN_LIST='{IN_LIST}'\n"
    + r"""stage=$1
shift
cd "$(mktemp -d)"
cp "${LMOPS_APP:-/app}/params.yaml" .
outputs=""
options=""
while [ $# -gt 0 ]; do
  case $1 in
    --mlflow) export MLFLOW_TRACKING_URI="$2"; shift 2 ;;
    --in) mkdir -p "$(dirname "$2")"; cp -R "$3" "$2"; shift 3 ;;
    --in-list) python3 -c "$IN_LIST" "$2" "$3"; shift 3 ;;
    --update) lmops params --update "$2"; shift 2 ;;
    --arg) options="$options $2"; shift 2 ;;
    --out) outputs="$outputs $2=$3"; shift 3 ;;
    *) echo "run_stage: unknown argument $1" >&2; exit 2 ;;
  esac
done
lmops "$stage" $options
for pair in $outputs; do
  dst=${pair#*=}
  rm -rf "$dst"
  mkdir -p "$(dirname "$dst")"
  cp -R "${pair%%=*}" "$dst"
done
"""
)


def build_pipeline(image: str = DEFAULT_IMAGE, train_in_pod: bool = False, sweep: bool = False):
    """The pipeline function, its steps running in `image`; training on a TrainJob, or in
    the train step's pod with `train_in_pod`; with `sweep`, the sweep pipeline instead."""
    train_command = (
        ["train"] if train_in_pod else ["trainjob", "--image", image, "--manifest", TRAINJOB_IN_IMAGE]
    )

    def stage(
        command: list, ins: list = (), outs: list = (), mlflow=None, overrides=None
    ) -> dsl.ContainerSpec:
        """RUN_STAGE's arguments for `lmops *command`: the artifacts of `ins` (their `.path`, or
        a collected list) staged in and those of `outs` exported, each at its ARTIFACT_PATHS path
        (the components' signatures name the artifacts, so the paths are written once)."""
        name, *options = command
        args = [name, *(a for option in options for a in ("--arg", option))]
        if mlflow is not None:
            args += ["--mlflow", mlflow]
        if overrides is not None:
            args += ["--update", overrides]
        for artifact in ins:
            flag = "--in-list" if isinstance(artifact, InputListOfArtifactsPlaceholder) else "--in"
            args += [flag, str(ARTIFACT_PATHS[artifact.input_name]), artifact]
        for artifact in outs:
            args += ["--out", str(ARTIFACT_PATHS[artifact.output_name]), artifact]
        return dsl.ContainerSpec(image=image, command=["sh", "-c", RUN_STAGE, "run_stage"], args=args)

    @dsl.container_component
    def get_data(raw: Output[Dataset]):
        return stage(["get_data"], outs=[raw.path])

    @dsl.container_component
    def split(
        raw: Input[Dataset],
        splits: Output[Dataset],
        report: Output[Artifact],
        data_metrics: Output[Artifact],
        data_card: Output[Markdown],
    ):
        return stage(
            ["split"], ins=[raw.path], outs=[splits.path, report.path, data_metrics.path, data_card.path]
        )

    @dsl.container_component
    def train_tokenizer(splits: Input[Dataset], tokenizer: Output[Artifact]):
        return stage(["tokenize", "--tokenizer-only"], ins=[splits.path], outs=[tokenizer.path])

    @dsl.container_component
    def encode_part(part: int, splits: Input[Dataset], tokenizer: Input[Artifact], tokens: Output[Dataset]):
        part_of = dsl.ConcatPlaceholder([part, f"/{TOKENIZE_PARTS}"])
        return stage(["tokenize", "--part", part_of], ins=[splits.path, tokenizer.path], outs=[tokens.path])

    @dsl.container_component
    def merge_tokens(parts: Input[list[Dataset]], tokens: Output[Dataset]):
        return stage(["tokenize", "--merge", str(ARTIFACT_PATHS["parts"])], ins=[parts], outs=[tokens.path])

    @dsl.container_component
    def train(
        mlflow_tracking_uri: str,
        raw: Input[Dataset],
        report: Input[Artifact],
        tokens: Input[Dataset],
        tokenizer: Input[Artifact],
        model: Output[Model],
        plots: Output[Artifact],
        overrides: dict = {},  # noqa: B006 (KFP's default for the parameter: the body runs at compile time)
    ):
        return stage(
            train_command,
            ins=[raw.path, report.path, tokens.path, tokenizer.path],
            outs=[model.path, plots.path],
            mlflow=mlflow_tracking_uri,
            overrides=overrides,
        )

    @dsl.container_component
    def evaluate(
        model: Input[Model],
        splits: Input[Dataset],
        mlflow_tracking_uri: str,
        metrics: Output[Artifact],
        samples: Output[Markdown],
        units: Output[Dataset],
        overrides: dict = {},  # noqa: B006 (KFP's default for the parameter: the body runs at compile time)
    ):
        return stage(
            ["evaluate"],
            ins=[model.path, splits.path],
            outs=[metrics.path, samples.path, units.path],
            mlflow=mlflow_tracking_uri,
            overrides=overrides,
        )

    @dsl.container_component
    def promote(
        mlflow_tracking_uri: str,
        model: Input[Model],
        metrics: Input[Artifact],
        units: Input[Dataset],
        splits: Input[Dataset],
        raw: Input[Dataset],
        promotion: Output[Artifact],
        promotion_metrics: Output[Artifact],
        promotion_slices: Output[Artifact],
    ):
        return stage(
            ["promote"],
            ins=[model.path, metrics.path, units.path, splits.path, raw.path],
            outs=[promotion.path, promotion_metrics.path, promotion_slices.path],
            mlflow=mlflow_tracking_uri,
        )

    def tokenized():
        """The data steps both pipelines share: corpus, split, tokenizer, tokens in parallel."""
        raw = get_data().outputs["raw"]
        split_task = split(raw=raw)
        splits = split_task.outputs["splits"]
        tokenizer = train_tokenizer(splits=splits).outputs["tokenizer"]
        with dsl.ParallelFor(items=list(range(TOKENIZE_PARTS)), parallelism=TOKENIZE_PARTS) as part:
            encoded = encode_part(part=part, splits=splits, tokenizer=tokenizer)
        tokens = merge_tokens(parts=dsl.Collected(encoded.outputs["tokens"])).outputs["tokens"]
        return raw, split_task.outputs["report"], splits, tokenizer, tokens

    def trained_and_scored(mlflow_tracking_uri, data, overrides=None):
        raw, report, splits, tokenizer, tokens = data
        given = {} if overrides is None else {"overrides": overrides}
        trained = train(
            mlflow_tracking_uri=mlflow_tracking_uri,
            raw=raw,
            report=report,
            tokens=tokens,
            tokenizer=tokenizer,
            **given,
        )
        if train_in_pod:
            trained.set_cpu_request("2").set_memory_request("8G").set_memory_limit("8G")
        else:  # the TrainJob's pods do the work, with the resources of kubeflow/trainjob.yaml
            kubernetes.mount_pvc(trained, pvc_name=WORKSPACE_VOLUME, mount_path=WORKSPACE)
        scored = evaluate(
            mlflow_tracking_uri=mlflow_tracking_uri, model=trained.outputs["model"], splits=splits, **given
        )
        return trained, scored

    @dsl.pipeline(name="lmops", description="corpus -> tokenizer -> model -> metrics -> MLflow @champion")
    def lmops_pipeline(mlflow_tracking_uri: str):
        data = tokenized()
        trained, scored = trained_and_scored(mlflow_tracking_uri, data)
        raw, _, splits, _, _ = data
        promoted = promote(
            mlflow_tracking_uri=mlflow_tracking_uri,
            model=trained.outputs["model"],
            metrics=scored.outputs["metrics"],
            units=scored.outputs["units"],
            splits=splits,
            raw=raw,
        )
        # The decision depends on the registry's current champion, not only on the inputs.
        promoted.set_caching_options(False)

    @dsl.pipeline(
        name="lmops-sweep",
        description="one tokenized corpus -> a model per params override, trained in parallel -> MLflow runs",
    )
    def lmops_sweep(mlflow_tracking_uri: str, sweep: list):
        data = tokenized()
        with dsl.ParallelFor(items=sweep, parallelism=SWEEP_PARALLELISM) as overrides:
            trained_and_scored(mlflow_tracking_uri, data, overrides)

    return lmops_sweep if sweep else lmops_pipeline


def sweep_items(text: str) -> str:
    """--sweep: a JSON list of objects of params.yaml keys (each checked again by its steps)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not (isinstance(items, list) and items and all(isinstance(i, dict) and i for i in items)):
        raise argparse.ArgumentTypeError('expected a list of objects, e.g. [{"train.muon_lr": 0.01}]')
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="compile the pipeline to a YAML package")
    comp.add_argument("--image", default=DEFAULT_IMAGE, help="the lmops image every step runs in")
    comp.add_argument("--output", help="default: kubeflow/pipeline.yaml, or kubeflow/sweep.yaml with --sweep")
    comp.add_argument(
        "--sweep", action="store_true", help="the sweep pipeline: a TrainJob per item of its `sweep` input"
    )
    comp.add_argument(
        "--train-in-pod",
        action="store_true",
        help="train in the train step's pod, not on a TrainJob (clusters without Trainer v2)",
    )
    run = sub.add_parser("submit", help="start a run of a compiled package on a KFP server")
    schedule = sub.add_parser("schedule", help="create or replace a recurring run of a compiled package")
    for command in (run, schedule):
        command.add_argument(
            "--host", required=True, help="KFP API endpoint, e.g. https://kubeflow.example.com/pipeline"
        )
        command.add_argument("--package", required=True)
        command.add_argument(
            "--namespace",
            default=os.environ.get("KUBEFLOW_NAMESPACE"),
            help="Kubeflow profile namespace (multi-user installs)",
        )
        command.add_argument("--experiment", default="lmops")
        command.add_argument(
            "--mlflow-tracking-uri",
            default=os.environ.get("MLFLOW_TRACKING_URI"),
            help="MLflow server reachable from the cluster (default: $MLFLOW_TRACKING_URI)",
        )
    run.add_argument(
        "--sweep",
        metavar="JSON",
        type=sweep_items,
        help='the sweep package\'s grid, e.g. \'[{"train.muon_lr": 0.01}, {"train.muon_lr": 0.03}]\' '
        "(default: DEFAULT_SWEEP)",
    )
    schedule.add_argument(
        "--cron",
        default="0 0 2 * * *",
        help="KFP's six-field cron, seconds first (default: every night at 02:00)",
    )
    schedule.add_argument("--name", default="lmops-retrain", help="the recurring run's name")
    args = parser.parse_args(argv)

    if args.command == "compile":
        output = args.output or f"kubeflow/{'sweep' if args.sweep else 'pipeline'}.yaml"
        compiler.Compiler().compile(build_pipeline(args.image, args.train_in_pod, args.sweep), output)
        where = "in its pod" if args.train_in_pod else "on a TrainJob"
        print(f"compiled {output} (image {args.image}, training {where})")
        return 0
    if not args.mlflow_tracking_uri:
        parser.error(f"{args.command} needs --mlflow-tracking-uri or MLFLOW_TRACKING_URI")
    arguments = {"mlflow_tracking_uri": args.mlflow_tracking_uri}
    if args.command == "submit":
        try:
            inputs = next(yaml.safe_load_all(Path(args.package).read_text()))["root"]["inputDefinitions"]
        except (OSError, yaml.YAMLError, StopIteration, KeyError, TypeError) as exc:
            parser.error(f"--package {args.package}: not a compiled pipeline ({exc!r})")
        if "sweep" in inputs["parameters"]:
            arguments["sweep"] = json.loads(args.sweep) if args.sweep else DEFAULT_SWEEP
        elif args.sweep:
            parser.error(f"--sweep: {args.package} is not the sweep pipeline (compile --sweep)")
    from kfp.client import Client

    client = Client(host=args.host, namespace=args.namespace, existing_token=os.environ.get("KFP_TOKEN"))
    if args.command == "schedule":
        # create_experiment returns the existing experiment of that name.
        experiment = client.create_experiment(args.experiment, namespace=args.namespace)
        listed = client.list_recurring_runs(
            experiment_id=experiment.experiment_id, namespace=args.namespace, page_size=100
        )
        for old in listed.recurring_runs or []:
            if old.display_name == args.name:
                client.delete_recurring_run(old.recurring_run_id)
                print(f"replaced recurring run {old.recurring_run_id}")
        job = client.create_recurring_run(
            experiment.experiment_id,
            args.name,
            cron_expression=args.cron,
            params=arguments,
            pipeline_package_path=args.package,
            max_concurrency=1,
            no_catchup=True,
        )
        print(f"recurring run {job.recurring_run_id}: {args.name} at cron {args.cron!r}")
        return 0
    result = client.create_run_from_pipeline_package(
        args.package,
        arguments=arguments,
        experiment_name=args.experiment,
        namespace=args.namespace,
    )
    print(f"started run {result.run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
