"""The production backends, real and local: PostgreSQL (MLflow's backend store), moto's S3
server (MLflow's artifacts, the DVC remote) and `mlflow server` on both, artifacts proxied.

Installed by `make backends` (PostgreSQL from apt, moto_server from requirements-dev.lock);
missing tools fail the tests with that command, never skip them. Only the MLflow server
holds the bucket's credentials; the pipeline gets `MLFLOW_TRACKING_URI=http://...` alone.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import BIN

BUCKET = "lmops"
S3_KEYS = {"AWS_ACCESS_KEY_ID": "lmops-test", "AWS_SECRET_ACCESS_KEY": "lmops-test-secret"}
DB_USER, DB_PASSWORD, DB_NAME = "mlflow", "mlflow-test-password", "mlflow"
# PostgreSQL refuses to run as root: as root (CI), the server runs as this account.
PG_ACCOUNT = "postgres"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, ready, proc: subprocess.Popen | None, log: Path | None, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"{what} exited {proc.returncode}:\n{log.read_text()[-3000:] if log else ''}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{what} not ready after {timeout} s:\n{log.read_text()[-3000:] if log else ''}"
            )
        time.sleep(0.2)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def pg_bin_dir() -> Path:
    """Debian's PostgreSQL binaries (not on PATH there), else PATH's."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3]))
    if found:
        return found[-1].parent
    if shutil.which("pg_ctl"):
        return Path(shutil.which("pg_ctl")).parent
    pytest.fail("PostgreSQL (initdb, pg_ctl) is not installed: run `make backends`", pytrace=False)


@dataclass
class Postgres:
    """A throwaway PostgreSQL cluster on a free loopback port, password auth over TCP. Its URL
    names the driver: SQLAlchemy 2.1 reads a bare postgresql:// as psycopg 3."""

    bin: Path
    data: Path
    port: int

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://{DB_USER}:{DB_PASSWORD}@127.0.0.1:{self.port}/{DB_NAME}"

    def _run(self, tool: str, *args: str) -> None:
        as_user = ["runuser", "-u", PG_ACCOUNT, "--"] if os.geteuid() == 0 else []
        cmd = [*as_user, str(self.bin / tool), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=self.data.parent)
        if proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")

    def pg_ctl(self, action: str) -> None:
        options = f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", action, "-D", str(self.data), "-l", str(self.data / "server.log"),
                  "-w", "-m", "fast", "-o", options)  # fmt: skip

    def connect(self, database: str = DB_NAME, user: str = DB_USER):
        import psycopg2

        return psycopg2.connect(
            host="127.0.0.1", port=self.port, dbname=database, user=user, password=DB_PASSWORD
        )

    def query(self, sql: str, *args) -> list[tuple]:
        with self.connect() as conn, conn.cursor() as cur:
            cur.execute(sql, args)
            rows = cur.fetchall()
        conn.close()
        return rows

    @classmethod
    def create(cls, root: Path) -> Postgres:
        pg = cls(pg_bin_dir(), root / "data", free_port())
        pwfile = root / "pwfile"
        pwfile.write_text(DB_PASSWORD)
        if os.geteuid() == 0:
            account = pwd.getpwnam(PG_ACCOUNT)
            for path in (root, pwfile):
                os.chown(path, account.pw_uid, account.pw_gid)
        pg._run("initdb", "-D", str(pg.data), "-U", "postgres", "--auth-local=trust",
                "--auth-host=scram-sha-256", f"--pwfile={pwfile}", "-E", "UTF8", "--no-sync")  # fmt: skip
        pg.pg_ctl("start")
        admin = pg.connect("postgres", "postgres")
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute(f"CREATE ROLE {DB_USER} LOGIN PASSWORD %s", (DB_PASSWORD,))
            cur.execute(f"CREATE DATABASE {DB_NAME} OWNER {DB_USER}")
        admin.close()
        return pg


@dataclass
class Process:
    """A server subprocess with its log, which the tests may stop and start again."""

    argv: list[str]
    env: dict[str, str]
    log: Path
    health_url: str
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_for(self.argv[0], lambda: http_ok(self.health_url), self.proc, self.log)

    def stop(self) -> None:
        """Down at once, as a crashed or unplugged server (a graceful stop costs seconds)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # mlflow server's uvicorn worker too
            self.proc.wait(30)


@dataclass
class Backends:
    postgres: Postgres
    s3_endpoint: str
    mlflow: Process

    @contextlib.contextmanager
    def tracking_server_down(self) -> Iterator[None]:
        """The tracking server killed for the block, started again after it, even when the
        block fails (the module's later tests need it)."""
        self.mlflow.stop()
        try:
            yield
        finally:
            self.mlflow.start()

    @property
    def tracking_uri(self) -> str:
        return self.mlflow.health_url.removesuffix("/health")

    def s3(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.s3_endpoint, region_name="us-east-1",
                            aws_access_key_id=S3_KEYS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=S3_KEYS["AWS_SECRET_ACCESS_KEY"])  # fmt: skip

    def bucket_keys(self, prefix: str = "") -> dict[str, str]:
        """Every object under `prefix`: key -> ETag (the MD5 of a single-part upload)."""
        pages = self.s3().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return {o["Key"]: o["ETag"].strip('"') for page in pages for o in page.get("Contents", [])}


def server_env() -> dict[str, str]:
    """The servers' environment: the bucket's keys live here, not in the pipeline's."""
    return {**os.environ, **S3_KEYS, "AWS_DEFAULT_REGION": "us-east-1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="session")
def backends():
    moto_server = BIN / "moto_server"
    if not moto_server.is_file():
        pytest.fail(f"{moto_server} is missing: run `make install backends`", pytrace=False)
    root = Path(tempfile.mkdtemp(prefix="lmops-backends-"))  # not under pytest's root-only tmp
    postgres = Postgres.create(root)
    s3_port, mlflow_port = free_port(), free_port()
    s3_endpoint = f"http://127.0.0.1:{s3_port}"
    moto = Process(
        [str(moto_server), "-H", "127.0.0.1", "-p", str(s3_port)],
        server_env(),
        root / "moto.log",
        f"{s3_endpoint}/moto-api/",
    )
    mlflow = Process(
        [str(BIN / "mlflow"), "server", "--backend-store-uri", postgres.url,
         "--artifacts-destination", f"s3://{BUCKET}/mlartifacts",
         "--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1"],
        {**server_env(), "MLFLOW_S3_ENDPOINT_URL": s3_endpoint},
        root / "mlflow.log",
        f"http://127.0.0.1:{mlflow_port}/health",
    )  # fmt: skip
    started = []
    try:
        moto.start()
        started.append(moto)
        found = Backends(postgres, s3_endpoint, mlflow)
        found.s3().create_bucket(Bucket=BUCKET)
        mlflow.start()
        started.append(mlflow)
        yield found
    finally:
        for proc in reversed(started):
            proc.stop()
        postgres.pg_ctl("stop")
        shutil.rmtree(root, ignore_errors=True)
