"""User errors on the command line are one clear line and exit status 2, not a traceback; every
flag's help says what it does and what its default is."""
import pytest

from switchyard.gateway.cli import build_parser, main


def test_unusable_backend_is_a_clear_error(capsys):
    assert main(["generate", "--backend", "cuda", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("switchyard: error: backend 'cuda' is not usable here") and "Traceback" not in err


def test_unknown_model_is_a_clear_error(capsys, tmp_path):
    assert main(["generate", "--model-id", str(tmp_path / "missing"), "hi"]) == 2
    assert "not in the local Hugging Face cache" in capsys.readouterr().err


def _serve_parser(environ=None):
    return build_parser(environ or {})._subparsers._group_actions[0].choices["serve"]


def _flag_help(parser, flag: str) -> str:
    """One flag's help as `--help` prints it, whitespace joined."""
    action = next(a for a in parser._actions if flag in a.option_strings)
    return " ".join(parser._get_formatter()._expand_help(action).split())


def test_every_serve_flag_has_help_that_states_its_default():
    serve = _serve_parser()
    flags = [max(a.option_strings, key=len) for a in serve._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 50
    undocumented = [f for f in flags if not next(a for a in serve._actions if f in a.option_strings).help]
    assert undocumented == []
    silent = [f for f in flags if "default" not in _flag_help(serve, f)]
    assert silent == []


def test_serve_help_shows_the_defaults_tgi_users_look_for(capsys):
    serve = _serve_parser()
    assert _flag_help(serve, "--port") == "port to listen on (default: 8080) [env: PORT]"
    assert "(default: 127.0.0.1)" in _flag_help(serve, "--hostname")
    assert "(default: 128)" in _flag_help(serve, "--max-concurrent-requests")
    assert "(default: off)" in _flag_help(serve, "--json-output")
    assert "(default: tuned)" in _flag_help(serve, "--runtime")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    printed = " ".join(capsys.readouterr().out.split())
    assert "--port PORT port to listen on (default: 8080) [env: PORT]" in printed


def test_a_default_from_the_environment_is_the_one_shown():
    serve = _serve_parser({"PORT": "9000", "JSON_OUTPUT": "1"})
    assert "(default: 9000)" in _flag_help(serve, "--port")
    assert "(default: on)" in _flag_help(serve, "--json-output")
