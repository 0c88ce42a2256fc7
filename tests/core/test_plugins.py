"""Plugin discovery through real entry points, the allow-list, and every failure mode."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.errors import DeviceUnavailableError, UnsupportedArchitectureError
from fastdeploy_core.plugins import load_plugins

from .fake_dists import DEVICE_PLUGIN, describe, make_dist, run_python

CHIP_DISTS = ["fd-nvidia", "fd-kunlunxin", "fd-hygon", "fd-iluvatar", "fd-enflame", "fd-metax", "fd-gaudi"]


def by_name(rows):
    return {row["name"]: row for row in rows}


def test_installed_plugins_are_discovered_through_their_entry_points():
    rows, _ = describe()
    names = by_name(rows)
    assert names["builtin"]["distribution"] == "fastdeploy-core"
    assert names["builtin"]["registered"]["devices"][0] == "cpu"
    assert names["llama"]["distribution"] == "fd-llama"
    assert "LlamaForCausalLM (fastdeploy)" in names["llama"]["registered"]["models"]
    distributions = {row["distribution"] for row in rows}
    assert set(CHIP_DISTS + ["fd-paddleformers", "fd-llama"]) <= distributions
    assert all(row["status"] == "loaded" for row in rows)


def test_allow_list_filters_plugins_and_keeps_builtins():
    rows, _ = describe(plugins="llama")
    assert sorted(by_name(rows)) == ["builtin", "llama"]
    rows, _ = describe(plugins="")
    assert sorted(by_name(rows)) == ["builtin"]


def test_duplicate_device_name_is_an_error_naming_both_distributions(tmp_path):
    make_dist(tmp_path, "fd-chip-one", "fd_chip_one", "chipone", DEVICE_PLUGIN.format(priority=5, available=True))
    make_dist(tmp_path, "fd-chip-two", "fd_chip_two", "chiptwo", DEVICE_PLUGIN.format(priority=5, available=True))
    proc = run_python("from fastdeploy_core.plugins import load_plugins; load_plugins()", tmp_path, "chipone,chiptwo")
    assert proc.returncode != 0
    assert "DuplicateRegistrationError" in proc.stderr
    assert "fd-chip-one" in proc.stderr and "fd-chip-two" in proc.stderr and "'fakechip'" in proc.stderr


def test_plugin_failing_on_import_is_isolated_and_named(tmp_path):
    make_dist(
        tmp_path,
        "fd-kunlunxin",
        "fd_kunlunxin_broken",
        "kunlunxin",
        "raise ImportError('libxpurt.so: cannot open shared object file')\n",
        version="9.9",
    )
    code = """
    import warnings
    warnings.simplefilter("always")
    from fastdeploy_core.plugins import load_plugins
    pm = load_plugins()
    print(sorted(p.name for p in pm.plugins))
    try:
        pm.select_device("xpu")
    except Exception as exc:
        print(type(exc).__name__, exc)
    """
    proc = run_python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    loaded, error = proc.stdout.strip().splitlines()
    assert "'llama'" in loaded and "'kunlunxin'" not in loaded and "'builtin'" in loaded
    assert "plugin 'kunlunxin' (fd-kunlunxin) is not loaded" in proc.stderr
    assert "libxpurt.so" in proc.stderr
    assert error.startswith("DeviceUnavailableError")
    assert "fd-kunlunxin" in error and "failed to load" in error and "libxpurt.so" in error


def test_plugin_with_other_api_version_is_refused(tmp_path):
    code = DEVICE_PLUGIN.format(priority=1, available=True).replace(
        "FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION", "FD_PLUGIN_API_VERSION = 99"
    )
    make_dist(tmp_path, "fd-oldchip", "fd_oldchip", "oldchip", code)
    rows, stderr = describe(tmp_path, plugins="oldchip")
    failed = by_name(rows)["oldchip"]
    assert failed["status"] == "failed"
    assert "FD_PLUGIN_API_VERSION=99" in failed["error"]
    assert f"speaks version {PLUGIN_API_VERSION}" in failed["error"]
    assert "fd-oldchip" in stderr


@pytest.mark.parametrize("available", [True, False])
def test_auto_device_takes_highest_priority_available(tmp_path, available):
    make_dist(tmp_path, "fd-fakechip", "fd_fakechip", "fakechip", DEVICE_PLUGIN.format(priority=50, available=available))
    code = """
    from fastdeploy_core.plugins import load_plugins
    pm = load_plugins()
    print(pm.select_device("auto").name)
    try:
        print(pm.select_device("fakechip").name)
    except Exception as exc:
        print(type(exc).__name__, exc)
    """
    proc = run_python(code, tmp_path, plugins="fakechip")
    assert proc.returncode == 0, proc.stderr
    auto, explicit = proc.stdout.strip().splitlines()
    if available:
        assert (auto, explicit) == ("fakechip", "fakechip")
    else:
        assert auto == "cpu"
        assert explicit.startswith("DeviceUnavailableError")
        assert "installed but not usable here: Paddle was not built with fakechip support" in explicit


def test_device_no_plugin_provides_names_the_package(monkeypatch):
    monkeypatch.setenv("FD_PLUGINS", "")
    pm = load_plugins()
    with pytest.raises(DeviceUnavailableError, match="install the plugin package `fd-kunlunxin`"):
        pm.select_device("xpu")
    with pytest.raises(DeviceUnavailableError, match="install the plugin package `fd-nvidia`"):
        pm.select_device("gpu")
    assert pm.select_device("cpu").name == "cpu"


def test_model_impl_selection_errors(monkeypatch):
    monkeypatch.setenv("FD_PLUGINS", "llama")
    pm = load_plugins()
    target, impl, _ = pm.model_provider("LlamaForCausalLM", "auto")
    assert impl == "fastdeploy" and target == "fd_llama.llama:LlamaForCausalLM"
    with pytest.raises(UnsupportedArchitectureError, match="no native implementation of 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        pm.model_provider("GPT2LMHeadModel", "fastdeploy")
    with pytest.raises(UnsupportedArchitectureError, match="not supported: native architectures are LlamaForCausalLM"):
        pm.model_provider("GPT2LMHeadModel", "auto")


def test_plugins_json_command_lists_every_plugin():
    exe = shutil.which("fastdeploy") or str(Path(sys.executable).parent / "fastdeploy")
    out = subprocess.run([exe, "plugins", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["plugin_api_version"] == PLUGIN_API_VERSION
    rows = by_name(data["plugins"])
    assert rows["builtin"]["registered"]["devices"][0] == "cpu"
    assert rows["llama"]["version"] == "0.1.0"
    assert set(rows["llama"]["registered"]) == {
        "devices", "models", "quantizers", "schedulers", "proposers", "router_policies", "guided_backends",
        "tool_parsers", "reasoning_parsers",
    }
    assert rows["builtin"]["registered"]["proposers"] == ["ngram", "draft_model", "mtp"]
    assert rows["builtin"]["registered"]["router_policies"] == [
        "random", "round_robin", "power_of_two", "request_num", "process_tokens", "cache_aware",
    ]
    assert rows["builtin"]["registered"]["guided_backends"] == ["guidance"]
    assert rows["builtin"]["registered"]["reasoning_parsers"] == ["deepseek_r1", "qwen3"]


def test_plugins_command_says_which_implementation_serves_a_model(tmp_path):
    exe = shutil.which("fastdeploy") or str(Path(sys.executable).parent / "fastdeploy")
    out = subprocess.run([exe, "plugins", "--json", "--model", "default"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    model = json.loads(out.stdout)["model"]
    assert model["architecture"] == "LlamaForCausalLM" and model["impl"] == "fastdeploy"
    assert model["target"] == "fd_llama.llama:LlamaForCausalLM"
    assert model["reason"] == "native implementation of LlamaForCausalLM"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    out = subprocess.run(
        [exe, "plugins", "--model", str(tmp_path), "--model-impl", "fastdeploy"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert "no native implementation of 'GPT2LMHeadModel'" in out.stderr


def test_plugins_command_lists_the_gguf_architectures_a_plugin_registered():
    exe = shutil.which("fastdeploy") or str(Path(sys.executable).parent / "fastdeploy")
    out = subprocess.run([exe, "plugins"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    llama = out.stdout.split("llama  (fd-llama ")[1].split("\n")
    assert "    gguf architectures: llama -> LlamaForCausalLM" in llama[:4]
    data = json.loads(subprocess.run([exe, "plugins", "--json"], capture_output=True, text=True, timeout=120).stdout)
    rows = by_name(data["plugins"])
    assert rows["llama"]["gguf_architectures"] == ["llama -> LlamaForCausalLM"]
    assert rows["builtin"]["gguf_architectures"] == []
