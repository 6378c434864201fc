"""The lmops pipeline on Kubeflow Pipelines (KFP v2).

Each step is one DVC stage, `lmops <stage>`, run in the lmops pipeline image (the Dockerfile's `pipeline` target); the data, the
tokenizer, the model and the metrics pass between steps as KFP artifacts. Train,
evaluate and promote share the MLflow tracking server given as the pipeline's
`mlflow_tracking_uri` (promote registers the model there as @champion).

    python kubeflow/pipeline.py compile [--image IMAGE] [--output FILE]
    python kubeflow/pipeline.py submit --host URL --package FILE [--namespace NS]
    python kubeflow/pipeline.py schedule --host URL --package FILE [--cron "0 0 2 * * *"]

kubeflow/pipeline.yaml is this file compiled with DEFAULT_IMAGE (a test fails
when it is stale: `make kfp-compile`). `make kfp-run KFP_HOST=...` compiles it
again with the pushed image and submits it (deploy/kubeflow.sh pipeline); `schedule`
makes it a recurring run instead (deploy/kubeflow.sh schedule), replacing the one of
the same name.
"""

# No `from __future__ import annotations`: KFP reads the artifact types at run time.
import argparse
import os
import sys

from kfp import compiler, dsl
from kfp.dsl import Artifact, Dataset, Input, Markdown, Model, Output

DEFAULT_IMAGE = (
    "lmops:dev-pipeline"  # the Dockerfile's pipeline target (deploy/kubeflow.sh passes the pushed one)
)

# Runs one stage in a fresh workspace: copy the image's params.yaml and each input
# artifact to the path the stage reads (--in PATH SRC), run the stage, copy each
# path it wrote to its output artifact (--out PATH DST).
RUN_STAGE = r"""set -eu
stage=$1
shift
cd "$(mktemp -d)"
cp "${LMOPS_APP:-/app}/params.yaml" .
outputs=""
while [ $# -gt 0 ]; do
  case $1 in
    --mlflow) export MLFLOW_TRACKING_URI="$2"; shift 2 ;;
    --in) mkdir -p "$(dirname "$2")"; cp -R "$3" "$2"; shift 3 ;;
    --out) outputs="$outputs $2=$3"; shift 3 ;;
    *) echo "run_stage: unknown argument $1" >&2; exit 2 ;;
  esac
done
lmops "$stage"
for pair in $outputs; do
  dst=${pair#*=}
  rm -rf "$dst"
  mkdir -p "$(dirname "$dst")"
  cp -R "${pair%%=*}" "$dst"
done
"""


