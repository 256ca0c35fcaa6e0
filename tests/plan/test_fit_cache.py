"""The probes' fits kept on disk (:mod:`lightning_seqpar.plan.measuring.fit_cache`): read back as measured, keyed by
what measured them (a changed library or package source measures again), a damaged file measured again rather than
trusted; the command line answers a repeated question, and one differing only in memory, batch, sequence length or
a GPU count whose tensor-parallel sizes were probed, without probing."""

from __future__ import annotations

import json

import pytest

from lightning_seqpar.plan.measuring import fits, models
from lightning_seqpar.plan.__main__ import main
from lightning_seqpar.plan.measuring.fit_cache import FitCache, library_salt
from lightning_seqpar.plan.measuring.probe import LayerFit, OutsideFit
from lightning_seqpar.plan.measuring.work import ContextWork, WorkFit

FITS = {("model", 2, "none", "bf16-mixed"): LayerFit((1.5, 2.0), 0.01, (1.0, 2.0)),
        ("model", 1, "full", "32-true", ("mlp",), ()): LayerFit((3.0,), 0.0),
        ("model", "outside", 2, "bf16-mixed", "none"): OutsideFit((1.0, -0.5), 0.02, (0.0, 8.0)),
        ("model", "work", 2, "none", "bf16-mixed", (), (), False): WorkFit(10.0, (1.0,), 4.0, (2.0,), (0.1, 0.2)),
        ("context work", 2, "ring", 4, 2, 8, "bf16-mixed", True): ContextWork(5.0, 2.0, (1.0, 2.0), (0.5, 1.0))}


def test_fits_are_read_back_as_written_by_another_question(tmp_path):
    written = FitCache(tmp_path, salt="a")
    for key, fit in FITS.items():
        written[key] = fit
    assert written.written == len(FITS) and written.read == 0
    again = FitCache(tmp_path, salt="a")
    assert all(key in again for key in FITS) and {key: again[key] for key in FITS} == FITS
    assert again.read == len(FITS)
    assert ("model", 4, "none", "bf16-mixed") not in again


def test_another_library_or_source_measures_again(tmp_path):
    key = next(iter(FITS))
    FitCache(tmp_path, salt="a")[key] = FITS[key]
    assert key not in FitCache(tmp_path, salt="b")
    assert len(library_salt()) == 64 and library_salt() == library_salt()  # the versions and this package's source


@pytest.mark.parametrize("damage", ["half", "other key", "other type"])
def test_a_damaged_file_is_measured_again_not_trusted(tmp_path, damage):
    key = next(iter(FITS))
    FitCache(tmp_path, salt="a")[key] = FITS[key]
    (path,) = tmp_path.glob("*.json")
    if damage == "half":
        path.write_text(path.read_text()[:40])
    else:
        stored = json.loads(path.read_text())
        stored.update({"other key": dict(key="('model', 8)"), "other type": dict(type="Path")}[damage])
        path.write_text(json.dumps(stored))
    assert key not in FitCache(tmp_path, salt="a")


SMALL_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=256,
                   intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                   max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_a_question_asked_again_or_changed_in_size_is_answered_without_probing(tmp_path, capsys, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(SMALL_LLAMA))
    cache = ["--cache", str(tmp_path / "cache")]
    ask = [str(tmp_path), "--gpus", "2", "--seq-len", "512", "--global-batch", "8", "--cp", "1", "--schedule", "1F1B",
           "--top", "3", *cache]
    assert main(ask) == 0
    first = capsys.readouterr().out
    assert "0 probe fits read from" in first and " probed and kept there;" in first
    kinds = [json.loads(path.read_text())["type"] for path in (tmp_path / "cache").glob("*.json")]
    probed = len(kinds) - kinds.count("InventoryRecord")
    assert probed > 0 and kinds.count("InventoryRecord") == 1 and "0 of 1 model inventories" in first

    def refuse(*args, **kwargs):
        raise AssertionError("probed although the fit is on disk")

    built = models.meta_model
    for module, name in ((fits, "fit_layer"), (fits, "fit_outside"), (fits, "fit_work"), (models, "meta_model")):
        monkeypatch.setattr(module, name, refuse)
    assert main(ask) == 0
    again = capsys.readouterr().out
    assert again.split("\nAnswered in")[0] == first.split("\nAnswered in")[0]  # the same answer, from the disk
    assert f"({probed} probe fits read from" in again and "0 probed" in again and "1 of 1 model inventories" in again
    for changed in (["--gpu-memory", "24GB"], ["--global-batch", "16"], ["--seq-len", "2048"], ["--gpus", "1"]):
        question = list(ask)
        flag = changed[0]
        if flag in question:
            question[question.index(flag) + 1] = changed[1]
        else:
            question += changed
        assert main(question) == 0, changed
        assert "0 probed" in capsys.readouterr().out, changed
    monkeypatch.setattr(models, "meta_model", built)  # another model is built, then probed
    (tmp_path / "config.json").write_text(json.dumps(dict(SMALL_LLAMA, intermediate_size=512)))
    with pytest.raises(AssertionError, match="probed although"):
        main(ask)
