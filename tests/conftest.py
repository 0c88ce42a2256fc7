"""Shared test set-up: thread count before Paddle is imported anywhere, offline model hubs."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# ``restore_ops`` (put the process-wide ops table back) comes from the pytest plugin the core
# installs (fastdeploy_core/testing/pytest_plugin.py), so plugins' own tests have it too.

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def cpu_kernels():
    """The cpu device's built kernel module; the test fails when it cannot build here (the first
    run on a machine builds it: ~30 s)."""
    from fastdeploy_core.builtin.cpu.kernels import kernel_failure, load_kernels

    module = load_kernels()
    assert module is not None, f"the cpu kernels must build on this machine: {kernel_failure()}"
    return module


@pytest.fixture
def cpu_kernel_calls(monkeypatch):
    """The names of the cpu kernels the cpu ops table runs from here on, in order (``ops._run``
    wrapped): which kernel a table method chose."""
    import fastdeploy_core.builtin.cpu.ops as cpu_ops

    called: list[str] = []
    run = cpu_ops._run
    monkeypatch.setattr(cpu_ops, "_run", lambda name, *args: called.append(name) or run(name, *args))
    return called


EXAMPLE_PLUGIN = os.path.join(os.path.dirname(__file__), "example_plugin")


@pytest.fixture(scope="session")
def example_chip_on_path():
    """The test-only ``example_chip`` plugin, installed for this test session only.

    Its package stays in tests/example_plugin; a temporary directory holds its distribution
    metadata (name, version and the ``fastdeploy`` entry point, from its pyproject.toml), so
    entry-point discovery finds it as it finds any installed plugin. Both go on ``sys.path`` and
    on ``PYTHONPATH`` (for the kit's subprocesses) and are taken off again, and the directory
    removed, when the session ends: the user's venv never lists it in ``fastdeploy env``.
    """
    import shutil
    import sys
    import tempfile

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
        import tomli as tomllib

    with open(os.path.join(EXAMPLE_PLUGIN, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    site = tempfile.mkdtemp(prefix="fd-example-chip-")
    dist_info = os.path.join(site, f"{project['name'].replace('-', '_')}-{project['version']}.dist-info")
    os.mkdir(dist_info)
    with open(os.path.join(dist_info, "METADATA"), "w", encoding="utf-8") as fh:
        fh.write(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    with open(os.path.join(dist_info, "entry_points.txt"), "w", encoding="utf-8") as fh:
        fh.writelines(
            f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items())
            for group, entries in project["entry-points"].items()
        )
    paths = [site, EXAMPLE_PLUGIN]
    old_pythonpath = os.environ.get("PYTHONPATH")
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + ([old_pythonpath] if old_pythonpath else []))
    try:
        yield site
    finally:
        for path in paths:
            sys.path.remove(path)
        if old_pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_pythonpath
        shutil.rmtree(site, ignore_errors=True)
