"""User errors on the command line are one clear line and exit status 2, not a traceback."""
from switchyard.gateway.cli import main


def test_unusable_backend_is_a_clear_error(capsys):
    assert main(["generate", "--backend", "cuda", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("switchyard: error: backend 'cuda' is not usable here") and "Traceback" not in err


def test_unknown_model_is_a_clear_error(capsys, tmp_path):
    assert main(["generate", "--model-id", str(tmp_path / "missing"), "hi"]) == 2
    assert "not in the local Hugging Face cache" in capsys.readouterr().err
