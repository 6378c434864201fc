from lmops.pipeline import cli
from lmops.runtime.model import Llama
from lmops.runtime.model_config import TINY_SHAPE, LlamaConfig
from tests.conftest import REPO


def test_generate_samples_with_the_models_defaults_unless_a_flag_says_otherwise(tmp_path):
    Llama(LlamaConfig(vocab_size=300, **TINY_SHAPE)).save_pretrained(tmp_path)
    args = cli.build_parser().parse_args(
        ["generate", "--model", str(tmp_path), "--prompt", "x", "--top-k", "5"]
    )
    s = cli._sampling(args)
    assert (s.temperature, s.top_k, s.top_p, s.seed, s.max_tokens) == (0.8, 5, 0.95, None, 128)


def test_links_without_a_tracking_store_say_what_to_run_and_create_none(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert cli.main(["--params", str(REPO / "params.yaml"), "links"]) == 1
    assert (
        capsys.readouterr().err
        == "lmops links: error: no tracking store at mlflow.db: run `make run` first\n"
    )
    assert not (tmp_path / "mlflow.db").exists()
