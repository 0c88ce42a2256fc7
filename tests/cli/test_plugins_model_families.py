"""``fastdeploy plugins --model DIR`` names the plugin and the implementation serving each of the
Qwen and ERNIE architectures, under ``--model-impl auto`` and ``fastdeploy`` alike."""

import json

import pytest
from typer.testing import CliRunner

from fastdeploy_core.cli.main import app

#: architecture -> (plugin name, native target)
SERVED = {
    "Qwen2ForCausalLM": ("qwen", "fd_qwen.qwen:Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen", "fd_qwen.qwen:Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen", "fd_qwen.qwen:Qwen3MoeForCausalLM"),
    "Ernie4_5ForCausalLM": ("ernie", "fd_ernie.ernie:Ernie4_5ForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("ernie", "fd_ernie.ernie:Ernie4_5_MoeForCausalLM"),
}


@pytest.mark.parametrize("impl", ["auto", "fastdeploy"])
@pytest.mark.parametrize("architecture", sorted(SERVED))
def test_plugins_names_the_plugin_and_implementation(tmp_path, architecture, impl):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    plugin, target = SERVED[architecture]
    runner = CliRunner()
    result = runner.invoke(app, ["plugins", "--json", "--model", str(tmp_path), "--model-impl", impl])
    assert result.exit_code == 0, result.output
    model = json.loads(result.stdout)["model"]
    assert (model["architecture"], model["plugin"], model["impl"], model["target"]) == (
        architecture,
        plugin,
        "fastdeploy",
        target,
    )
    text = runner.invoke(app, ["plugins", "--model", str(tmp_path), "--model-impl", impl])
    assert text.exit_code == 0
    assert f"({architecture}): served by plugin {plugin}, the fastdeploy implementation ({target})" in text.stdout
