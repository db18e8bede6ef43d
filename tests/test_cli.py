"""fastnmt.cli: bad input is refused in one line with exit status 2, naming the argument: the
paths a command writes (checked before any work), non-finite numbers, a forced backend that
cannot run."""

import tempfile

import pytest

from fastnmt import cli, evaluate, export, preprocess, score, train, translate
from fastnmt.ops.dispatch import BackendUnavailableError
from fastnmt.serve import command as serve_command

# Each command's arguments up to the path under test; the checkpoint is never loaded, as the
# path is refused first. {text}: a text file; {run}: a training run's folder.
COMMANDS = {
    "translate --output": (translate, "--checkpoint none --input {text} --output"),
    "translate --alignments": (translate, "--checkpoint none --input {text} --alignments"),
    "translate --plot-attention": (translate, "--checkpoint none --input {text} --plot-attention"),
    "score --output": (score, "--checkpoint none --source {text} --target {text} --output"),
    "evaluate --output": (evaluate, "--checkpoint none --output"),
    "preprocess --prepared-dir": (preprocess, "--train {text} --prepared-dir"),
    "train --output-dir": (train, "--output-dir"),
    "train --prepared-dir": (train, "--output-dir {run} --prepared-dir"),
    "train --tensorboard": (train, "--output-dir {run} --tensorboard"),
    "export --output": (export, "--checkpoint none --format ctranslate2 --output"),
}
FOLDERS = {  # the others write a file
    "translate --plot-attention",
    "preprocess --prepared-dir",
    "train --output-dir",
    "train --prepared-dir",
    "train --tensorboard",
    "export --output",
}


def _run(command: str, path, tmp_path, capsys) -> str:
    module, arguments = COMMANDS[command]
    text = tmp_path / "text.txt"
    text.write_text("a b\n", encoding="utf-8")
    argv = [*arguments.format(text=text, run=tmp_path / "run").split(), str(path)]
    assert module.main(argv) == cli.BAD_INPUT
    return capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_path_under_a_file_is_refused_before_any_work(command, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("", encoding="utf-8")
    path = blocker / "out" / "deeper"
    flag = command.split()[1]
    assert _run(command, path, tmp_path, capsys) == (
        f"error: {flag} {path}: {blocker} is a file, not a folder\n"
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_a_path_of_the_other_kind_is_refused(command, tmp_path, capsys):
    folder = command in FOLDERS
    path = tmp_path / "there"
    if folder:
        path.write_text("", encoding="utf-8")
    else:
        path.mkdir()
    kind, other = ("folder", "file") if folder else ("file", "folder")
    expected = f"error: {command.split()[1]} {path} is a {other}, expected a {kind}\n"
    assert _run(command, path, tmp_path, capsys) == expected


def test_a_place_where_nothing_can_be_created_is_named_with_the_reason(tmp_path, monkeypatch):
    def refused(dir):
        raise PermissionError(13, "Permission denied", dir)

    monkeypatch.setattr(tempfile, "TemporaryDirectory", refused)
    path = tmp_path / "new" / "out.txt"
    with pytest.raises(cli.UsageError) as error:
        cli.check_output_path(path, "--output")
    assert str(error.value) == f"--output {path}: cannot write in {tmp_path} (Permission denied)"


@pytest.mark.parametrize("folder", [False, True])
def test_a_writable_path_passes_and_the_check_leaves_nothing(tmp_path, folder):
    (tmp_path / "kept.txt").write_text("", encoding="utf-8")
    for path in (tmp_path / "new" / "deeper" / "out", tmp_path / "kept.txt", tmp_path):
        if path.exists() and path.is_dir() != folder:
            continue
        cli.check_output_path(path, "--output", folder=folder)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt"]
    cli.check_output_path(None, "--output")  # not given: nothing to check


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "NaN", "1e999"])
def test_finite_float_refuses_what_is_no_finite_number(text):
    with pytest.raises(cli.argparse.ArgumentTypeError, match="expected a finite number"):
        cli.finite_float(text)


def test_finite_float_reads_numbers_and_names_what_is_none():
    assert cli.finite_float("-0.5") == -0.5 and cli.finite_float("1e-6") == 1e-6
    with pytest.raises(cli.argparse.ArgumentTypeError, match="expected a number, got 'x'"):
        cli.finite_float("x")


@pytest.mark.parametrize("module", [translate, score, evaluate, train])
def test_every_float_argument_is_a_finite_float(module):
    """A range check written as a comparison lets nan through (nan <= 0 is False): every float
    argument is parsed by finite_float instead."""
    actions = module.build_parser()._actions
    assert not [a.dest for a in actions if a.type is float]
    assert any(a.type is cli.finite_float for a in actions)


@pytest.mark.parametrize(
    "flag", ["--max-wait-ms", "--shutdown-timeout", "--max-length-penalty", "--request-timeout"]
)
def test_the_servers_numbers_are_finite(flag, capsys):
    with pytest.raises(SystemExit) as exit:
        serve_command.parse_args(["--checkpoint", "none", flag, "inf"])
    assert exit.value.code == cli.BAD_INPUT
    assert f"argument {flag}: expected a finite number, got 'inf'" in capsys.readouterr().err


def test_a_forced_backend_that_cannot_run_is_one_line(capsys):
    def run(args):
        raise BackendUnavailableError("backend 'triton' was forced but cannot run x: on cpu")

    assert (
        cli.run_command(
            run, score.build_parser(), ["--checkpoint", "c", "--source", "s", "--target", "t"]
        )
        == cli.BAD_INPUT
    )
    assert capsys.readouterr().err == (
        "error: backend 'triton' was forced but cannot run x: on cpu\n"
    )
