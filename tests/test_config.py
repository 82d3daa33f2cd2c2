"""A run's configuration: parsed from files and flags, kept in the state, saved, shown, compared, resumed."""

from __future__ import annotations

import dataclasses
import enum
import json
import pathlib
import warnings

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fnloop as fl
from fnloop.checkpoint import RunChanged, load, path_for, resume, save
from fnloop.cli import main
from fnloop.cli._diff import differences


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


@attrs.frozen
class Optim:
    """The optimizer."""

    lr: float = attrs.field(default=0.1, validator=_positive)
    """The peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's decay rates."""


@attrs.frozen
class Settings:
    """A tiny run's settings."""

    steps: int = 4
    """How many steps to train."""
    name: str = "tiny"
    """What the run is called."""
    bar: bool = True
    optim: Optim = attrs.field(factory=Optim)


# -- parse -------------------------------------------------------------------------------------------


def test_the_defaults_are_the_records():
    assert fl.config.parse(Settings, []) == Settings()


def test_files_then_flags_each_over_the_one_before(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('steps = 7\nname = "a = b"\n[optim]\nlr = 0.5\nbetas = [0.8, 0.9]\n')
    over = tmp_path / "over.toml"
    over.write_text("steps = 9\n")
    got = fl.config.parse(Settings, ["--config", str(toml), f"--config={over}", "--optim.lr=0.25"])
    assert got == Settings(steps=9, name="a = b", optim=Optim(lr=0.25, betas=(0.8, 0.9)))
    yaml = tmp_path / "run.yaml"
    yaml.write_text("steps: 3\nbar: false\noptim:\n  betas: [0.5, 0.6]\n")
    got = fl.config.parse(Settings, ["--config", str(yaml), "--name", "y"])
    assert got == Settings(steps=3, name="y", bar=False, optim=Optim(betas=(0.5, 0.6)))
    assert type(got.optim) is Optim


def test_help_lists_every_setting_with_its_type_default_and_docstring(capsys):
    with pytest.raises(SystemExit) as exit_:
        fl.config.parse(Settings, ["--help"], prog="train.py")
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag, text in [
        ("--steps", "How many steps to train. (type: int, default: 4)"),
        ("--name", "What the run is called. (type: str, default: tiny)"),
        ("--optim.lr", "The peak learning rate. (type: float, default: 0.1)"),
        ("--config", "TOML (.toml), YAML or JSON"),
    ]:
        assert flag in out and text in out, (flag, out)
    assert "usage: train.py" in out and "A tiny run's settings." in out


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--stepz=3"], "unrecognized arguments: --stepz=3"),
        (["--steps=three"], 'Parser key "steps"'),
        (["--config", "missing.yaml"], "missing.yaml"),
    ],
)
def test_a_bad_command_line_ends_with_the_parsers_message_and_status_2(argv, said, capsys):
    with pytest.raises(SystemExit) as exit_:
        fl.config.parse(Settings, argv)
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err


def test_the_records_validators_run():
    with pytest.raises(ValueError, match=r"lr must be positive, got -1\.0"):
        fl.config.parse(Settings, ["--optim.lr=-1"])


def test_toml_and_yaml_files_together_and_a_class_not_a_record_are_refused(tmp_path):
    (tmp_path / "a.toml").write_text("steps = 1\n")
    (tmp_path / "b.yaml").write_text("steps: 2\n")
    with pytest.raises(ValueError, match="TOML and other files"):
        fl.config.parse(
            Settings, ["--config", str(tmp_path / "a.toml"), "--config", str(tmp_path / "b.yaml")]
        )

    @dataclasses.dataclass
    class NotAttrs:
        lr: float = 0.1

    with pytest.raises(TypeError, match="an attrs record"):
        fl.config.parse(NotAttrs, [])


# -- the state keeps it as plain data ----------------------------------------------------------------


class Mode(enum.Enum):
    FAST = "fast"


def test_init_keeps_the_settings_as_plain_data():
    @dataclasses.dataclass
    class Data:
        root: pathlib.Path
        mode: Mode

    state = fl.init(
        torch.nn.Linear(2, 1),
        fl.optim.sgd(0.1),
        seed=0,
        max_iter=4,
        config={"run": Settings(), "data": Data(pathlib.Path("/data"), Mode.FAST), "tags": ["a", "b"]},
    )
    assert state.config == {
        "run": {"steps": 4, "name": "tiny", "bar": True, "optim": {"lr": 0.1, "betas": (0.9, 0.999)}},
        "data": {"root": "/data", "mode": "fast"},
        "tags": ("a", "b"),
    }
    assert fl.config.as_dict(Settings()) == state.config["run"]


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({"w": torch.ones(1)}, r"'init\(config=...\).w' is not plain data .* Tensor"),
        ({"fn": print}, r"'init\(config=...\).fn' is not plain data"),
        ({1: "a"}, "a key that is not a str"),
        (0.1, "an attrs record, a dataclass or a mapping"),
    ],
)
def test_settings_a_checkpoint_could_not_read_back_are_refused_where_they_are(config, said):
    with pytest.raises(TypeError, match=said):
        fl.init(torch.nn.Linear(2, 1), fl.optim.sgd(0.1), seed=0, max_iter=4, config=config)


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**62), 2**62),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
configs = st.dictionaries(
    st.text(min_size=1, max_size=6),
    st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=8,
    ),
    max_size=5,
)


@given(configs)
def test_save_then_load_gives_the_configuration_back(tmp_path_factory, config):
    state = fl.TrainState(max_iter=3, config=config)
    where = tmp_path_factory.mktemp("ckpt")
    loaded = load(save(state, path_for(where, 0)), like=fl.TrainState(max_iter=3))
    assert loaded.config == state.config
    assert fl.config.changes(state.config, loaded.config) == []


