"""The model card (README.md of an exported model) and the data card (artifacts/data_card.md).

The model card is Hugging Face's: a YAML metadata block (`model-index` with the test
metrics, the corpus by its sha256) that the Hub and `huggingface_hub.ModelCard` read,
then what a reader of the served model needs: its shape, data, training params, test
numbers, the promotion gate's evidence, and its limits. Promotion writes it into the
export and sets it (without the metadata block) as the registry version's description.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import yaml

from lmops.runtime.model_dir import ModelMeta

MODEL_CARD_FILE = "README.md"
EVIDENCE_TAG = "promotion_evidence"  # the model version tag holding the gate's evidence (JSON)
# MLflow's SQL stores keep a model version's description in a VARCHAR(5000).
DESCRIPTION_LIMIT = 5000

INTENDED_USE = """\
A small base language model trained from scratch on the corpus above: it continues text
like that corpus (completion, not conversation).

- Not instruction-tuned: it does not follow instructions or hold a dialogue.
- No safety tuning or output filtering: it can produce wrong, insecure or offensive text.
- Small and trained on one corpus: expect it to fail on text unlike that corpus, and
  evaluate it on your own data before relying on it.
"""


def model_card(meta: ModelMeta, params: dict, evidence: dict | None, data_report: dict | None) -> str:
    """The card of an exported model: `meta` its lmops.json, `params` the training run's params
    as MLflow holds them ("section.key" -> string), `evidence` the promotion gate's (None when
    it recorded none: older versions, forced promotions), `data_report` the split's report."""
    report = data_report or {}
    name = meta.model_name or "lmops"
    title = f"{name} v{meta.model_version}" if meta.model_version is not None else name
    test = {k.removeprefix("test_"): v for k, v in meta.metrics.items() if _is_test_number(k, v)}
    layout = "Qwen3" if params.get("model.qk_norm") == "True" else "Llama"
    sections = [
        f"# {title}",
        "\n".join(
            f"- {label}: `{value}`"
            for label, value in (
                ("MLflow run", meta.run_id),
                ("git commit", meta.git_commit),
                ("weights sha256", meta.weights_sha256),
                ("stopped because", meta.stop_reason),
            )
            if value is not None
        ),
        f"## Model\n\nA decoder-only transformer in Hugging Face's {layout} layout (`transformers` "
        "loads this directory as it is)."
        + (f" {meta.num_params:,} parameters." if meta.num_params is not None else "")
        + "\n\n"
        + _table(("param", "value"), _section(params, "model")),
        "## Training data\n\n" + _data_summary(meta, report),
        "## Training params\n\n"
        + _table(("param", "value"), [*_section(params, "train"), *_section(params, "")])
        + _training_metrics(meta),
        "## Evaluation\n\n" + _evaluation(meta, test),
        "## Promotion evidence\n\n" + _evidence(evidence),
        "## Intended use and limits\n\n" + INTENDED_USE,
    ]
    front = yaml.safe_dump(_metadata(name, layout.lower(), meta, report, test), sort_keys=False)
    return f"---\n{front}---\n\n" + "\n\n".join(s.strip() for s in sections if s) + "\n"


def read_evidence(tags: dict) -> dict | None:
    """The gate's evidence from a model version's tags; None when it has none, or none that
    parses (a hand-edited tag, or one cut at MLflow's tag limit)."""
    try:
        evidence = json.loads(tags[EVIDENCE_TAG])
    except (KeyError, ValueError):
        return None
    return evidence if isinstance(evidence, dict) else None


def mlflow_description(card: str) -> str:
    """The card as a registry description: its markdown without the metadata block (which
    the MLflow UI would render as text), within what MLflow's SQL stores hold."""
    body = card.split("\n---\n", 1)[1].lstrip() if card.startswith("---\n") else card
    if len(body) <= DESCRIPTION_LIMIT:
        return body
    note = f"\n\n(cut: the whole card is the exported model's {MODEL_CARD_FILE})\n"
    return body[: DESCRIPTION_LIMIT - len(note)] + note


def data_card(report: dict) -> str:
    """The split's data report (artifacts/data_report.json) as a markdown card to read."""
    split = report.get("split", {})
    method = f"`{split.get('method')}`" + (f", seed {split['seed']}" if "seed" in split else "")
    sizes = report.get("document_bytes", {})
    rows = [
        ("source", report.get("source")),
        ("sha256", report.get("sha256")),
        ("document unit", report.get("document_unit")),
        ("files", report.get("files")),
        ("documents", report.get("documents")),
        ("bytes", report.get("bytes")),
        ("empty documents dropped", report.get("empty_documents_dropped")),
        ("undecodable sequences replaced", report.get("undecodable_sequences_replaced")),
        ("capped at data.max_bytes", report.get("capped_at_max_bytes")),
        ("exact duplicates merged", report.get("duplicates_merged")),
        ("copies dropped from a later split", report.get("duplicates_dropped")),
    ]
    warnings = [*report.get("warnings", []), *_derived_warnings(report)]
    return (
        "# Data card\n\nThe corpus the pipeline trains on, as `lmops split` saw it "
        "(artifacts/data_report.json).\n\n"
        + _table(("", ""), rows)
        + f"\n\n## Splits\n\nBy whole documents, method {method}; exact copies go with their first copy.\n\n"
        + _splits_table(report)
        + ("\n\n## Document sizes (bytes)\n\n" + _table(sizes, [sizes.values()]) if sizes else "")
        + "\n\n## Warnings\n\n"
        + ("\n".join(f"- {w}" for w in warnings) if warnings else "None.")
        + "\n"
    )


