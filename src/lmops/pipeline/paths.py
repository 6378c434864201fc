"""Where the pipeline's stages read and write, relative to the repository root.

One module so a stage finds another's output without importing that stage
(dvc.yaml names the same paths as deps and outs).
"""

from __future__ import annotations

from pathlib import Path

RAW_DIR = Path("data/raw")
MANIFEST_FILE = RAW_DIR / "manifest.json"
DATA_REPORT_FILE = Path("artifacts/data_report.json")
# The report as a data card (markdown), beside it.
DATA_CARD_FILE = DATA_REPORT_FILE.with_name("data_card.md")
# Its headline numbers, beside it: DVC's metrics (`dvc metrics show` shows one column per
# number, and the whole report made that table ~700 characters wide).
DATA_METRICS_FILE = DATA_REPORT_FILE.with_name("data_metrics.json")
DATA_METRICS = ("documents", "bytes", "duplicates_merged", "empty_documents_dropped")
PROCESSED_DIR = Path("data/processed")
TOKENS_DIR = PROCESSED_DIR / "tokens"
# The test split's runs of documents of one slice (promote.slice_by): evaluate's unit cuts.
TEST_SLICES_FILE = PROCESSED_DIR / "test_slices.json"
TOKENIZER_DIR = Path("artifacts/tokenizer")
MODEL_DIR = Path("artifacts/model")
CHECKPOINT_DIR = Path("artifacts/checkpoints")
TRAIN_LOG_FILE = Path("artifacts/plots/train_log.csv")
VAL_LOG_FILE = Path("artifacts/plots/val_log.csv")
PLOTS_DIR = TRAIN_LOG_FILE.parent  # both logs, what `dvc plots show` draws
METRICS_FILE = Path("artifacts/metrics.json")
SAMPLES_FILE = Path("artifacts/samples.md")
# Each test unit's NLL and bytes (evaluate), what promotion compares unit by unit.
UNITS_FILE = Path("artifacts/eval/units.csv")
PROMOTION_FILE = Path("artifacts/promotion.json")
# The gate's numbers (DVC metrics: `dvc metrics show` lists the decision beside the test's).
PROMOTION_METRICS_FILE = PROMOTION_FILE.with_name("promotion_metrics.json")
# Candidate and champion bits/byte per slice of the test split (a DVC plot).
PROMOTION_SLICES_FILE = PROMOTION_FILE.with_name("promotion_slices.csv")
# Seconds and MB/s of the data stages: beside their DVC outputs, never inside them (a
# timing differs every run, and in a tracked output it would make DVC rerun what follows).
THROUGHPUT_FILE = Path("artifacts/throughput.json")

# What the stages write into, which template.py makes before the first `dvc repro` (each
# stage makes its other outputs itself).
WORK_DIRECTORIES = (RAW_DIR, PROCESSED_DIR, TOKENIZER_DIR, CHECKPOINT_DIR, PLOTS_DIR)
