"""The data stages in bounded memory and on a full disk, as the `lmops` command runs them."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import numpy as np

LIMIT_AS = 700 << 20  # address space: ~450 MB is the interpreter, numpy, tokenizers and its threads
SIZES = (2_500_000, 5_000_000)  # both past the first batches of encoding, where its memory levels off


def generated_corpus(path, size: int) -> None:
    """Unique lines of words drawn by a Zipf law: the shape of a line-per-record corpus."""
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 9))) for _ in range(3000)]
    lines, n = [], 0
    while n < size:
        line = f"{len(lines)} " + " ".join(words[k % 3000] for k in rng.zipf(1.3, 12)) + "\n"
        lines.append(line)
        n += len(line)
    path.write_text("".join(lines))


def lmops(project, stage: str, limit: tuple[int, tuple[int, int]] | None = None) -> tuple[int, str, int]:
    """Run one stage (under a resource limit): its exit status, stderr and peak RSS in bytes."""

    def preexec() -> None:
        if limit:
            signal.signal(
                signal.SIGXFSZ, signal.SIG_IGN
            )  # a write past the limit fails (EFBIG), as on a full disk
            resource.setrlimit(*limit)

    env = {**os.environ, "RAYON_NUM_THREADS": "2", "MALLOC_ARENA_MAX": "2"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmops.pipeline.cli", stage],
        cwd=project,
        env=env,
        preexec_fn=preexec,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, stderr, usage.ru_maxrss * 1024


def test_data_stages_run_in_bounded_memory(tmp_path):
    """2.5 MB and 5 MB through get_data, split and tokenize under an address-space limit: no
    stage's peak RSS grows with the corpus (the in-memory stages grew by 3.5 and 39 bytes a byte)."""
    peaks = {}
    for size in SIZES:
        project = tmp_path / str(size)
        project.mkdir()
        generated_corpus(project / "corpus.txt", size)
        (project / "params.yaml").write_text(
            "data: {source: corpus.txt}\n"
            "tokenizer: {vocab_size: 512, train_bytes: 500000, shard_bytes: 1000000}\n"
        )
        for stage in ("get_data", "split", "tokenize"):
            rc, stderr, peaks[stage, size] = lmops(project, stage, (resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS)))
            assert rc == 0, stderr[-2000:]
    for stage in ("get_data", "split", "tokenize"):
        small, big = peaks[stage, SIZES[0]], peaks[stage, SIZES[1]]
        # in memory it grew by 9 MB (split) and 98 MB (tokenize) from the smaller corpus to the larger
        assert big < small + 15_000_000, (stage, small, big)
    index = (tmp_path / str(SIZES[1]) / "data/processed/tokens/index.json").read_text()
    assert '"train-000-00001.bin"' in index  # more than one shard


def test_a_full_disk_is_one_line_naming_the_path_and_leaves_nothing(tmp_path):
    generated_corpus(tmp_path / "corpus.txt", 300_000)
    (tmp_path / "params.yaml").write_text("data: {source: corpus.txt}\n")
    rc, stderr, _ = lmops(tmp_path, "get_data", (resource.RLIMIT_FSIZE, (100_000, 100_000)))
    assert rc == 1
    assert stderr.strip().splitlines()[-1] == (
        "lmops get_data: error: data/raw/corpus.txt: file too large while writing it"
    )
    assert not (tmp_path / "data/raw").exists()