def build_pipeline(image: str = DEFAULT_IMAGE):
    """The pipeline function, its steps running in `image`."""

    def stage(*args: str) -> dsl.ContainerSpec:
        return dsl.ContainerSpec(image=image, command=["sh", "-c", RUN_STAGE, "run_stage"], args=list(args))

    @dsl.container_component
    def get_data(raw: Output[Dataset]):
        return stage("get_data", "--out", "data/raw", raw.path)

    @dsl.container_component
    def split(raw: Input[Dataset], splits: Output[Dataset], report: Output[Artifact]):
        return stage(
            "split",
            "--in",
            "data/raw",
            raw.path,
            "--out",
            "data/processed",
            splits.path,
            "--out",
            "artifacts/data_report.json",
            report.path,
        )

    @dsl.container_component
    def tokenize(splits: Input[Dataset], tokens: Output[Dataset], tokenizer: Output[Artifact]):
        return stage(
            "tokenize",
            "--in",
            "data/processed",
            splits.path,
            "--out",
            "data/processed",
            tokens.path,
            "--out",
            "artifacts/tokenizer",
            tokenizer.path,
        )

    @dsl.container_component
    def train(
        mlflow_tracking_uri: str,
        raw: Input[Dataset],
        report: Input[Artifact],
        tokens: Input[Dataset],
        tokenizer: Input[Artifact],
        model: Output[Model],
    ):
        return stage(
            "train",
            "--mlflow",
            mlflow_tracking_uri,
            "--in",
            "data/raw",
            raw.path,
            "--in",
            "artifacts/data_report.json",
            report.path,
            "--in",
            "data/processed",
            tokens.path,
            "--in",
            "artifacts/tokenizer",
            tokenizer.path,
            "--out",
            "artifacts/model",
            model.path,
        )

    @dsl.container_component
    def evaluate(
        mlflow_tracking_uri: str,
        model: Input[Model],
        tokens: Input[Dataset],
        metrics: Output[Artifact],
        samples: Output[Markdown],
    ):
        return stage(
            "evaluate",
            "--mlflow",
            mlflow_tracking_uri,
            "--in",
            "artifacts/model",
            model.path,
            "--in",
            "data/processed",
            tokens.path,
            "--out",
            "artifacts/metrics.json",
            metrics.path,
            "--out",
            "artifacts/samples.md",
            samples.path,
        )

    @dsl.container_component
    def promote(
        mlflow_tracking_uri: str,
        model: Input[Model],
        metrics: Input[Artifact],
        tokens: Input[Dataset],
        promotion: Output[Artifact],
    ):
        return stage(
            "promote",
            "--mlflow",
            mlflow_tracking_uri,
            "--in",
            "artifacts/model",
            model.path,
            "--in",
            "artifacts/metrics.json",
            metrics.path,
            "--in",
            "data/processed",
            tokens.path,
            "--out",
            "artifacts/promotion.json",
            promotion.path,
        )

    @dsl.pipeline(name="lmops", description="corpus -> tokenizer -> model -> metrics -> MLflow @champion")
    def lmops_pipeline(mlflow_tracking_uri: str):
        raw = get_data().outputs["raw"]
        split_task = split(raw=raw)
        tok = tokenize(splits=split_task.outputs["splits"])
        trained = train(
            mlflow_tracking_uri=mlflow_tracking_uri,
            raw=raw,
            report=split_task.outputs["report"],
            tokens=tok.outputs["tokens"],
            tokenizer=tok.outputs["tokenizer"],
        )
        trained.set_cpu_request("2").set_memory_request("8G").set_memory_limit("8G")
        scored = evaluate(
            mlflow_tracking_uri=mlflow_tracking_uri,
            model=trained.outputs["model"],
            tokens=tok.outputs["tokens"],
        )
        promoted = promote(
            mlflow_tracking_uri=mlflow_tracking_uri,
            model=trained.outputs["model"],
            metrics=scored.outputs["metrics"],
            tokens=tok.outputs["tokens"],
        )
        # The decision depends on the registry's current champion, not only on the inputs.
        promoted.set_caching_options(False)

    return lmops_pipeline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="compile the pipeline to a YAML package")
    comp.add_argument("--image", default=DEFAULT_IMAGE, help="the lmops image every step runs in")
    comp.add_argument("--output", default="kubeflow/pipeline.yaml")
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
    schedule.add_argument(
        "--cron",
        default="0 0 2 * * *",
        help="KFP's six-field cron, seconds first (default: every night at 02:00)",
    )
    schedule.add_argument("--name", default="lmops-retrain", help="the recurring run's name")
    args = parser.parse_args(argv)

    if args.command == "compile":
        compiler.Compiler().compile(build_pipeline(args.image), args.output)
        print(f"compiled {args.output} (image {args.image})")
        return 0
    if not args.mlflow_tracking_uri:
        parser.error(f"{args.command} needs --mlflow-tracking-uri or MLFLOW_TRACKING_URI")
    from kfp.client import Client

    client = Client(host=args.host, namespace=args.namespace, existing_token=os.environ.get("KFP_TOKEN"))
    arguments = {"mlflow_tracking_uri": args.mlflow_tracking_uri}
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