# -- checkpoints: inspect, diff, resume -----------------------------------------------------------------


def _state(settings: Settings) -> fl.TrainState:
    torch.manual_seed(0)
    return fl.init(
        torch.nn.Linear(2, 1), fl.optim.sgd(settings.optim.lr), seed=0, max_iter=8, config=settings
    )


@pytest.fixture
def two_checkpoints(tmp_path):
    a = save(attrs.evolve(_state(Settings()), iteration=4), path_for(tmp_path / "a", 4))
    b = save(
        attrs.evolve(_state(Settings(optim=Optim(lr=0.3), bar=False)), iteration=4),
        path_for(tmp_path / "b", 4),
    )
    return a, b


def test_inspect_shows_the_configuration(two_checkpoints, capsys):
    a, _ = two_checkpoints
    assert main(["inspect", str(a)]) == 0
    out = capsys.readouterr().out
    assert "config:" in out
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert "optim.lr 0.1" in lines and "steps 4" in lines, out
    assert main(["inspect", "--json", str(a)]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["optim"] == {"lr": 0.1, "betas": [0.9, 0.999]}


def test_diff_names_each_setting_that_differs(two_checkpoints, capsys):
    a, b = two_checkpoints
    found = differences(a, b)
    assert any("config['optim']['lr']" in line and "0.1" in line and "0.3" in line for line in found), found
    assert any("config['bar']" in line for line in found), found
    assert not any("config['steps']" in line for line in found), found


def test_resume_with_changed_settings_names_them_and_takes_the_new_ones(tmp_path):
    save(attrs.evolve(_state(Settings()), iteration=4), path_for(tmp_path, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same = resume(tmp_path, like=_state(Settings()))
    assert same.iteration == 4 and same.config == fl.config.as_dict(Settings())
    with pytest.warns(RunChanged) as caught:
        changed = resume(tmp_path, like=_state(Settings(optim=Optim(lr=0.3), bar=False)))
    message = str(caught[0].message)
    assert "optim.lr: 0.1 -> 0.3" in message and "bar: True -> False" in message, message
    assert "steps" not in message.split("Changed")[1].split(".", 1)[0]
    assert changed.iteration == 4 and changed.config["optim"]["lr"] == 0.3


def test_a_checkpoint_saved_without_settings_takes_the_templates_silently(tmp_path):
    save(attrs.evolve(_state(Settings()), iteration=4, config=None), path_for(tmp_path, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = resume(tmp_path, like=_state(Settings()))
    assert resumed.iteration == 4 and resumed.config == fl.config.as_dict(Settings())


def test_flags_as_argparse_users_write_them():
    assert fl.config.parse(Settings, ["--no-bar", "--optim.lr", "0.5"]) == Settings(
        bar=False, optim=Optim(lr=0.5)
    )
    assert fl.config.parse(Settings, ["--bar", "--steps", "2"]) == Settings(bar=True, steps=2)
    assert fl.config.parse(Settings, ["--bar=false"]).bar is False


@pytest.mark.parametrize("example", ["digits", "lm"])
def test_the_examples_help_lists_their_settings(example, capsys):
    module = __import__(f"fnloop.examples.{example}", fromlist=["main"])
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"usage: python -m fnloop.examples.{example} [--config CONFIG]" in out
    for field in attrs.fields(module.Settings):
        assert f"--{field.name}" in out, field.name
    assert "Seeds the weights, data order and dropout. (type: int, default: 0)" in out


def test_a_changed_max_iter_and_configuration_are_one_warning(tmp_path):
    save(attrs.evolve(_state(Settings()), iteration=4), path_for(tmp_path, 4))
    longer = attrs.evolve(_state(Settings(steps=9)), max_iter=9)
    with pytest.warns(RunChanged) as caught:
        resumed = resume(tmp_path, like=longer)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "max_iter=8; it continues to the template's max_iter=9" in message
    assert "It also started with another configuration" in message and "steps: 4 -> 9" in message
    assert (resumed.max_iter, resumed.config["steps"]) == (9, 9)


def test_a_dotted_key_and_a_nested_one_are_two_settings_and_each_change_is_named():
    from fnloop._core.config import changes

    saved = {"a.b": 1, "a": {"b": 2}}
    assert changes(saved, {"a.b": 1, "a": {"b": 3}}) == ["a.b: 2 -> 3"]
    assert changes(saved, {"a.b": 5, "a": {"b": 2}}) == ['["a.b"]: 1 -> 5']
    assert changes(saved, {"a": {"b": 2}}) == ['["a.b"]: 1 -> (absent)']


@pytest.mark.parametrize(("saved", "now"), [(5, 6), ({"lr": 1}, [1]), ("lr", None)])
def test_changes_of_what_is_not_a_configuration_is_refused(saved, now):
    from fnloop._core.config import changes

    with pytest.raises(TypeError, match=r"changes\(\) compares two configurations, each a mapping"):
        changes(saved, now)


def test_parse_of_a_str_instead_of_the_words_of_a_command_line_is_refused():
    with pytest.raises(
        TypeError, match=r"args is a list of the command line's words, as sys.argv\[1:\] \(got '--lr=0.3'"
    ):
        fl.config.parse(Settings, "--lr=0.3")


def test_a_configuration_nested_too_deep_is_refused_naming_where():
    deep: dict = {}
    node = deep
    for _ in range(2_000):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(TypeError, match=r"nests records, mappings or lists more than 100 deep"):
        fl.init(torch.nn.Linear(2, 1), fl.optim.sgd(0.1), seed=0, max_iter=1, config=deep)
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(TypeError, match=r"or one holds itself"):
        fl.init(torch.nn.Linear(2, 1), fl.optim.sgd(0.1), seed=0, max_iter=1, config={"c": cycle})
