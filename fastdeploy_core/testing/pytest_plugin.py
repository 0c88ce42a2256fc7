"""The conformance kit as a pytest plugin: ``pytest -p fastdeploy_core.testing.pytest_plugin --fd-device=NAME``.

Options:

``--fd-device NAME``
    The registered device to check (``cpu``, ``gpu``, ``xpu``, your chip...). Without it the
    plugin does nothing, so it can stay installed as a ``pytest11`` entry point.
``--fd-place device|cpu``
    ``device`` (default): run the ops on the device itself; fails when it is not available here.
    ``cpu``: run the device's ops class on the CPU place in float32, which exercises its
    fallback paths and every declaration check on a machine without the chip.
``--fd-ops-class module:Class``
    Check this ops class instead of the device's ``ops_class`` (e.g. a work-in-progress one).

With ``--fd-device`` the kit's own test module is collected; when no test paths are given on
the command line only the kit runs.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

KIT_MODULE = Path(__file__).with_name("conformance.py")
#: How the kit's tests are named in reports: ``fastdeploy_core/testing/conformance.py::test_...``.
KIT_NODE_PREFIX = "fastdeploy_core/testing/conformance.py"


@pytest.fixture
def restore_ops():
    """Put the process-wide ops table back after a test that installs another one."""
    from fastdeploy_core.devices.current import current_ops, set_current_ops

    previous = current_ops()
    yield
    set_current_ops(previous)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fastdeploy", "fastdeploy-core device conformance kit")
    group.addoption("--fd-device", default=None, help="registered device name to check (e.g. cpu, gpu, xpu)")
    group.addoption(
        "--fd-place",
        default="device",
        choices=("device", "cpu"),
        help="run the ops on the device (default) or on the CPU place to check their fallback paths",
    )
    group.addoption("--fd-ops-class", default=None, help="module:Class of an ops table to check instead of the device's")


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("fd_device", default=None)
    if not name:
        return
    from fastdeploy_core.plugins import get_plugin_manager

    manager = get_plugin_manager()
    device = manager.devices.get(name)
    if device is None:
        known = ", ".join(sorted(manager.devices.keys()))
        raise pytest.UsageError(f"--fd-device {name!r}: no installed plugin registers it (registered: {known})")
    ops_class = _import_ops_class(config.getoption("fd_ops_class"))
    config._fd_kit = {"device": device, "ops_class": ops_class, "place": config.getoption("fd_place")}
    kit = str(KIT_MODULE)
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        if kit not in config.args:
            config.args.append(kit)
    else:
        config.args[:] = [kit]


def _import_ops_class(spec: str | None):
    if not spec:
        return None
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise pytest.UsageError(f"--fd-ops-class {spec!r}: expected module:Class")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise pytest.UsageError(f"--fd-ops-class {spec!r}: {type(exc).__name__}: {exc}") from None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """Name the kit's tests after its module in every report: it is the one path given to
    pytest, so pytest would print them with an empty path (``::test_declaration``)."""
    report = yield
    if report.nodeid.startswith("::") and item.path == KIT_MODULE:
        report.nodeid = KIT_NODE_PREFIX + report.nodeid
    return report


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Each failed check with its whole message (pytest's own summary cuts it at the terminal's
    width, and what differed is at the end)."""
    if not getattr(config, "_fd_kit", None):
        return
    failed = terminalreporter.stats.get("failed", [])
    if not failed:
        return
    terminalreporter.section(f"fastdeploy conformance kit: {len(failed)} failed")
    for report in failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
        message = message.removeprefix("AssertionError: ")
        terminalreporter.write_line(f"{report.nodeid.rpartition('::')[2]}: {message}")


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    kit = getattr(config, "_fd_kit", None)
    if not kit:
        return None
    ops = kit["ops_class"] or kit["device"].ops_class
    ops_name = f"{ops.__module__}.{ops.__qualname__}" if ops else "reference ops"
    return [f"fastdeploy conformance kit: device {kit['device'].name!r}, ops {ops_name}, place {kit['place']}"]


def _target(config: pytest.Config):
    from fastdeploy_core.testing.checks import CheckSkipped, make_target

    kit = config._fd_kit
    if "target" not in kit:
        try:
            kit["target"] = make_target(kit["device"], kit["ops_class"], None if kit["place"] == "device" else "cpu")
        except CheckSkipped as exc:
            kit["target"] = exc
    return kit["target"]


@pytest.fixture(scope="session")
def fd_target(request: pytest.FixtureRequest):
    """The :class:`~fastdeploy_core.testing.checks.Target` under test."""
    if not getattr(request.config, "_fd_kit", None):
        pytest.skip("the fastdeploy conformance kit runs only with --fd-device")
    target = _target(request.config)
    if isinstance(target, Exception):
        pytest.fail(str(target), pytrace=False)  # a kit run that cannot reach its device must not pass
    return target


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    kit = getattr(metafunc.config, "_fd_kit", None)
    if not kit:
        return
    from fastdeploy_core.testing.checks import ATTENTION_SCENARIOS, OPS

    target = _target(metafunc.config)
    device = kit["device"]
    dtypes = list(target.dtypes) if not isinstance(target, Exception) else list(device.supported_dtypes)
    params = {
        "fd_dtype": dtypes,
        "fd_op": list(OPS),
        "fd_scenario": list(ATTENTION_SCENARIOS),
        "fd_backend": list(device.attention_backends),
        "fd_method": list(device.quantization_methods) or ["<none declared>"],
    }
    for name, values in params.items():
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, values)
