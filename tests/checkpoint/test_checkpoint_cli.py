"""The checkpoint command line names the formats it writes and refuses what it cannot name."""

import pytest

from lightning_seqpar.checkpoint.__main__ import main
from lightning_seqpar.checkpoint.hf_from_checkpoint import find_prefix


@pytest.mark.parametrize("out", ["model_dir", "model.bin", "weights.ckpt"])
def test_consolidate_refuses_an_output_without_a_format_suffix(tmp_path, capsys, out):
    assert main(["consolidate", str(tmp_path), str(tmp_path / out)]) == 2
    error = capsys.readouterr().err
    assert f"{out}: name the output file NAME.safetensors, NAME.pt or NAME.pth" in error and "export-hf" in error
    assert not (tmp_path / out).exists()


def test_the_hugging_face_model_is_found_under_its_attribute_in_the_module():
    expected = {"model.embed_tokens.weight": (8, 4), "lm_head.weight": (8, 4)}
    stored = {"model.model.embed_tokens.weight": 0, "model.lm_head.weight": 0, "other.model.embed_tokens.weight": 0}
    assert find_prefix(expected, stored) == "model."
    assert find_prefix(expected, {k[len("model."):]: 0 for k in stored if k.startswith("model.")}) == ""
    with pytest.raises(ValueError, match=r"\['lm_head.weight'\] \(under prefix 'other.'\) are missing.*--config"):
        find_prefix(expected, {"other.model.embed_tokens.weight": 0})
