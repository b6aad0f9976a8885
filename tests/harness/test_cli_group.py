"""``lpdiff``'s command group as harness/cli.py assembles it from the faces (cli_run, cli_engines, cli_adapters,
cli_store): every command it serves is the object its face defines, so a command written but not registered, or
registered from the wrong face, fails here. What each command does is in test_cli.py and test_cli_faces.py."""

from lpdiff.harness import cli, cli_adapters, cli_engines, cli_run, cli_store


def test_the_group_serves_exactly_the_faces_commands():
    faces = {
        cli_run: ("run", "regen"),
        cli_engines: ("compare", "calibrate", "check", "metamorphic", "doctor", "bisect"),
        cli_adapters: ("models", "adapters"),
        cli_store: ("baselines", "report"),
    }
    want = {name: getattr(face, name) for face, names in faces.items() for name in names}
    assert cli.cli.commands == want
    assert {"gen", "convert"} <= set(cli_adapters.adapters.commands) and "ls" in cli_store.baselines.commands