def _metadata(name: str, model_type: str, meta: ModelMeta, report: dict, test: dict) -> dict:
    """Hugging Face's model card metadata: the corpus by its sha256, the test numbers as model-index."""
    sha = meta.data_sha256 or report.get("sha256")
    dataset = {"name": str(report.get("source") or "training corpus"), "type": "text", "split": "test"}
    if sha:
        dataset["revision"] = sha
    metrics = [{"type": k, "value": v, "name": f"test {k.replace('_', ' ')}"} for k, v in test.items()]
    out = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["lmops", model_type, "text-generation", "base-model"],
        "datasets": [f"sha256:{sha}"] if sha else [],
        "metrics": list(test),
        "model-index": [
            {
                "name": name,
                "results": [{"task": {"type": "text-generation"}, "dataset": dataset, "metrics": metrics}],
            }
        ],
    }
    return {k: v for k, v in out.items() if v}


def _is_test_number(key: str, value) -> bool:
    return key.startswith("test_") and isinstance(value, int | float) and not isinstance(value, bool)


def _section(params: dict, section: str) -> list[tuple[str, str]]:
    """One params.yaml section's rows of the flat MLflow params; "" for the run's own keys
    (num_params, device, ...)."""
    if not section:
        return sorted((k, v) for k, v in params.items() if "." not in k)
    return sorted(
        (k.removeprefix(f"{section}."), v) for k, v in params.items() if k.startswith(f"{section}.")
    )


def _data_summary(meta: ModelMeta, report: dict) -> str:
    sha = meta.data_sha256 or report.get("sha256")
    lines = f"- source: `{report.get('source') or 'unknown'}`\n- sha256: `{sha or 'unknown'}`"
    if not report:
        return lines + "\n\nThe training run logged no data report."
    return (
        f"{lines}\n- documents: {report.get('documents')} ({report.get('document_unit')}), "
        f"{report.get('bytes')} bytes\n\n" + _splits_table(report)
    )


def _splits_table(report: dict) -> str:
    split, total = report.get("split", {}), report.get("bytes") or 0
    rows = [
        (name, s.get("documents"), s.get("bytes"), f"{100 * s.get('bytes', 0) / total:.1f}%" if total else "")
        for name, s in split.items()
        if isinstance(s, dict)
    ]
    return _table(("split", "documents", "bytes", "share of bytes"), rows)


def _training_metrics(meta: ModelMeta) -> str:
    rows = [(k, v) for k, v in meta.metrics.items() if not k.startswith("test_")]
    return "\n\nAt the end of training:\n\n" + _table(("metric", "value"), rows) if rows else ""


def _evaluation(meta: ModelMeta, test: dict) -> str:
    if not test:
        return "No test metrics recorded."
    split_sha = meta.metrics.get("test_split_sha256")
    where = f" (sha256 `{split_sha}`)" if split_sha else ""
    return f"On the held-out test split{where}:\n\n" + _table(("metric", "value"), test.items())


def _evidence(evidence: dict | None) -> str:
    """Whatever the gate recorded: its verdict first, scalars as one table, each list of
    records (the checks) and each mapping (latency) as a table of its own."""
    if not evidence:
        return "None recorded (a version promoted before the gate recorded it, or forced)."
    parts = []
    if "promoted" in evidence:
        verdict = "**Promoted**" if evidence["promoted"] else "**Not promoted**"
        parts.append(verdict + (f": {evidence['reason']}" if evidence.get("reason") else ""))
    rest = {k: v for k, v in evidence.items() if k not in ("promoted", "reason")}
    scalars = [(k, v) for k, v in rest.items() if not _is_table(v)]
    if scalars:
        parts.append(_table(("", ""), scalars))
    for key, value in rest.items():
        if isinstance(value, dict):
            parts.append(f"{key}:\n\n" + _table(("", ""), value.items()))
        elif _is_table(value):
            columns = list(dict.fromkeys(k for row in value for k in row))
            parts.append(f"{key}:\n\n" + _table(columns, [[row.get(c) for c in columns] for row in value]))
    return "\n\n".join(parts)


def _is_table(value) -> bool:
    return isinstance(value, dict) or (
        isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)
    )


def _table(header: Iterable, rows: Iterable[Iterable]) -> str:
    header = list(header)
    lines = ["| " + " | ".join(map(_cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(_cell, row)) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return "[" + ", ".join(map(_cell, value)) + "]"
    text = "" if value is None else str(value)
    return " ".join(text.split()).replace("|", "\\|")


def _derived_warnings(report: dict) -> list[str]:
    """What in the report deserves a reader's attention."""
    out = []
    if report.get("capped_at_max_bytes"):
        out.append("the corpus was cut at data.max_bytes: the source holds more")
    if report.get("undecodable_sequences_replaced"):
        out.append(f"{report['undecodable_sequences_replaced']} undecodable byte sequences were replaced")
    if report.get("duplicates_dropped"):
        out.append(f"{report['duplicates_dropped']} copies were dropped: their text is in an earlier split")
    return out
