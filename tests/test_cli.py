import pytest

from dflash_compile.cli import main


def test_explain_on_the_built_in_default(capsys):
    assert main(["explain", "--family", "olmoe", "--tokens", "5", "--repeats", "1", "--graphs"]) == 0
    out = capsys.readouterr().out
    assert "graphs: 1, graph breaks: 0" in out
    assert "pass matches: expert_dispatch=2" in out
    assert out.count("torch.ops.dflash.moe_dispatch.default(") == 2
    difference = float(out.split("max |compiled - eager| logits: ")[1].split()[0])
    assert difference <= 1e-4


def test_explain_on_a_checkpoint_directory(tiny_dirs, capsys):
    assert main(["explain", "--model", str(tiny_dirs("qwen3_moe")), "--tokens", "4", "--repeats", "1"]) == 0
    assert "pass matches: expert_dispatch=2" in capsys.readouterr().out


def test_argument_errors(capsys):
    with pytest.raises(SystemExit, match="--tokens must be at least 1"):
        main(["explain", "--tokens", "0"])
    with pytest.raises(SystemExit):
        main(["explain", "--family", "llama"])
    assert "invalid choice: 'llama'" in capsys.readouterr().err
