"""Options derived from config dataclasses: one per field, its default, unit and env var."""

from __future__ import annotations

import dataclasses
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click
import pytest

from qmq_broker.cli import BrokerListener
from qmq_broker.cli import broker as broker_command
from qmq_broker.config import BrokerConfig, FsyncPolicy
from qmq_cli.options import (
    envvar_name,
    format_duration,
    options_from,
    parse_duration,
    parse_timestamp,
    take,
)
from qmq_outbox.compensator.cli import CompensatorService
from qmq_outbox.compensator.cli import compensator as compensator_command
from qmq_outbox.compensator.config import CompensatorConfig
from qmq_reconcile.cli import ReconcileArgs
from qmq_reconcile.cli import reconcile as reconcile_command

REQUIRED = {
    "broker": ["--data-dir", "/tmp/qmq-data"],
    "compensator": ["--database-url", "sqlite://", "--broker-url", "http://127.0.0.1:1"],
    "reconcile": ["--outbox", "sqlite://", "--out", "/tmp/o"],
}
COMMANDS = [
    ("broker", broker_command, "QMQ_BROKER", (BrokerConfig, BrokerListener)),
    (
        "compensator",
        compensator_command,
        "QMQ_COMPENSATOR",
        (CompensatorConfig, CompensatorService),
    ),
    ("reconcile", reconcile_command, "QMQ_RECONCILE", (ReconcileArgs,)),
]
# Every option name the docs, tests and scripts use today: they must keep working.
TODAY = {
    "broker": "--data-dir --host --port --fsync --segment-size --retention --dedup-window "
    "--ack-timeout --max-attempts --max-body-size --max-request-size --checkpoint-interval "
    "--max-delay --schedule-load-ahead --scheduler --workers --time-slice-ms --mailbox-size "
    "--pull-grace --debug-read-delay-ms --auth-file --log-level",
    "compensator": "--database-url --broker-url --broker-token --interval --batch-size --grace "
    "--max-attempts --retention --lease --metrics-port --metrics-host --once --stop-timeout",
    "reconcile": "--outbox --out --broker-data --master --grace --since --until --producer "
    "--ack-threshold --jars --jetstream --stream --consumed --group --subject --conf",
}


@pytest.fixture(autouse=True)
def no_qmq_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in os.environ:
        if name.startswith("QMQ_"):
            monkeypatch.delenv(name)


def parse(command: click.Command, args: list[str]) -> dict[str, Any]:
    with command.make_context(command.name or "qmq", list(args)) as ctx:
        return dict(ctx.params)


def options(command: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in command.params if isinstance(p, click.Option) and p.name}


@pytest.mark.parametrize(("name", "command", "prefix", "configs"), COMMANDS)
def test_every_field_is_an_option_with_its_env_var(
    name: str, command: click.Command, prefix: str, configs: tuple[type, ...]
) -> None:
    by_field = options(command)
    fields = [field for config in configs for field in dataclasses.fields(config)]
    assert sorted(by_field) == sorted(field.name for field in fields)
    for field in fields:
        option = by_field[field.name]
        assert option.envvar == envvar_name(prefix, option.opts[0])
        assert option.show_envvar
        assert option.help == field.metadata["help"]
        assert option.required == (field.default is dataclasses.MISSING)


@pytest.mark.parametrize(("name", "command", "prefix", "configs"), COMMANDS)
def test_no_arguments_give_each_field_its_default(
    name: str, command: click.Command, prefix: str, configs: tuple[type, ...]
) -> None:
    values = parse(command, REQUIRED[name])
    for config in configs:
        built = take(config, values)
        for field in dataclasses.fields(config):
            if field.default is not dataclasses.MISSING:
                assert getattr(built, field.name) == field.default, field.name
    assert values == {}


@pytest.mark.parametrize(("name", "command", "prefix", "configs"), COMMANDS)
def test_todays_option_names_and_env_vars_keep_working(
    name: str, command: click.Command, prefix: str, configs: tuple[type, ...]
) -> None:
    declared = {opt: option for option in options(command).values() for opt in option.opts}
    for opt in TODAY[name].split():
        assert opt in declared, opt
        assert declared[opt].envvar == prefix + "_" + opt[2:].upper().replace("-", "_")


@pytest.mark.parametrize(("name", "command", "prefix", "configs"), COMMANDS)
def test_help_shows_every_env_var(
    name: str, command: click.Command, prefix: str, configs: tuple[type, ...]
) -> None:
    with command.make_context(name, list(REQUIRED[name])) as ctx:
        compact = "".join(command.get_help(ctx).split())
    for option in options(command).values():
        if not option.hidden:
            assert str(option.envvar) in compact, option.envvar


def test_broker_units_reach_the_config() -> None:
    args = [
        *REQUIRED["broker"],
        "--fsync=interval:10",
        "--segment-size=2097152",
        "--retention=2h",
        "--ack-timeout=1.5s",
        "--time-slice-ms=2",
        "--backoff=1s,500ms,1m",
        "--debug-read-delay-ms=orders:slow=1500",
        "--debug-read-delay-ms=a:b=5",
        "--scheduler=fifo",
    ]
    values = parse(broker_command, args)
    config = take(BrokerConfig, values)
    assert config == BrokerConfig(
        data_dir=Path("/tmp/qmq-data"),
        fsync=FsyncPolicy(mode="interval", interval_ms=10),
        segment_bytes=2 * 1024 * 1024,
        retention_s=7200.0,
        ack_timeout_s=1.5,
        time_slice_s=0.002,
        backoff_s=(1.0, 0.5, 60.0),
        debug_read_delay_s=(("orders", "slow", 1.5), ("a", "b", 0.005)),
        scheduler="fifo",
    )
    assert take(BrokerListener, values) == BrokerListener()


def test_reconcile_options_read_as_run_takes_them() -> None:
    args = [
        *REQUIRED["reconcile"],
        "--outbox=sqlite:///b.db",
        "--jars=a.jar, b.jar",
        "--conf=k=v=w",
    ]
    values = parse(reconcile_command, [*args, "--since=2024-05-01", "--producer=orders"])
    given = take(ReconcileArgs, values)
    assert given.outboxes == ("sqlite://", "sqlite:///b.db")
    assert given.jars == ("a.jar", "b.jar")
    assert given.conf == (("k", "v=w"),)
    assert given.since == datetime(2024, 5, 1, tzinfo=UTC)
    assert given.producers == ("orders",)
    assert (given.grace, given.ack_threshold) == (timedelta(minutes=5), timedelta(minutes=10))


def test_env_vars_set_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QMQ_COMPENSATOR_INTERVAL", "100ms")
    monkeypatch.setenv("QMQ_COMPENSATOR_GRACE", "0")
    monkeypatch.setenv("QMQ_COMPENSATOR_ONCE", "1")
    values = parse(compensator_command, REQUIRED["compensator"])
    config = take(CompensatorConfig, values)
    assert (config.interval, config.grace) == (timedelta(milliseconds=100), timedelta(0))
    assert take(CompensatorService, values).once is True


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--fsync", "sometimes"], "fsync policy"),
        (["--retention", "5x"], "not a duration"),
        (["--time-slice-ms", "0"], "0.1<=x<=10000"),
        (["--debug-read-delay-ms", "orders=5"], "SUBJECT:GROUP=MS"),
        (["--scheduler", "lottery"], "lottery"),
    ],
)
def test_bad_values_are_usage_errors(args: list[str], needle: str) -> None:
    with pytest.raises(click.BadParameter, match=needle):
        parse(broker_command, [*REQUIRED["broker"], *args])


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("30s", 30), ("5m", 300), ("2h", 7200), ("7d", 604800), ("1.5", 1.5)],
)
def test_durations_read_and_print_back(text: str, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)
    assert parse_duration(format_duration(seconds)) == timedelta(seconds=seconds)


def test_durations_print_in_the_largest_whole_unit() -> None:
    shown = [format_duration(s) for s in (0, 0.005, 30, 60, 300, 72 * 3600, 730 * 86400)]
    assert shown == ["0s", "5ms", "30s", "1m", "5m", "3d", "730d"]
    assert format_duration(timedelta(minutes=10)) == "10m"


def test_timestamps_are_utc() -> None:
    assert parse_timestamp("2024-05-01") == datetime(2024, 5, 1, tzinfo=UTC)
    assert parse_timestamp("2024-05-01T14:00:00+02:00") == datetime(2024, 5, 1, 12, tzinfo=UTC)
    with pytest.raises(ValueError, match="not a timestamp"):
        parse_timestamp("yesterday")


def test_metadata_without_help_or_with_unknown_keys_is_refused() -> None:
    @dataclasses.dataclass
    class Typo:
        size: int = dataclasses.field(default=1, metadata={"help": "h", "unit": "count", "mx": 2})

    with pytest.raises(TypeError, match="mx"):
        options_from(Typo, envvar_prefix="QMQ_X")
